"""Starting processes that must not outlive their step: torchrun command lines and per-rank
failure reports (``torchrun``), the launcher that dies with its parent (``launcher``, ``fate``)
and the same as a Slurm batch job (``slurm``). Like datatrove's ``executor/``: how work runs,
not what it computes. Imports nothing from ``recipes`` or ``defs``.
"""
