"""Data preparation: long-context QA sets from the official HotpotQA, 2Wiki, MuSiQue and SQuAD files (see README.md)."""
