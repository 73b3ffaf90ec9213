"""From files to token ids: reading a user's dataset folder in any accepted record form and file
type into samples (strict JSON, field renaming, source file and line kept), the dataset
partitions and the held-out split, the built-in pool, chat-template rendering, masking and
truncation, and padding-free batch layout. Record forms and file readers are registries that grow
by one module each. Imports only ``storage``; its modules are listed in docs/design.md, "Code
layout".
"""
