"""Loading base models and tokenizers: the built-in SmolLM2 from its GGUF file, any
``save_pretrained`` folder, empty (meta-device) models for sharded loading. Imports only
``storage``; its modules are listed in docs/design.md, "Code layout".
"""
