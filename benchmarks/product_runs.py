"""The product itself, driven from a benchmark: a temporary data folder and Dagster instance, the
``cluster-pipeline`` and ``dagster`` commands a user runs, and the metadata they record.

    run = ProductRun(work, "gpteacher_codegen", source=path_of_the_json)
    run.materialize("raw_instructions,proxy_embeddings", config)   # wall seconds
    run.metadata("proxy_embeddings")                               # the latest record's values

Used by ``selection_cost.py`` (every selector's cost) and ``selection_quality.py`` (the peers
trained through the assets). The built-in model is converted once into the project's own data
folder and shared by every run (``CLUSTER_PIPELINE_BASE_MODEL``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


class ProductRun:
    """One dataset partition in a fresh data folder and Dagster instance under ``work``.

    Args:
        work: the folder (emptied first).
        dataset: the partition's name.
        source: a file, or several (a pool of several sources), copied into ``raw/<dataset>/``
            (None for the built-in ``python_stdlib``).
        model: the base model folder (default: the built-in model, converted into the project's
            ``data/models`` once).

    Raises:
        subprocess.CalledProcessError: ``cluster-pipeline datasets sync`` refused the dataset.
    """

    def __init__(
        self,
        work: Path,
        dataset: str,
        source: Path | list[Path] | None,
        model: str | None = None,
    ):
        from cluster_pipeline.models.loading import BUILTIN_MODEL, resolve_model

        if work.exists():
            shutil.rmtree(work)
        self.work, self.dataset = work, dataset
        data = work / "data"
        (data / "raw").mkdir(parents=True)
        if source is not None:  # (an empty folder would hide the built-in dataset: refused)
            (data / "raw" / dataset).mkdir()
            for file in source if isinstance(source, list) else [source]:
                shutil.copy(file, data / "raw" / dataset / file.name)
        home = work / "dagster_home"
        home.mkdir()
        shutil.copy(ROOT / "cluster_pipeline" / "defs" / "instance" / "dagster.yaml", home)
        self.env = {
            **os.environ,
            "DAGSTER_HOME": str(home),
            "CLUSTER_PIPELINE_DATA_DIR": str(data),
            "CLUSTER_PIPELINE_BASE_MODEL": model
            or str(resolve_model(BUILTIN_MODEL, ROOT / "data" / "models")),
        }
        subprocess.run(
            [_bin("cluster-pipeline"), "datasets", "sync", "--require", dataset],
            env=self.env,
            check=True,
            stdout=subprocess.DEVNULL,
        )

    def materialize(self, assets: str, config: dict, name: str) -> float:
        """``dagster asset materialize`` of ``assets`` (comma-separated) with ``config``; its
        output goes to ``<work>/<name>.log``. Returns its wall seconds; exits with the log's
        tail if it fails."""
        log = self.work / f"{name}.log"
        config_file = self.work / f"{name}.yaml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        cmd = [
            _bin("dagster"),
            *["asset", "materialize", "-m", "cluster_pipeline.definitions"],
            *["--partition", self.dataset, "--select", assets, "-c", str(config_file)],
        ]
        start = time.perf_counter()
        with log.open("w") as out:
            done = subprocess.run(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        seconds = time.perf_counter() - start
        if done.returncode:
            sys.exit(f"{assets} failed (log {log}):\n{log.read_text()[-4000:]}")
        return seconds

    def metadata(self, asset: str) -> dict:
        """The metadata values of ``asset``'s latest materialization in this instance."""
        import dagster as dg

        os.environ["DAGSTER_HOME"] = self.env["DAGSTER_HOME"]
        instance = dg.DagsterInstance.get()
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[self.dataset]),
            limit=1,
        ).records
        materialization = records[0].asset_materialization
        if materialization is None:
            sys.exit(f"{asset} of {self.dataset} has no materialization in {self.work}")
        return {k: v.value for k, v in materialization.metadata.items()}
