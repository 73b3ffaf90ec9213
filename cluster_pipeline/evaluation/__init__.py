"""Judging a checkpoint: the benchmark suites and their scorers (``suites``), the sandbox that
runs generated code (``sandbox``), paired bootstrap statistics (``statistics``), the report's
numbers (``report``), its rendering (``render``) and the figures (``plots``). Imports the layers
below and reads ``training``'s checkpoint catalogue.
"""
