"""Every stage's knobs are checked before a run's first step, each refusal one line naming
``<stage>.<knob> = <value>: <rule>``: bounds the Dagster schema cannot carry, and the rules
across stages, the data and the base model's chat template."""

import math
from pathlib import Path

import pytest

from cluster_pipeline.data.tokenization import encode_conversation, min_prompted_length
from cluster_pipeline.defs.profiles import PROFILES, profile_run_config
from cluster_pipeline.defs.run_checks import ConfigRefused, RunFacts, check_stages
from cluster_pipeline.defs.stages import STAGES
from cluster_pipeline.selection.selectors import SELECTORS

# A folder of two valid samples: a target set the run check reads.
TARGET_SET = str(Path(__file__).parent / "target_set")


def _config(stage: str, **knobs) -> dict:
    return {"ops": {stage: {"config": knobs}}}


BOUNDS = [
    ("peripheral_subsets", {"ratio": 0}, "ratio = 0: Input should be greater than 0"),
    ("peripheral_subsets", {"ratio": 1.5}, "ratio = 1.5: Input should be less than or equal to 1"),
    ("peripheral_subsets", {"ratio": -0.5}, "ratio = -0.5: Input should be greater than 0"),
    (
        "peripheral_subsets",
        {"selector": "periphral"},
        # Pydantic lists the registry's selectors.
        "selector = 'periphral': Input should be "
        + ", ".join(repr(name) for name in SELECTORS[:-1])
        + f" or {SELECTORS[-1]!r}",
    ),
    ("peripheral_subsets", {"seed": -1}, "seed = -1: Input should be greater than or equal to 0"),
    (
        "balanced_clusters",
        {"num_clusters": 0},
        "num_clusters = 0: Input should be greater than or equal to 1",
    ),
    (
        "balanced_clusters",
        {"alpha": 0.5},
        "alpha = 0.5: Input should be greater than or equal to 1",
    ),
    ("balanced_clusters", {"seed": -3}, "seed = -3: Input should be greater than or equal to 0"),
    ("raw_instructions", {"seed": -1}, "seed = -1: Input should be greater than or equal to 0"),
    (
        "raw_instructions",
        {"heldout_fraction": 1.0},
        "heldout_fraction = 1.0: Input should be less than 1",
    ),
    (
        "raw_instructions",
        {"heldout_fraction": -0.1},
        "heldout_fraction = -0.1: Input should be greater than or equal to 0",
    ),
    (
        "raw_instructions",
        {"max_train_samples": 0},
        "max_train_samples = 0: Input should be greater than or equal to 1",
    ),
    ("shard_manifests", {"seed": -1}, "seed = -1: Input should be greater than or equal to 0"),
    (
        "proxy_embeddings",
        {"max_length": 1},
        "max_length = 1: Input should be greater than or equal to 2",
    ),
    (
        "proxy_embeddings",
        {"max_batch_size": 0},
        "max_batch_size = 0: Input should be greater than or equal to 1",
    ),
    (
        "proxy_embeddings",
        {"chunk_size": 0},
        "chunk_size = 0: Input should be greater than or equal to 1",
    ),
    (
        "proxy_embeddings",
        {"world_size": 0},
        "world_size = 0: Input should be greater than or equal to 1",
    ),
    (
        "trained_checkpoint",
        {"per_device_batch_size": 0},
        "per_device_batch_size = 0: Input should be greater than or equal to 1",
    ),
    (
        "trained_checkpoint",
        {"max_tokens_per_micro_batch": 0},
        "max_tokens_per_micro_batch = 0: Input should be greater than or equal to 1",
    ),
    ("trained_checkpoint", {"seed": -2}, "seed = -2: Input should be greater than or equal to 0"),
    (
        "trained_checkpoint",
        {"learning_rate": 0},
        "learning_rate = 0: Input should be greater than 0",
    ),
    ("trained_checkpoint", {"warmup_ratio": 1}, "warmup_ratio = 1: Input should be less than 1"),
    (
        "eval_report",
        {"batch_size": 0},
        "batch_size = 0: Input should be greater than or equal to 1",
    ),
    (
        "eval_report",
        {"benchmarks": ["humaneva"]},
        "benchmarks = ['humaneva']: unknown benchmarks ['humaneva']; choose from "
        "['humaneval', 'mbpp', 'mmlu', 'mmlu_medical']",
    ),
    (
        "eval_report",
        {"humaneval_problems": 200},
        "humaneval_problems = 200: Input should be less than or equal to 164",
    ),
    (
        "peripheral_subsets",
        {"ratoi": 0.5},
        "ratoi = 0.5: not a knob of peripheral_subsets; its knobs: selector, ratio, seed, balance, "
        "ifd_end_of_turn, ifd_truncated, target, target_size, rds_selection, rds_pooling, "
        "s2l_steps, s2l_checkpoints, s2l_clusters, s2l_sources, s2l_small_clusters, "
        "s2l_learning_rate, less_warmup_fraction, less_warmup_steps, less_checkpoints, "
        "less_lora_r, less_learning_rate, less_adam, less_projection_dim, less_subtasks, "
        "cluster_less_cluster_size, cluster_less_samples_per_cluster, longest_by",
    ),
    (
        "peripheral_subsets",
        {"selector": "s2l", "s2l_checkpoints": 1},
        "s2l_checkpoints = 1: Input should be greater than or equal to 2",
    ),
    (
        "peripheral_subsets",
        {"selector": "less", "target": TARGET_SET, "less_projection_dim": 512},
        "less_projection_dim = 512: Input should be greater than or equal to 1024",
    ),
    (
        "peripheral_subsets",
        {"selector": "less", "target": TARGET_SET, "less_warmup_fraction": 0.0},
        "less_warmup_fraction = 0.0: Input should be greater than 0",
    ),
    (
        "peripheral_subsets",
        {"selector": "less", "target": TARGET_SET, "less_lora_r": 0},
        "less_lora_r = 0: Input should be greater than or equal to 1",
    ),
]


@pytest.mark.parametrize(("stage", "knobs", "message"), BOUNDS)
def test_a_knob_outside_its_bounds_is_refused_in_one_line(stage, knobs, message):
    with pytest.raises(ConfigRefused) as e:
        check_stages(_config(stage, **knobs), STAGES)
    assert str(e.value) == f"{stage}.{message}"
    assert "\n" not in str(e.value)


def _float_knobs() -> list[tuple[str, str]]:
    from cluster_pipeline.defs.run_checks import stage_configs

    return [
        (stage, knob)
        for stage, cls in stage_configs().items()
        for knob, field in cls.model_fields.items()
        if "float" in str(field.annotation)
    ]


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_no_float_knob_takes_an_infinite_or_nan_value(value):
    """Every float knob of every stage (alpha = Infinity once reached the clustering step and
    failed there with an OverflowError)."""
    knobs = _float_knobs()
    assert ("balanced_clusters", "alpha") in knobs and ("peripheral_subsets", "ratio") in knobs
    for stage, knob in knobs:
        with pytest.raises(ConfigRefused) as e:
            check_stages(_config(stage, **{knob: value}), STAGES)
        assert str(e.value) == f"{stage}.{knob} = {value}: not a finite number; give a finite value"


def test_several_problems_are_one_line():
    config = {
        "ops": {
            "peripheral_subsets": {"config": {"ratio": 0}},
            "balanced_clusters": {"config": {"num_clusters": 0}},
        }
    }
    with pytest.raises(ConfigRefused) as e:
        check_stages(config, STAGES)
    assert str(e.value) == (
        "balanced_clusters.num_clusters = 0: Input should be greater than or equal to 1; "
        "peripheral_subsets.ratio = 0: Input should be greater than 0"
    )


RULES = [
    (
        {"raw_instructions": {"max_train_samples": 10}, "balanced_clusters": {"num_clusters": 16}},
        STAGES,
        RunFacts(),
        "balanced_clusters.num_clusters = 16: more clusters than training samples "
        "(raw_instructions.max_train_samples = 10 caps N); K <= N",
    ),
    (  # The run does not read the data again: N of the dataset's latest raw_instructions.
        {"balanced_clusters": {"num_clusters": 100}},
        ["balanced_clusters", "peripheral_subsets"],
        RunFacts(dataset="tiny", train_samples=57),
        "balanced_clusters.num_clusters = 100: more clusters than the 57 training samples of "
        "dataset 'tiny' (raw_instructions); K <= N",
    ),
    (
        {"raw_instructions": {"heldout_fraction": 0}},
        STAGES,
        RunFacts(),
        "raw_instructions.heldout_fraction = 0.0: eval_report scores the held-out split, so it "
        "must be > 0 when the run evaluates",
    ),
    (
        {"proxy_embeddings": {"world_size": 3}},
        ["proxy_embeddings"],
        RunFacts(agents=2),
        "proxy_embeddings.world_size = 3: must be a multiple of the 2 torchrun agents "
        "(resources.torchrun nnodes)",
    ),
    (
        {"balanced_clusters": {"num_clusters": 3}},
        ["balanced_clusters", "trained_checkpoint"],
        RunFacts(agents=2),
        "balanced_clusters.num_clusters = 3: K training ranks must split evenly over the 2 "
        "torchrun agents (resources.torchrun nnodes)",
    ),
    (  # A targeted selector without its target set, refused before the embedding pass.
        {"peripheral_subsets": {"selector": "rds"}},
        STAGES,
        RunFacts(),
        "peripheral_subsets.target = None: rds needs a target set: a benchmark (humaneval, "
        "mbpp, mmlu, mmlu_medical) or a folder of samples",
    ),
    (
        {"peripheral_subsets": {"selector": "rds", "target": "/no/such/folder"}},
        ["peripheral_subsets"],
        RunFacts(),
        "peripheral_subsets.target = '/no/such/folder': neither a benchmark (humaneval, mbpp, "
        "mmlu, mmlu_medical) nor an existing folder of samples; give an absolute path",
    ),
    (  # The benchmark's file is looked for where the run's worker knows the data folder.
        {"peripheral_subsets": {"selector": "rds", "target": "mbpp"}},
        ["peripheral_subsets"],
        RunFacts(eval_folders=(Path("/no/eval"),)),
        "peripheral_subsets.target = 'mbpp': benchmark 'mbpp' reads mbpp_reworded.json, found "
        "in none of /no/eval",
    ),
    (  # A target set only for the selectors that read one (a new-user trial's cases).
        {"peripheral_subsets": {"target": "/no/such/folder", "target_size": 5}},
        ["peripheral_subsets"],
        RunFacts(),
        "peripheral_subsets.target = '/no/such/folder': applies to the targeted selectors "
        "(rds, less, cluster_less) only (the selector is 'peripheral'); "
        "peripheral_subsets.target_size = 5: applies to the targeted selectors (rds, less, "
        "cluster_less) only (the selector is 'peripheral')",
    ),
    (  # Another selector's knob out of its bounds: that it does not apply, not the bound.
        {"peripheral_subsets": {"selector": "s2l", "less_projection_dim": 512}},
        ["peripheral_subsets"],
        RunFacts(),
        "peripheral_subsets.less_projection_dim = 512: applies to the selectors less, "
        "cluster_less only (the selector is 's2l')",
    ),
    (  # A bound broken does not hide the rules across knobs: every problem in one message.
        {
            "peripheral_subsets": {
                "selector": "s2l",
                "ratio": 2.0,
                "s2l_steps": 10,
                "s2l_checkpoints": 3,
                "target": "humaneva",
            }
        },
        ["peripheral_subsets"],
        RunFacts(),
        "peripheral_subsets.ratio = 2.0: Input should be less than or equal to 1; "
        "peripheral_subsets.target = 'humaneva': applies to the targeted selectors (rds, less, "
        "cluster_less) only (the selector is 's2l'); peripheral_subsets.s2l_steps = 10: must be "
        "a multiple of s2l_checkpoints = 3 (the proxy saves a checkpoint every s2l_steps / "
        "s2l_checkpoints steps)",
    ),
    (  # An empty subset, known from N before clustering: floor(0.006 x 300 / 2) = 0.
        {"peripheral_subsets": {"ratio": 0.006, "balance": "samples"}},
        STAGES[:4],
        RunFacts(train_samples=300),
        "peripheral_subsets.ratio = 0.006: keeps no sample: every cluster keeps at most "
        "floor(r N / K) = floor(0.006 x 300 / 2) = 0 samples (balance: samples); raise it",
    ),
    (  # ... and under token balance, at most max_length tokens a sample: 0.0077 < 1.
        {"peripheral_subsets": {"ratio": 1e-7}},
        STAGES[:4],
        RunFacts(train_samples=300),
        "peripheral_subsets.ratio = 1e-07: keeps no sample: every cluster keeps at most "
        "floor(r N max_length / K) = floor(1e-07 x 300 x 256 / 2) = 0 tokens (balance: "
        "tokens); raise it",
    ),
    (  # s2l's knobs: only with s2l, the checkpoints dividing the steps, clusters <= N.
        {"peripheral_subsets": {"s2l_steps": 6, "s2l_clusters": 5}},
        ["peripheral_subsets"],
        RunFacts(),
        "peripheral_subsets.s2l_steps = 6: applies to selector s2l only (the selector is "
        "'peripheral'); peripheral_subsets.s2l_clusters = 5: applies to selector s2l only (the "
        "selector is 'peripheral')",
    ),
    (
        {"peripheral_subsets": {"selector": "s2l", "s2l_steps": 6, "s2l_checkpoints": 4}},
        ["peripheral_subsets"],
        RunFacts(),
        "peripheral_subsets.s2l_steps = 6: must be a multiple of s2l_checkpoints = 4 (the proxy "
        "saves a checkpoint every s2l_steps / s2l_checkpoints steps)",
    ),
    (
        {"peripheral_subsets": {"selector": "s2l"}},
        ["peripheral_subsets"],
        RunFacts(dataset="tiny", train_samples=57),
        "peripheral_subsets.s2l_clusters = 100: more trajectory clusters than the 57 training "
        "samples of dataset 'tiny'; lower it",
    ),
    (  # less needs a target set, like rds, refused before any model loads.
        {"peripheral_subsets": {"selector": "less"}},
        STAGES,
        RunFacts(),
        "peripheral_subsets.target = None: less needs a target set: a benchmark (humaneval, "
        "mbpp, mmlu, mmlu_medical) or a folder of samples",
    ),
    (  # less's knobs: only with less, the checkpoints dividing the steps, a rank's share.
        {"peripheral_subsets": {"less_warmup_steps": 6, "less_projection_dim": 2048}},
        ["peripheral_subsets"],
        RunFacts(),
        "peripheral_subsets.less_warmup_steps = 6: applies to the selectors less, cluster_less "
        "only (the selector is 'peripheral'); peripheral_subsets.less_projection_dim = 2048: "
        "applies to the selectors less, cluster_less only (the selector is 'peripheral')",
    ),
    (
        {
            "peripheral_subsets": {
                "selector": "less",
                "target": TARGET_SET,
                "less_warmup_steps": 6,
                "less_checkpoints": 4,
            }
        },
        ["peripheral_subsets"],
        RunFacts(),
        "peripheral_subsets.less_warmup_steps = 6: must be a multiple of less_checkpoints = 4 "
        "(the warm-up saves a checkpoint every less_warmup_steps / less_checkpoints steps)",
    ),
    (  # 5 % of 57 samples is 3 (ceil 2.85), fewer than the 4 ranks.
        {
            "proxy_embeddings": {"world_size": 4},
            "peripheral_subsets": {"selector": "less", "target": TARGET_SET},
        },
        ["proxy_embeddings", "peripheral_subsets"],
        RunFacts(train_samples=57),
        "peripheral_subsets.less_warmup_fraction = 0.05: 3 of the 57 training samples of the "
        "dataset for the warm-up's 4 ranks (proxy_embeddings.world_size); at least one each",
    ),
    (
        {"proxy_embeddings": {"max_length": 8}, "eval_report": {"max_length": 12}},
        STAGES,
        RunFacts(min_length=16, model="tiny"),
        "proxy_embeddings.max_length = 8: too short for any sample: the chat template of tiny "
        "writes 15 tokens before an answer even for an empty question, so max_length must be "
        ">= 16; eval_report.max_length = 12: too short for any sample: the chat template of "
        "tiny writes 15 tokens before an answer even for an empty question, so max_length must "
        "be >= 16",
    ),
]


@pytest.mark.parametrize(("ops", "stages", "facts", "message"), RULES)
def test_rules_across_stages_data_and_model(ops, stages, facts, message):
    config = {"ops": {stage: {"config": knobs} for stage, knobs in ops.items()}}
    with pytest.raises(ConfigRefused) as e:
        check_stages(config, stages, facts)
    assert str(e.value) == message


def test_what_the_rules_allow():
    # Embedding and training lengths may differ; K = N is allowed; without eval_report the
    # held-out split may be empty; prompt-less text records fit any length.
    ops = {
        "raw_instructions": {"config": {"max_train_samples": 8, "heldout_fraction": 0}},
        "proxy_embeddings": {"config": {"max_length": 512}},
        "balanced_clusters": {"config": {"num_clusters": 8}},
        "trained_checkpoint": {"config": {"max_length": 128}},
    }
    check_stages({"ops": ops}, STAGES[:6], RunFacts(min_length=16))
    check_stages(
        _config("proxy_embeddings", max_length=8),
        ["proxy_embeddings"],
        RunFacts(min_length=16, text_records=True),
    )
    # A target set that is a benchmark shipped in a package, or a folder.
    for target in ("humaneval", TARGET_SET):
        check_stages(_config("peripheral_subsets", selector="rds", target=target), STAGES)
    # One sample per cluster is not empty: floor(0.007 x 300 / 2) = 1; full ignores r.
    for subsets in ({"ratio": 0.007, "balance": "samples"}, {"selector": "full", "ratio": 0.006}):
        check_stages(_config("peripheral_subsets", **subsets), STAGES, RunFacts(train_samples=300))
    # s2l with its defaults, or steps the checkpoints divide, and clusters up to N.
    s2l = {"selector": "s2l", "s2l_steps": 6, "s2l_checkpoints": 3, "s2l_clusters": 57}
    check_stages(_config("peripheral_subsets", **s2l), STAGES, RunFacts(train_samples=57))
    check_stages(_config("peripheral_subsets", selector="s2l"), STAGES)
    # less with its target and defaults, or its knobs within their rules.
    less = {"selector": "less", "target": TARGET_SET, "less_warmup_steps": 6, "less_checkpoints": 3}
    check_stages(_config("peripheral_subsets", **less), STAGES, RunFacts(train_samples=57))
    # Stages outside the run are not checked by the rules (nor their absent config).
    check_stages(_config("balanced_clusters", num_clusters=100), ["proxy_embeddings"])


@pytest.mark.parametrize("profile", list(PROFILES))
def test_every_profile_passes(profile):
    check_stages(profile_run_config(profile), STAGES, RunFacts(min_length=40))


def test_min_prompted_length_is_the_shortest_that_keeps_an_answer(tiny_tokenizer):
    n = min_prompted_length(tiny_tokenizer)
    messages = [{"role": "user", "content": ""}, {"role": "assistant", "content": "The sum."}]
    assert encode_conversation(tiny_tokenizer, messages, n).n_response_tokens == 1
    assert encode_conversation(tiny_tokenizer, messages, n - 1).skip_reason is not None


def test_a_target_folder_is_read_before_any_model_loads(tmp_path):
    """less's and rds's target folder: empty, an empty file, invalid JSON, a record of no form
    and a file instead of a folder are each refused by the run check, with file and line."""
    cases = {
        "empty": (
            None,
            "{d}: no .json, .jsonl, .parquet, .arrow files found; put the dataset's "
            "files in this folder.",
        ),
        "emptyfile": (
            "",
            "{d}/a.jsonl: holds no records (0 bytes); remove the file or put the "
            "dataset's records in it.",
        ),
        "noform": (
            '{"foo": "bar"}\n',
            "{d}/a.jsonl:1: record with keys ['foo'] matches no accepted form.",
        ),
    }
    for name, (text, message) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        if text is not None:
            (folder / "a.jsonl").write_text(text)
        for selector in ("less", "rds"):
            with pytest.raises(ConfigRefused) as e:
                check_stages(
                    _config("peripheral_subsets", selector=selector, target=str(folder)),
                    ["peripheral_subsets"],
                )
            assert str(e.value).startswith(
                f"peripheral_subsets.target = '{folder}': " + message.format(d=folder)
            )
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.json").write_text('[{"instruction": "a", "output": "b"},]')
    with pytest.raises(ConfigRefused, match=r"bad/a\.json:1:38: invalid JSON \(Expecting value\)"):
        check_stages(_config("peripheral_subsets", selector="less", target=str(bad)), STAGES)
    good = tmp_path / "good"
    good.mkdir()
    (good / "a.jsonl").write_text('{"instruction": "Write add", "output": "def add(a, b): ..."}\n')
    check_stages(_config("peripheral_subsets", selector="less", target=str(good)), STAGES)
    with pytest.raises(ConfigRefused) as e:
        check_stages(
            _config("peripheral_subsets", selector="rds", target=str(good / "a.jsonl")), STAGES
        )
    assert str(e.value) == (
        f"peripheral_subsets.target = '{good / 'a.jsonl'}': a file, not a folder: give the "
        "folder that holds it (every data file in it is read)"
    )


# --- {env: NAME}: what the launchpad's "Int | { One of the following: env: String }" means ---


def test_a_knob_read_from_an_environment_variable_is_checked_like_its_value(monkeypatch):
    from cluster_pipeline.defs.run_checks import validate_stages

    monkeypatch.setenv("CP_TEST_MAX_STEPS", "3")
    monkeypatch.setenv("CP_TEST_MODULE", "k_proj")
    config = _config(
        "trained_checkpoint",
        max_steps={"env": "CP_TEST_MAX_STEPS"},
        lora_target_modules=[{"env": "CP_TEST_MODULE"}, "v_proj"],
    )
    configs, problems = validate_stages(config, ["trained_checkpoint"])
    assert problems == []
    assert configs["trained_checkpoint"].max_steps == 3
    assert configs["trained_checkpoint"].lora_target_modules == ["k_proj", "v_proj"]
    check_stages(config, ["trained_checkpoint"])
    # Out of its bounds: refused, naming the variable, never its value.
    monkeypatch.setenv("CP_TEST_MAX_STEPS", "0")
    with pytest.raises(ConfigRefused) as refused:
        check_stages(config, ["trained_checkpoint"])
    assert str(refused.value) == (
        "trained_checkpoint.max_steps = {env: CP_TEST_MAX_STEPS}: "
        "Input should be greater than or equal to 1"
    )


def test_a_knob_whose_environment_variable_is_not_set_is_named(monkeypatch):
    monkeypatch.delenv("CP_TEST_UNSET", raising=False)
    with pytest.raises(ConfigRefused) as refused:
        check_stages(_config("raw_instructions", max_heldout={"env": "CP_TEST_UNSET"}), STAGES)
    assert str(refused.value) == (
        "raw_instructions.max_heldout = {env: CP_TEST_UNSET}: the environment variable "
        "CP_TEST_UNSET is not set where the run's steps run; set it, or give the value itself"
    )


def test_dagster_and_the_run_checks_read_an_environment_variable_alike(monkeypatch):
    """The launchpad's union is Dagster's IntSource: the job's schema accepts {env: NAME} for an
    optional integer knob and the step gets the variable's value, which the run checks see."""
    import dagster as dg

    from cluster_pipeline.definitions import defs
    from cluster_pipeline.defs.run_checks import resource_config

    monkeypatch.setenv("CP_TEST_MAX_STEPS", "7")
    monkeypatch.setenv("CP_TEST_DATA", "/tmp/cp-test-data")
    config = {
        **_config("trained_checkpoint", max_steps={"env": "CP_TEST_MAX_STEPS"}),
        "resources": {"storage": {"config": {"data_dir": {"env": "CP_TEST_DATA"}}}},
    }
    job = defs().resolve_job_def("main_job")
    resolved = dg.validate_run_config(job, config)
    assert resolved["ops"]["trained_checkpoint"]["config"]["max_steps"] == 7
    assert check_stages(config, ["trained_checkpoint"])["trained_checkpoint"].max_steps == 7
    assert resource_config(config, "storage") == {"data_dir": "/tmp/cp-test-data"}
