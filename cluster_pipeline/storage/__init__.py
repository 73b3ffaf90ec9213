"""Where things are kept: Delta tables and their versions, what each of their columns means, every
stage's table name, the data folder's layout and paths, content-keyed caches, the per-sample
embedding cache, the lineage join of every stage's table, the JSON job files a Dagster asset
writes for its torchrun ranks, the one-run-per-partition lock file, and atomic writes of files
and folders. The bottom layer: it imports nothing else of the project, and everything above
reads and writes through it. Its modules are listed in docs/design.md, "Code layout".
"""
