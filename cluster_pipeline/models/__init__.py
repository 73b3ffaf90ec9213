"""Loading base models and tokenizers (``loading``): the built-in SmolLM2 from its GGUF file,
any ``save_pretrained`` folder, empty (meta-device) models for sharded loading. Imports only
``storage``.
"""
