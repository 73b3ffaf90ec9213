"""Data-parallel fine-tuning's parts: the knobs and job files, the step plan, one step's forward
and backward, the loop, how a rank holds the model (DDP, FSDP2, LoRA), checkpoints written and
read (the one home), memory estimated and measured, the inter-rank gradient sketch, the rank
environment, and the model passes selectors need (the embedding pass, LESS's gradients, S2L's
proxy run). Imports the layers below; its modules are listed in docs/design.md, "Code layout".
"""
