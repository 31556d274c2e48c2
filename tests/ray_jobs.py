"""Helpers of the tests that submit real Ray jobs to a real job server (tests/test_preflight.py,
tests/test_cluster.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def submit_when_ready(submit: Callable[[], T], seconds: float = 120) -> T:
    """``submit()`` once the job server takes jobs: its job agent starts a few seconds after the
    head (longer on loaded cores), and until then a submission fails with a RuntimeError."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return submit()
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def wait_for_job(client, job: str, seconds: float = 600):
    """The final status of ``job`` (TimeoutError, naming the last status, after ``seconds``)."""
    from ray.job_submission import JobStatus

    deadline = time.monotonic() + seconds
    while (status := client.get_job_status(job)) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        if time.monotonic() > deadline:
            raise TimeoutError(f"Ray job {job} still {status} after {seconds:.0f} s")
        time.sleep(0.5)
    return status
