"""Data-parallel fine-tuning's parts: the knobs and job files (``config``), the step plan
(``plan``), one step's forward and backward (``step``), the loop (``loop``), how a rank holds the
model (``parallel``: DDP, FSDP2, LoRA), checkpoints written and read (``checkpointing``, the one
home), memory estimated and measured (``memory``), the inter-rank gradient sketch
(``gradients``) and the rank environment (``distributed``). Imports the layers below.
"""
