"""The ``python -m`` entry points torchrun starts, thin as torchtune's recipes: the gradient-proxy
embedding pass, data-parallel fine-tuning and one model's evaluation. Each reads a job file,
calls the library below and reports through rank 0. Nothing the Dagster definitions load imports
a recipe (a test holds that); its modules are listed in docs/design.md, "Code layout".
"""
