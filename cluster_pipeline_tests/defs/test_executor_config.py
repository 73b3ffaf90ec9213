"""The executor's fork-server preload: a module that cannot be found is named before any step
(multiprocessing's fork server would skip it silently), and the default preload is importable."""

from cluster_pipeline.defs.executor import PRELOAD_MODULES, missing_modules


def test_missing_preload_modules_are_named():
    assert missing_modules(
        ["json", "cluster_pipeline.definitions", "no_such_module_xyz", "cluster_pipeline.nope.x"]
    ) == ["no_such_module_xyz", "cluster_pipeline.nope.x"]
    assert missing_modules([]) == []


def test_the_default_preload_is_every_stage_module_and_importable():
    assert PRELOAD_MODULES[:2] == [
        "cluster_pipeline.launch.fork_server",
        "cluster_pipeline.definitions",
    ]
    assert "cluster_pipeline.defs.assets.trained_checkpoint" in PRELOAD_MODULES
    assert len(PRELOAD_MODULES) == 10  # fork_server, the Definitions, the defs/assets/ modules
    assert missing_modules(PRELOAD_MODULES) == []
