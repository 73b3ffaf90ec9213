"""Judging a checkpoint: held-out loss and the benchmark suites (one module per suite, each
declaring its metrics with their units and direction), the sandbox that runs generated code,
paired bootstrap statistics, the report's numbers, its rendering and its figures. Imports the
layers below and reads ``training``'s checkpoint catalogue; its modules are listed in
docs/design.md, "Code layout".
"""
