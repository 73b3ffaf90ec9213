"""Where things are kept: Delta tables and their versions (``tables``), the data folder's
layout and paths (``layout``), content-keyed caches (``cache``), the per-sample embedding cache
(``embedding_cache``) and the lineage join of every stage's table (``lineage``). The bottom
layer: it imports nothing else of the project, and everything above reads and writes through it.
"""
