"""Sample ids are unique within every input: the ledger each reader keeps while samples enter.

A results store, a document store and an SFT file are all keyed by sample id, so two samples
with one id make one of them vanish from every figure without a word (a concatenated or
hand-edited file does exactly that). Each place a sample enters (``data_prep``'s readers and
writers, the dataset command line, evaluation and distillation sources, SFT rows) records every
id with where it came from, and a repeat is refused with both positions named.
"""

from __future__ import annotations

from typing import Hashable


class DuplicateIdError(ValueError):
    """A sample id that an earlier sample of the same input already has; names both places."""


class IdLedger:
    """The ids seen so far in one input, each with the place it was first seen.

    ``field`` is how messages name the id (``id``, or ``index`` where ids derive from it). Holds one
    short string per id: a 90k-question training split costs a few MB.
    """

    def __init__(self, field: str = "id") -> None:
        self.field = field
        self._first: dict[Hashable, str] = {}

    def __len__(self) -> int:
        return len(self._first)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._first

    def repeat(self, key: Hashable, where: str, field: str | None = None) -> str | None:
        """Record ``key`` as seen at ``where``; for a key seen before, return the refusal (naming
        both places) and keep the first place."""
        first = self._first.get(key)
        if first is None:
            self._first[key] = where
            return None
        return f"{where}: field {field or self.field!r}: {key!r} repeats the id of {first}"

    def claim(self, key: Hashable, where: str, field: str | None = None) -> None:
        """:meth:`repeat`, raising :class:`DuplicateIdError` for a repeat."""
        refusal = self.repeat(key, where, field)
        if refusal is not None:
            raise DuplicateIdError(refusal)
