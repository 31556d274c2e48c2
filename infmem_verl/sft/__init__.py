"""The SFT warm-up: distilled teacher calls as verl SFT samples, and their training.

* :mod:`.records`: the token ids of distilled calls as stored in distillation records;
* :mod:`.samples`: one SFT sample per call (loss on generated tokens only), answer up-weighting,
  the parquet writer;
* :mod:`.shorten`: optional rewriting of over-long thinking;
* :mod:`.dataset`: verl's SFT dataset serving those token ids (``data.custom_cls``);
* :mod:`.launch`: the entry point ``python -m infmem_verl.sft +recipe=...`` (verl's SFT trainer,
  or :mod:`.cpu` without a GPU).

Submodules are imported explicitly: :mod:`.dataset`, :mod:`.cpu` and :mod:`.launch` import verl,
the others do not.
"""
