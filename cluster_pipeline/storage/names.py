"""The name of every stage, once: its Dagster asset key, its Delta table's folder under
``data/tables/`` and the key other stages' records use for its table version."""

RAW_INSTRUCTIONS = "raw_instructions"
PROXY_EMBEDDINGS = "proxy_embeddings"
BALANCED_CLUSTERS = "balanced_clusters"
CLUSTER_CENTROIDS = "cluster_centroids"  # written by balanced_clusters
PERIPHERAL_SUBSETS = "peripheral_subsets"
SELECTION_TARGETS = "selection_targets"  # written by peripheral_subsets (rds's target set)
S2L_TRAJECTORIES = "s2l_trajectories"  # written by peripheral_subsets (s2l's loss trajectories)
LESS_GRADIENTS = "less_gradients"  # written by peripheral_subsets (less's projected gradients)
SHARD_MANIFESTS = "shard_manifests"
TRAINED_CHECKPOINT = "trained_checkpoint"
EVAL_REPORT = "eval_report"
EVAL_ITEM_SCORES = "eval_item_scores"  # written by eval_report
SAMPLE_LINEAGE = "sample_lineage"
