"""The training scripts of docs/guide/your-own-trainer.md (which the README links), taken out of
the Markdown and run exactly as written: under torchrun at 2 ranks, from a folder laid out as
the project is (``data/exports/mydata``: an export of two shards; ``data/models/
smollm2-135m-instruct``: the tiny random model), so a docs edit that breaks a script fails here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_pipeline.storage.layout import PROJECT_ROOT
from cluster_pipeline_tests.integrations.test_hf_trainer import _export

pytest.importorskip("trl")
GUIDE = PROJECT_ROOT / "docs" / "guide" / "your-own-trainer.md"
SCRIPTS = ("train_trl.py", "train_hf.py")


def scripts() -> dict[str, str]:
    """The guide's Python blocks that open with ``# <name>.py``, by that name."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    return {m[1]: b for b in blocks if (m := re.match(r"# (\w+\.py)\b", b))}


def test_the_guide_holds_both_scripts():
    assert sorted(scripts()) == sorted(SCRIPTS)


@pytest.fixture
def project(tmp_path, tiny_model_dir) -> Path:
    """A folder laid out as the project: the export of dataset "mydata" (2 shards of unequal
    size and weight) in data/exports/mydata, the tiny model as the built-in model's folder."""
    built, _, _ = _export(tmp_path / "build", 16, [6, 4], [1.2, 0.8])
    root = tmp_path / "project"
    (root / "data" / "exports").mkdir(parents=True)
    built.rename(root / "data" / "exports" / "mydata")
    (root / "data" / "models").mkdir()
    (root / "data" / "models" / "smollm2-135m-instruct").symlink_to(tiny_model_dir)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_the_guides_script_trains_on_the_export_as_written(project, name):
    (project / name).write_text(scripts()[name])
    before = {p.relative_to(project) for p in project.rglob("*")}
    env = {
        **os.environ,
        "CLUSTER_PIPELINE_DATA_DIR": str(project / "data"),  # the project's data/ folder
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(project.parent / "hf_home"),
    }
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    done = subprocess.run(
        [*torchrun, "--nproc_per_node=2", name],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    # No warning a user would have to look into: DDP's search for unused parameters, which
    # transformers turns on without activation checkpointing (TRL checkpoints by default).
    assert "find_unused_parameters=True was specified" not in done.stderr
    out = project / "data" / "trainer_runs" / f"mydata-{name[len('train_') : -len('.py')]}"
    assert (out / "model.safetensors").is_file()
    # The checkpoint's config says what it was tuned on (rank 0 saved it).
    record = json.loads((project / "data" / "exports" / "mydata" / "export.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["cluster_selection.manifest_set_sha256"] == record["manifest_set_sha256"]
    assert config["cluster_selection.rank"] == 0
    # Nothing written outside data/trainer_runs/ (which git ignores, as all of data/).
    after = {p.relative_to(project) for p in project.rglob("*")}
    new = {p for p in after - before if Path("data/trainer_runs") not in (p, *p.parents)}
    assert new == set()


@pytest.mark.slow
def test_trl_trains_on_the_exports_conversations_as_the_export_guide_says(tmp_path):
    """docs/guide/export.md: "TRL's SFTTrainer trains on
    load_dataset("<out>")["train"].select_columns(["messages"]) (add "tools" where samples have
    schemas)". One step on an export of a tool-calling chat, a two-turn chat and two Alpaca
    records: TRL reads every row as a conversation, the schemas reach the chat template."""
    import datasets
    from trl.trainer.sft_config import SFTConfig
    from trl.trainer.sft_trainer import SFTTrainer

    from cluster_pipeline.integrations.hf_datasets import export_selection
    from cluster_pipeline_tests.helpers import CHATML_TOOLS, build_model, build_tokenizer
    from cluster_pipeline_tests.integrations.test_hf_datasets import _chats

    source, raw_dir = _chats(tmp_path)
    out = tmp_path / "export"
    export_selection(source, out, raw_dir)
    loaded = datasets.load_dataset(str(out), cache_dir=str(tmp_path / "cache"))
    train = loaded["train"].select_columns(["messages", "tools"])
    assert train.num_rows == source.selected_samples == 4

    tokenizer = build_tokenizer(CHATML_TOOLS)
    model = build_model(len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    args = SFTConfig(
        str(tmp_path / "run"),
        max_steps=1,
        per_device_train_batch_size=4,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
    )
    trainer = SFTTrainer(model, args=args, train_dataset=train, processing_class=tokenizer)
    # Each row as TRL tokenized it is the chat template over the row's own messages and tools:
    # the whole conversation, system to last answer, and the schemas where the row has them.
    texts = [tokenizer.decode(r["input_ids"]) for r in trainer.train_dataset]
    rows = train.to_list()
    assert len(texts) == len(rows)
    for text, row in zip(texts, rows, strict=True):
        assert text == tokenizer.apply_chat_template(
            row["messages"], tools=row["tools"], tokenize=False
        )
        for turn in row["messages"]:
            assert f"<|im_start|>{turn['role']}\n{turn['content']}<|im_end|>" in text
        assert ("Météo of a city" in text) == (row["tools"] is not None)
    assert sum(row["tools"] is not None for row in rows) == 1
    assert any("<|im_start|>tool\n18 C<|im_end|>" in t for t in texts)
    result = trainer.train()
    assert result.global_step == 1 and result.training_loss > 0
