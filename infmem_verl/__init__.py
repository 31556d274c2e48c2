"""infmem-verl: bounded-memory agents for question answering over ultra-long documents, on verl."""

__version__ = "0.1.0"
