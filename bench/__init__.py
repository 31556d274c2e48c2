"""Benchmarks: runnable scripts that print measurements and assert nothing."""
