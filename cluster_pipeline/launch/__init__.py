"""Starting processes that must not outlive their step: torchrun command lines and per-rank failure
reports, the launcher that dies with its parent and the guard every commit checks, and the same
as a Slurm batch job. Like datatrove's ``executor/``: how work runs, not what it computes. Reads
only ``storage`` (the lock it guards); its modules are listed in docs/design.md, "Code layout".
"""
