"""What infmem-verl registers into verl: the agent loops (``agent_loop``), the trainer mode
``infmem_sync`` (``trainer``), and the CLI writing verl's training parquet (``dataset``). Modules are
imported explicitly (:mod:`infmem_verl.plugin` imports the ones that register with verl); importing
this package alone pulls in nothing heavy."""
