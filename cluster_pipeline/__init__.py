"""CluSTER: clustering-based balanced sampling and allocation for data-parallel fine-tuning.

One folder per domain, imports pointing one way; docs/design.md, "Code layout", describes the
layers, each folder's role and its modules (``cluster_pipeline_tests/test_layout.py`` holds the
code to it).
"""

__version__ = "0.1.0"
