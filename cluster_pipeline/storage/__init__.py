"""Where things are kept: Delta tables and their versions (``tables``), what each of their
columns means (``columns``), every stage's table name (``names``), the data folder's layout and
paths (``layout``), content-keyed caches (``cache``), the per-sample embedding cache
(``embedding_cache``), the lineage join of every stage's table (``lineage``), the JSON job files
a Dagster asset writes for its torchrun ranks (``job_files``) and the one-run-per-partition lock
file (``run_lock``). The bottom layer: it imports nothing else of the project, and everything
above reads and writes through it.
"""
