"""The selectors with passes of their own (rds: the target set; ifd: the responses without
their prompts) run through the assets on a tiny random model and the 60-sample dataset: the
pass is cached per sample, the subset is dealt into random balanced shards with weight 1, and
the cost record counts every forward pass."""

import logging
import math
from collections import Counter

import dagster as dg
import numpy as np
import polars as pl
import pytest

from cluster_pipeline.defs.partitions import DATASETS
from cluster_pipeline_tests.helpers import (
    materialize_partition,
    meta,
    pipeline_assets,
    read,
    resources,
    run_config_for,
    seed_embeddings,
    step_failure,
    write_jsonl,
)

ASSETS = pipeline_assets()
CHAIN, SELECTION = ASSETS[:3], ASSETS[3:5]


def assert_peaks_recorded(m: dict) -> None:
    """Every pass of a cost record has its largest rank's peak memory: resident memory of a
    process that imported torch (over 100 MiB), no CUDA memory on the CPU; the record's peak
    is the largest of them."""
    rss = [p["peak_rss_mib"] for p in m["selection_passes"]]
    assert all(r is not None and r > 100 for r in rss), rss
    assert all(p["peak_cuda_mib"] == 0.0 for p in m["selection_passes"])
    assert m["selection_peak_rss_mib"] == max(rss) and m["selection_peak_cuda_mib"] == 0.0


@pytest.mark.slow
def test_rds_selects_towards_a_target_folder_through_the_assets(
    tiny_data_dir, tiny_model_dir, tiny_embedding_cache, tmp_path
):
    seed_embeddings(tiny_embedding_cache, tiny_data_dir)
    res = resources(tiny_data_dir, tiny_model_dir)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        assert materialize_partition(CHAIN, instance, res).success
        # The target set: four training samples of the pool itself, so each target's most
        # similar pool sample is its own copy (cosine 1): round 1 of the round-robin takes
        # exactly them, in target order.
        train = read(instance, "raw_instructions").filter(pl.col("split") == "train")
        targets = train.head(4)
        write_jsonl(
            tmp_path / "targets" / "t.jsonl",
            [
                {"instruction": p, "output": r}
                for p, r in zip(targets["prompt"], targets["response"], strict=True)
            ],
        )
        config = {"selector": "rds", "target": str(tmp_path / "targets"), "ratio": 0.5}
        result = materialize_partition(
            SELECTION,
            instance,
            res,
            run_config=run_config_for(SELECTION, peripheral_subsets=config),
        )
        assert result.success
        subsets = read(instance, "peripheral_subsets")
        first = subsets.filter(pl.col("selection_rank") < 4).sort("selection_rank")
        assert first["sample_id"].to_list() == targets["sample_id"].to_list()
        assert first["selected"].all() and first["score"].to_numpy().min() > 0.9999
        assert subsets["score"].null_count() == 0 and (subsets["weight"] == 1.0).all()
        m = meta(instance, "peripheral_subsets")
        assert m["selection_target"] == str(tmp_path / "targets")
        assert m["selection_target_samples"] == 4
        # RDS+'s own pass over the pool (position-weighted pooling), then the targets'.
        assert [p["name"] for p in m["selection_passes"]] == ["rds_pool", "targets"]
        assert m["forward_passes"] == subsets.height + 4 and m["backward_passes"] == 0
        assert m["selection_passes"][1]["run_now"] == 4
        assert_peaks_recorded(m)
        assert "selection_targets" in m["inputs"]
        # Random balanced shards (the paper's baselines): weight 1, every selected sample once.
        shards = read(instance, "shard_manifests")
        assert Counter(shards["sample_id"]) == Counter(
            subsets.filter(pl.col("selected"))["sample_id"]
        )
        assert (shards["weight"] == 1.0).all()
        assert all(c.passed for c in result.get_asset_check_evaluations())

        # Again: the target pass comes from its cache, the selection is the same.
        assert materialize_partition(
            SELECTION,
            instance,
            res,
            run_config=run_config_for(SELECTION, peripheral_subsets=config),
        ).success
        again = meta(instance, "peripheral_subsets")
        assert again["selection_passes"][1]["run_now"] == 0
        assert read(instance, "peripheral_subsets")["selected"].equals(subsets["selected"])

        # A target set that does not exist is refused before any pass.
        bad = materialize_partition(
            SELECTION[:1],
            instance,
            res,
            run_config=run_config_for(
                SELECTION[:1], peripheral_subsets={**config, "target": str(tmp_path / "none")}
            ),
            raise_on_error=False,
        )
        assert not bad.success
        assert "nor an existing folder" in step_failure(bad)[0]


@pytest.mark.slow
def test_ifd_scores_the_pool_with_a_second_pass_without_prompts(
    tiny_data_dir, tiny_model_dir, tiny_embedding_cache
):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster_pipeline.data.tokenization import (
        encode_sample,
        end_of_turn_ids,
        generation_header,
        response_only,
        without_end_of_turn,
    )

    seed_embeddings(tiny_embedding_cache, tiny_data_dir)
    res = resources(tiny_data_dir, tiny_model_dir)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        assets = [*CHAIN, *SELECTION]
        result = materialize_partition(
            assets,
            instance,
            res,
            run_config=run_config_for(
                assets,
                proxy_embeddings={"world_size": 2},
                peripheral_subsets={"selector": "ifd"},
            ),
        )
        assert result.success
        subsets = read(instance, "peripheral_subsets")
        emb = read(instance, "proxy_embeddings").select("sample_id", "mean_loss")
        n = subsets.height
        m = meta(instance, "peripheral_subsets")
        # Its own two passes (both without the end-of-turn tokens); not the embedding pass.
        assert [p["name"] for p in m["selection_passes"]] == ["conditioned", "unconditioned"]
        assert m["forward_passes"] == 2 * n and m["backward_passes"] == 0
        assert m["selection_passes"][1]["run_now"] == n
        assert_peaks_recorded(m)
        # The kept samples are the most difficult of those with IFD <= 1 (a prefix of the order).
        kept = subsets.filter(pl.col("selected"))["score"].to_numpy()
        left = subsets.filter(~pl.col("selected") & (pl.col("score") <= 1))["score"].to_numpy()
        assert kept.max() <= 1 and (len(left) == 0 or kept.min() >= left.max())
        # The truncated samples are unscored, as Cherry drops them.
        cut = read(instance, "proxy_embeddings").filter(pl.col("truncated"))["sample_id"]
        assert subsets.filter(pl.col("sample_id").is_in(cut.implode()))["score"].null_count() == (
            len(cut)
        )
        assert (read(instance, "shard_manifests")["weight"] == 1.0).all()
        # A budget the samples with IFD <= 1 cannot fill is the step's warning, with counts
        # (the default balance is by tokens: K floor(r x the smallest cluster's tokens)).
        assert m["balance"] == "tokens"
        tokens = np.bincount(
            subsets["cluster"].to_numpy(), weights=subsets["n_tokens"].to_numpy()
        ).astype(np.int64)
        budget = len(tokens) * math.floor(round(m["ratio"] * tokens.min(), 9))
        eligible = subsets.filter(pl.col("score") <= 1).height
        held = int(subsets.filter(pl.col("score") <= 1)["n_tokens"].sum())
        warnings = [
            e.user_message
            for e in instance.all_logs(result.run_id)
            if e.step_key == "peripheral_subsets" and e.level == logging.WARNING
        ]
        expected = [
            f"tiny: ifd: only {eligible} of the {n} samples have IFD <= 1, the only ones Cherry "
            f"keeps (data_by_IFD.py:106), holding {held} tokens, fewer than the budget of "
            f"{budget} tokens that ratio {m['ratio']} gives; all {eligible} are kept, a data "
            f"fraction of {eligible / n:.3f}"
        ]
        assert warnings == (expected if held < budget else [])
        # An unclustered selector's counts are per k-means cluster, not per rank (the shards
        # are dealt evenly): its line says so.
        infos = [
            e.user_message
            for e in instance.all_logs(result.run_id)
            if e.step_key == "peripheral_subsets" and e.level == logging.INFO
        ]
        (kept_line,) = [line for line in infos if line.startswith("ifd r=")]
        assert "; per k-means cluster (shard_manifests deals it evenly over the ranks) [" in (
            kept_line
        )
        # Kept with the selection: the asset's metadata holds the same lines, unprefixed.
        assert m["selection_notes"] == [w.removeprefix("tiny: ") for w in warnings]
        assert held >= budget or m["selected_samples"] == eligible

        # IFD of the first-ranked sample by hand: both losses from the model directly, over
        # the answer's tokens without the template's end-of-turn marker.
        top = subsets.sort("selection_rank").row(0, named=True)
        raw = read(instance, "raw_instructions").filter(pl.col("sample_id") == top["sample_id"])
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        row = raw.row(0, named=True)
        sample = encode_sample(tokenizer, row["system"], row["prompt"], row["response"], 64)
        sample = without_end_of_turn(sample, end_of_turn_ids(tokenizer))
        alone = response_only(sample, tokenizer, generation_header(tokenizer))

        def loss(s):
            with torch.no_grad():
                out = model(input_ids=torch.tensor([s.input_ids]), labels=torch.tensor([s.labels]))
            return float(out.loss)

        with_marker = emb.filter(pl.col("sample_id") == top["sample_id"])["mean_loss"][0]
        assert with_marker != pytest.approx(loss(sample), rel=1e-4)  # the pool pass scores it
        assert top["score"] == pytest.approx(loss(sample) / loss(alone), rel=1e-4)


@pytest.mark.slow
def test_s2l_trains_a_proxy_and_selects_on_its_loss_trajectories(
    tiny_data_dir, tiny_model_dir, tiny_embedding_cache
):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster_pipeline.data.tokenization import encode_sample

    seed_embeddings(tiny_embedding_cache, tiny_data_dir)
    res = resources(tiny_data_dir, tiny_model_dir)
    s2l = {"selector": "s2l", "s2l_steps": 4, "s2l_checkpoints": 2, "s2l_clusters": 3}
    config = run_config_for(
        [*CHAIN, *SELECTION], proxy_embeddings={"world_size": 2}, peripheral_subsets=s2l
    )
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        result = materialize_partition([*CHAIN, *SELECTION], instance, res, run_config=config)
        assert result.success
        subsets = read(instance, "peripheral_subsets")
        n = subsets.height
        m = meta(instance, "peripheral_subsets")
        # The proxy (4 steps on 2 ranks, a checkpoint every 2), then a loss pass per checkpoint.
        assert [p["name"] for p in m["selection_passes"]] == ["s2l_proxy", "s2l_loss", "s2l_loss"]
        assert m["s2l_checkpoint_steps"] == [2, 4]
        proxy = m["selection_passes"][0]
        assert proxy["samples"] > 0 and proxy["backward"] == proxy["samples"]
        assert proxy["run_now"] == proxy["samples"]
        assert m["backward_passes"] == proxy["samples"]
        assert m["forward_passes"] == proxy["samples"] + 2 * n
        assert all(p["run_now"] == n for p in m["selection_passes"][1:])
        assert_peaks_recorded(m)
        # Algorithm 1 over 3 trajectory clusters, up to the global budget; weight 1, random
        # balanced shards holding every selected sample once.
        assert subsets["score"].null_count() == 0 and (subsets["weight"] == 1.0).all()
        # (a set-aside cluster of at most 2 samples may give nothing: share 0)
        assert (subsets["score"] >= 0).all() and (subsets["score"] <= 1).all()
        shards = read(instance, "shard_manifests")
        assert Counter(shards["sample_id"]) == Counter(
            subsets.filter(pl.col("selected"))["sample_id"]
        )
        assert (shards["weight"] == 1.0).all()
        assert all(c.passed for c in result.get_asset_check_evaluations())
        # The proxy's training reports to Pipes; the stage still records one materialization.
        events = instance.fetch_materializations(dg.AssetKey("peripheral_subsets"), limit=10)
        assert len(events.records) == 1

        # Each trajectory entry is the sample's mean response loss under that checkpoint,
        # computed here directly with transformers.
        ref = m["inputs"]["s2l_trajectories"]
        trajectories = pl.read_delta(ref["uri"], version=ref["version"])
        assert trajectories["sample_id"].to_list() == subsets["sample_id"].to_list()
        raw = read(instance, "raw_instructions")
        picked = trajectories.head(3).join(raw, on="sample_id", maintain_order="left")
        for t, path in enumerate(m["s2l_proxy_checkpoints"]):
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path).eval()
            for row in picked.iter_rows(named=True):
                s = encode_sample(tokenizer, row["system"], row["prompt"], row["response"], 64)
                with torch.no_grad():
                    out = model(
                        input_ids=torch.tensor([s.input_ids]), labels=torch.tensor([s.labels])
                    )
                assert row["loss_trajectory"][t] == pytest.approx(float(out.loss), abs=1e-5)
        # The two checkpoints differ: the proxy trained.
        first, last = np.array(trajectories["loss_trajectory"].to_list()).T
        assert not np.allclose(first, last)

        # Again, same settings: the proxy is reused, not retrained, and the losses are cached.
        again_run = materialize_partition(
            SELECTION, instance, res, run_config=run_config_for(SELECTION, peripheral_subsets=s2l)
        )
        assert again_run.success
        again = meta(instance, "peripheral_subsets")
        assert [p["run_now"] for p in again["selection_passes"]] == [0, 0, 0]
        assert again["s2l_proxy_checkpoints"] == m["s2l_proxy_checkpoints"]
        assert read(instance, "peripheral_subsets")["selected"].equals(subsets["selected"])


@pytest.mark.slow
def test_less_warms_up_lora_and_selects_by_gradient_influence(
    tiny_data_dir, tiny_model_dir, tiny_embedding_cache, tmp_path
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster_pipeline.data.packing import collate_rows
    from cluster_pipeline.data.tokenization import encode_sample
    from cluster_pipeline.selection.gradient_features import per_sample_gradients
    from cluster_pipeline.training.config import GradientPass
    from cluster_pipeline.training.gradient_pass import GradientModel

    seed_embeddings(tiny_embedding_cache, tiny_data_dir)
    res = resources(tiny_data_dir, tiny_model_dir)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        chain_config = run_config_for(CHAIN, proxy_embeddings={"world_size": 2})
        assert materialize_partition(CHAIN, instance, res, run_config=chain_config).success
        # The target set: two training samples of the pool itself.
        train = read(instance, "raw_instructions").filter(pl.col("split") == "train")
        targets = train.head(2)
        write_jsonl(
            tmp_path / "targets" / "t.jsonl",
            [
                {"instruction": p, "output": r}
                for p, r in zip(targets["prompt"], targets["response"], strict=True)
            ],
        )
        less = {
            "selector": "less",
            "target": str(tmp_path / "targets"),
            "ratio": 0.5,
            "less_warmup_fraction": 0.25,
            "less_warmup_steps": 4,
            "less_checkpoints": 2,
            "less_lora_r": 4,
            "less_learning_rate": 1e-3,
            "less_projection_dim": 1024,
        }
        config = run_config_for(SELECTION, peripheral_subsets=less)
        result = materialize_partition(SELECTION, instance, res, run_config=config)
        assert result.success
        subsets = read(instance, "peripheral_subsets")
        n = subsets.height
        m = meta(instance, "peripheral_subsets")
        names = [p["name"] for p in m["selection_passes"]]
        # less reads nothing of the embedding pass (as s2l): its own passes only.
        assert names == ["less_warmup", *["less_gradients", "less_targets"] * 2]
        assert m["s2l_checkpoint_steps"] == [2, 4]
        warm = m["selection_passes"][0]
        assert warm["samples"] > 0 and warm["backward"] == warm["samples"]
        grads = m["selection_passes"][1:]
        assert [p["samples"] for p in grads] == [n, 2, n, 2]
        assert all(p["backward"] == p["samples"] and p["run_now"] == p["samples"] for p in grads)
        assert m["backward_passes"] == warm["samples"] + 2 * (n + 2)
        assert m["forward_passes"] == warm["samples"] + 2 * (n + 2)
        assert_peaks_recorded(m)
        assert m["selection_target_samples"] == 2 and len(m["less_learning_rates"]) == 2
        assert "less_gradients" in m["inputs"] and "selection_targets" in m["inputs"]
        # Scores are weighted cosines, the kept ones the highest.
        assert (subsets["score"].abs() <= 1 + 1e-4).all() and (subsets["weight"] == 1.0).all()
        kept = subsets.filter(pl.col("selected"))["score"].to_numpy()
        left = subsets.filter(~pl.col("selected"))["score"].to_numpy()
        assert kept.min() >= left.max()
        shards = read(instance, "shard_manifests")
        assert Counter(shards["sample_id"]) == Counter(
            subsets.filter(pl.col("selected"))["sample_id"]
        )
        assert all(c.passed for c in result.get_asset_check_evaluations())

        # One sample's stored gradients (Adam-preconditioned, projected, normalised) and its
        # score, recomputed here directly from the warm-up's checkpoints and the target set.
        ref = m["inputs"]["less_gradients"]
        table = pl.read_delta(ref["uri"], version=ref["version"])
        assert table["sample_id"].to_list() == subsets["sample_id"].to_list()
        raw = read(instance, "raw_instructions")
        row = table.join(raw, on="sample_id", maintain_order="left").row(5, named=True)
        ref = m["inputs"]["selection_targets"]
        target_rows = pl.read_delta(ref["uri"], version=ref["version"])
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

        def features(checkpoint, kind, rows):
            base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
            spec = GradientPass(checkpoint=checkpoint, preconditioner=kind, projection_dim=1024)
            gm = GradientModel(base, spec, "cpu")
            encoded = [
                encode_sample(tokenizer, r["system"], r["prompt"], r["response"], 64) for r in rows
            ]
            batch = collate_rows(encoded, [[i] for i in range(len(rows))], tokenizer.pad_token_id)
            g, _ = per_sample_gradients(gm.model, batch)
            return gm.features(g).numpy()

        weights = np.array(m["less_learning_rates"]) / sum(m["less_learning_rates"])
        influence = np.zeros(2)
        for i, checkpoint in enumerate(m["s2l_proxy_checkpoints"]):
            mine = features(checkpoint, "adam_released", [row])[0]
            stored = np.asarray(row["gradients"][i * 1024 : (i + 1) * 1024])
            assert stored == pytest.approx(mine, abs=1e-4)
            assert float(np.linalg.norm(mine)) == pytest.approx(1.0, abs=1e-5)
            theirs = features(checkpoint, "sgd", list(target_rows.iter_rows(named=True)))
            influence += weights[i] * (theirs @ mine)
        score = subsets.filter(pl.col("sample_id") == row["sample_id"])["score"][0]
        assert score == pytest.approx(influence.max(), abs=1e-4)

        # Quiet logs: no rank of the warm-up or the gradient passes prints a library warning
        # (peft's read of transformers' deprecated is_gradient_checkpointing did, per adapter).
        rank_logs = [p for p in tiny_data_dir.rglob("*.log") if ".logs" in str(p)]
        assert rank_logs
        assert [p for p in rank_logs if "Warning" in p.read_text()] == []

        # Again: the warm-up is reused and every gradient comes from its cache.
        assert materialize_partition(SELECTION, instance, res, run_config=config).success
        again = meta(instance, "peripheral_subsets")
        assert [p["run_now"] for p in again["selection_passes"]] == [0] * 5
        assert read(instance, "peripheral_subsets")["selected"].equals(subsets["selected"])
