"""launch/fork_server.py: a fork server that preloads it ends without finalizing its interpreter
(after its other atexit handlers), and a plain import of it changes nothing."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

# A module whose import records the importing pid, whose atexit handler records that it ran,
# and whose module-level object records interpreter finalization (module teardown calls
# ``__del__``; ``os._exit`` skips it).
PROBE = textwrap.dedent(
    """
    import atexit, os
    _LOG = os.environ["PROBE_LOG"]

    def _note(what):
        with open(_LOG, "a") as f:
            f.write(f"{what} {os.getpid()}\\n")

    class _Finalized:  # by then builtins and module globals may be gone: bind what it needs
        def __del__(self, write=os.write, fd=os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT),
                    getpid=os.getpid):
            write(fd, b"finalized %d\\n" % getpid())

    _note("imported")
    atexit.register(_note, "atexit")
    _object = _Finalized()
    """
)

SERVE_ONE_STEP = textwrap.dedent(
    """
    import multiprocessing as mp, os, sys
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(sys.argv[1:])
    step = ctx.Process(target=os.getpid)
    step.start()
    step.join()
    assert step.exitcode == 0, step.exitcode
    from multiprocessing import forkserver
    print(forkserver._forkserver._forkserver_pid)
    """
)


def _log(tmp_path, *args: str) -> tuple[int, list[str]]:
    """Run a fork server preloading ``args`` (and one step), wait for the server to exit, and
    return its pid and the probe's log."""
    (tmp_path / "probe.py").write_text(PROBE)
    # PYTHONPATH, as Python 3.11's fork server ignores the client's sys.path
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PROBE_LOG": str(tmp_path / "log")}
    out = subprocess.run(
        [sys.executable, "-c", SERVE_ONE_STEP, *args],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    server = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 60
    while os.path.exists(f"/proc/{server}") and time.monotonic() < deadline:
        time.sleep(0.05)  # the server is the test's grandchild: init reaps it
    assert not os.path.exists(f"/proc/{server}"), "the fork server did not exit in 60 s"
    return server, (tmp_path / "log").read_text().splitlines()


@pytest.mark.parametrize("fast_exit", [False, True])
def test_a_fork_server_preloading_it_ends_after_atexit_without_finalizing(tmp_path, fast_exit):
    modules = ["cluster_pipeline.launch.fork_server"] if fast_exit else []
    server, log = _log(tmp_path, *modules, "probe")
    expected = [f"imported {server}", f"atexit {server}"]
    assert log == (expected if fast_exit else [*expected, f"finalized {server}"])


def test_a_plain_import_leaves_finalization_alone(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PROBE_LOG": str(tmp_path / "log")}
    proc = subprocess.run(
        [sys.executable, "-c", "import probe, cluster_pipeline.launch.fork_server; import os; "
         "print(os.getpid())"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    pid = proc.stdout.strip()
    log = (tmp_path / "log").read_text().splitlines()
    assert log == [f"imported {pid}", f"atexit {pid}", f"finalized {pid}"]
