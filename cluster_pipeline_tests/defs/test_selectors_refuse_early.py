"""Issue 43's case through the assets: a pool of 3 clustered for 2 ranks. Each unclustered
selector with passes of its own (ifd, rds, s2l, less) is refused by ``peripheral_subsets``
before any of its passes (no model pass cached, no proxy trained), naming the knob; no
subset is written. The exact messages are tested in selection/test_fill_ranks.py."""

import dagster as dg
import numpy as np
import pytest

from cluster_pipeline.defs.partitions import DATASETS
from cluster_pipeline.selection.selectors import REGISTRY, fill_problems
from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline_tests.helpers import (
    materialize_partition,
    pipeline_assets,
    read,
    resources,
    run_config_for,
    seed_embeddings,
    step_failure,
)

pytestmark = pytest.mark.slow

ASSETS = pipeline_assets()
CHAIN, SUBSETS = ASSETS[:3], ASSETS[3]
# The unclustered selectors with passes of their own (a clustered one fills this pool: each
# cluster keeps its first sample).
WITH_PASSES = [
    s for s, spec in REGISTRY.items() if set(spec.passes) - {"embedding"} and not spec.clustered
]


def test_a_pool_too_small_for_the_ranks_is_refused_before_any_pass(
    tiny_data_dir, tiny_model_dir, tiny_embedding_cache
):
    seed_embeddings(tiny_embedding_cache, tiny_data_dir)
    layout = DataLayout.at(tiny_data_dir)
    res = resources(tiny_data_dir, tiny_model_dir)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        config = run_config_for(
            CHAIN, raw_instructions={"heldout_fraction": 0.0, "max_train_samples": 3}
        )
        assert materialize_partition(CHAIN, instance, res, run_config=config).success
        clusters = read(instance, "balanced_clusters")
        lengths = read(instance, "proxy_embeddings").select("sample_id", "n_tokens")
        pool = clusters.join(lengths, on="sample_id", how="left", maintain_order="left")
        labels, tokens = pool["cluster"].to_numpy(), pool["n_tokens"].to_numpy()
        assert len(labels) == 3 and sorted(np.bincount(labels).tolist()) == [1, 2]
        caches = sorted(p.name for p in layout.embeddings_dir("tiny").iterdir())
        for selector in WITH_PASSES:
            expected = fill_problems(selector, labels, 2, 0.5, "tokens", tokens)
            assert expected, selector  # this pool is too small for an unclustered selector
            result = materialize_partition(
                [SUBSETS],
                instance,
                res,
                run_config=run_config_for([SUBSETS], peripheral_subsets={"selector": selector}),
                raise_on_error=False,
            )
            assert not result.success
            description, _ = step_failure(result)
            assert description.startswith("tiny: ") and expected[0] in description, description
        # No selector's pass ran: no new cache folder, no proxy run, no subset written.
        assert sorted(p.name for p in layout.embeddings_dir("tiny").iterdir()) == caches
        assert not layout.proxies_dir("tiny").exists()
        assert not (tiny_data_dir / "tables" / "peripheral_subsets").exists()
