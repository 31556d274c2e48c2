"""The verl side of infmem-verl: agent loops, the trainer mode, documents by reference, and the
``infmem.*`` config records. Modules are imported explicitly (the plugin imports the ones that
register with verl); importing this package alone pulls in nothing heavy."""
