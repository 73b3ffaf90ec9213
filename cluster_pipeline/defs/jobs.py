"""The main job: all seven stages for one dataset partition, sized for a 2-core CPU by default.

Its default run config, ``run_config/cpu_quick.yaml`` (shown in the launchpad; the CLI passes
the same file with ``-c``), keeps a CPU run to about 15 minutes on ``python_stdlib``: N = 600
training samples, max length 256 tokens, K = 2, r = 0.5, one epoch, 64 held-out samples and the
first 16 HumanEval and 16 MBPP problems. Raise them on a GPU machine.
"""

from pathlib import Path

import dagster as dg
import yaml

from cluster_pipeline.defs.stages import SELECTION_STAGES, STAGES

CPU_QUICK_CONFIG_PATH = Path(__file__).parent / "run_config" / "cpu_quick.yaml"
CPU_QUICK_CONFIG = yaml.safe_load(CPU_QUICK_CONFIG_PATH.read_text())

main_job = dg.define_asset_job(
    "main_job",
    selection=dg.AssetSelection.assets(*STAGES),
    config=CPU_QUICK_CONFIG,
    description="raw_instructions -> ... -> eval_report for one dataset partition.",
)

selection_job = dg.define_asset_job(
    "selection_job",
    selection=dg.AssetSelection.assets(*SELECTION_STAGES),
    config={
        "ops": {k: v for k, v in CPU_QUICK_CONFIG["ops"].items() if k in SELECTION_STAGES},
        "loggers": CPU_QUICK_CONFIG.get("loggers", {}),
    },
    description="The cheap selection chain, raw_instructions -> shard_manifests.",
)
