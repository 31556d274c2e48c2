"""The paper-era analyzer of the reference's evaluation and distillation: ``lower().split()``.

Kept apart from :class:`~infmem_verl.agent.retrieval.Analyzer` (ours) so that a checkpoint
distilled and evaluated with the reference's retrieval can be evaluated with the same retrieval
(``retrieval.analyzer=whitespace``). Punctuation stays glued to words ("Paris," is not "paris")
and there is no stemming or stopword list; that is what the paper's numbers were measured with.
"""

from __future__ import annotations


class WhitespaceAnalyzer:
    """Lowercase, split on whitespace; the same for units and queries."""

    def words(self, text: str) -> list[str]:
        return text.lower().split()

    def analyze(self, text: str) -> list[str]:
        return self.words(text)
