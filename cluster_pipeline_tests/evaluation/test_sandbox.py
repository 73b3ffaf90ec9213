"""Generated code cannot harm the run: loops, forks, memory, files, secrets."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_pipeline.evaluation.sandbox import SandboxUnavailableError, run_python, sandbox_problem
from cluster_pipeline.storage.layout import PROJECT_ROOT, default_data_dir

# One xdist worker runs this module, one test at a time: as root the sandbox runs programs as
# `nobody`, and RLIMIT_NPROC counts every process of that user on the machine, so the fork bomb
# on one worker made the setsid test's fork fail on the other ("failed", not "passed").
pytestmark = pytest.mark.xdist_group("sandbox")

# bubblewrap is installed by `make setup` and .ci/run; only a machine that refuses namespaces
# (some containers) cannot run these, and they say why.
isolated = pytest.mark.skipif(
    sandbox_problem() is not None, reason=f"no isolation here: {sandbox_problem()}"
)


@isolated
def test_a_correct_program_passes_and_a_wrong_one_fails():
    assert run_python("assert 1 + 1 == 2\n").passed
    bad = run_python("def f():\n    return 3\nassert f() == 2, 'wrong'\n")
    assert bad.status == "failed" and "AssertionError: wrong" in bad.detail


@isolated
def test_an_infinite_loop_is_killed_at_the_timeout():
    r = run_python("while True:\n    pass\n", timeout_s=1.0)
    assert r.status == "timeout" and r.seconds < 5


@isolated
def test_a_fork_bomb_is_contained():
    program = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    r = run_python(program, timeout_s=2.0)
    assert not r.passed
    # Nothing of it is left running.
    out = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True).stdout
    assert "program.py" not in out


@isolated
def test_filling_memory_hits_the_limit():
    r = run_python("x = bytearray(4 * 2**30)\n", memory_mb=512)
    assert r.status == "memory"


@isolated
def test_files_outside_the_sandbox_cannot_be_deleted_or_written(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    program = (
        f"import os, shutil\nshutil.rmtree({str(tmp_path)!r}, ignore_errors=True)\n"
        f"open({str(tmp_path / 'new.txt')!r}, 'w').write('x')\n"
    )
    r = run_python(program)
    assert not r.passed
    assert victim.read_text() == "keep me" and not (tmp_path / "new.txt").exists()


@isolated
def test_the_environment_is_stripped(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "secret-value")
    r = run_python(
        "import os, sys\nassert 'HF_TOKEN' not in os.environ, dict(os.environ)\n"
        "assert 'secret-value' not in repr(os.environ)\n"
    )
    assert r.passed, r.detail


@isolated
@pytest.mark.skipif(os.geteuid() != 0, reason="privilege drop applies when running as root")
def test_programs_run_as_nobody_when_started_as_root():
    assert run_python("import os\nassert os.getuid() == 65534\n").passed


# --- Isolation (bubblewrap): real programs, as root and as an unprivileged user ---------------

SETSID_CHILD = """
import os, time
if os.fork() == 0:
    os.setsid()
    os.execv("/bin/sleep", ["sleep", "{marker}"])
time.sleep({parent_sleep})
"""


def _running(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line]


@isolated
@pytest.mark.parametrize("parent_sleep", [0, 86400])
def test_a_setsid_child_cannot_outlive_the_timeout(parent_sleep):
    marker = f"86400.{os.getpid()}{parent_sleep}"
    program = SETSID_CHILD.format(marker=marker, parent_sleep=parent_sleep)
    r = run_python(program, timeout_s=2.0)
    assert r.seconds < 2.0 + 2.0
    assert r.status == ("passed" if parent_sleep == 0 else "timeout")
    assert _running(marker) == []


FLOOD = (
    "import sys\nchunk = 'x' * 65536\nwhile True:\n"
    "    sys.stdout.write(chunk)\n    sys.stderr.write(chunk)\n"
)

_MEASURE_FLOOD = """
import json, resource, sys
sys.path.insert(0, {root!r})
from cluster_pipeline.evaluation.sandbox import run_python
run_python("pass\\n")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
r = run_python({flood!r}, timeout_s=2.0)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"status": r.status, "growth_kib": after - before, "detail": len(r.detail)}}))
"""


@isolated
def test_an_output_flood_does_not_grow_the_evaluator():
    # A fresh process, so its peak RSS is the evaluator's alone.
    script = _MEASURE_FLOOD.format(root=str(PROJECT_ROOT), flood=FLOOD)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["status"] == "timeout"
    assert got["growth_kib"] < 50 * 1024  # KiB on Linux
    assert got["detail"] <= 2000


@isolated
def test_tmp_and_dev_shm_are_private_and_vanish():
    name = f"cp_marker_{os.getpid()}"
    program = (
        f"open('/tmp/{name}', 'w').write('x')\nopen('/dev/shm/{name}', 'w').write('x')\n"
        f"import os\nassert os.path.exists('/tmp/{name}')\n"
    )
    r = run_python(program)
    assert r.passed, r.detail
    assert not Path(f"/tmp/{name}").exists() and not Path(f"/dev/shm/{name}").exists()


@isolated
def test_no_connection_to_a_local_service():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        r = run_python(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        )
        # The sandbox has its own loopback: nothing listens there.
        assert r.status == "failed" and "ConnectionRefusedError" in r.detail, r.detail
        with pytest.raises(BlockingIOError):
            server.accept()


@isolated
def test_project_data_dagster_home_and_home_are_invisible(tmp_path, monkeypatch):
    secret = tmp_path / "dagster_home" / "dagster.yaml"
    secret.parent.mkdir()
    secret.write_text("secret")
    monkeypatch.setenv("DAGSTER_HOME", str(secret.parent))
    paths = [
        str(PROJECT_ROOT / "pyproject.toml"),
        str(Path(default_data_dir()) / "README.md"),
        str(secret),
        str(Path.home()),
    ]
    program = (
        f"import os\npaths = {paths!r}\n"
        "seen = [p for p in paths if os.path.exists(p)]\nassert not seen, seen\n"
    )
    r = run_python(program)
    assert r.passed, r.detail


def test_without_isolation_generated_code_is_refused_unless_unsafe(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    sandbox_problem.cache_clear()
    try:
        with pytest.raises(SandboxUnavailableError) as e:
            run_python("pass\n")
        assert str(e.value).startswith(
            "refusing to run generated code: bubblewrap (bwrap) is not installed; install it "
            "with `apt-get install bubblewrap` (`make setup` does)."
        )
        assert "unsafe_sandbox: true" in str(e.value)
        assert run_python("assert 1 + 1 == 2\n", unsafe=True).passed
    finally:
        monkeypatch.undo()
        sandbox_problem.cache_clear()


_AS_USER = """
import json, os, subprocess, sys
sys.path.insert(0, {root!r})
from cluster_pipeline.evaluation.sandbox import run_python
out = {{}}
out["uid"] = os.getuid()
setsid = {setsid!r}
r = run_python(setsid, timeout_s=2.0)
ps = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True).stdout
out["setsid"] = [r.status, r.seconds, "86400.777" in ps]
bomb = ("import os\\nwhile True:\\n    try:\\n        os.fork()\\n"
        "    except OSError:\\n        pass\\n")
out["bomb"] = run_python(bomb, timeout_s=2.0).status
out["memory"] = run_python("x = bytearray(4 * 2**30)\\n", memory_mb=512).status
out["project"] = run_python("import os\\nassert not os.path.exists({project!r})\\n").status
out["net"] = run_python("import socket\\nsocket.create_connection(('127.0.0.1', 22), 1)\\n").status
out["tmp"] = run_python(
    "open('/tmp/cp_user_marker', 'w').write('x')\\n"
    "open('/dev/shm/cp_user_marker', 'w').write('x')\\n"
).status
import resource
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out["flood"] = [run_python({flood!r}, timeout_s=2.0).status,
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before]
print(json.dumps(out))
"""


@isolated
@pytest.mark.skipif(os.geteuid() != 0, reason="switching to an unprivileged user needs root")
def test_isolation_holds_for_an_unprivileged_user():
    script = _AS_USER.format(
        root=str(PROJECT_ROOT),
        setsid=SETSID_CHILD.format(marker="86400.777", parent_sleep=86400),
        project=str(PROJECT_ROOT / "pyproject.toml"),
        flood=FLOOD,
    )
    out = subprocess.run(
        ["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", script],
        capture_output=True,
        text=True,
        cwd="/",
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["uid"] == 65534
    status, seconds, left_running = got["setsid"]
    assert status == "timeout" and seconds < 4.0 and not left_running
    assert got["bomb"] != "passed" and got["memory"] == "memory"
    assert got["project"] == "passed"  # the project is readable to nobody, not in the sandbox
    assert got["net"] == "failed" and got["tmp"] == "passed"
    assert not Path("/tmp/cp_user_marker").exists()
    assert not Path("/dev/shm/cp_user_marker").exists()
    status, growth_kib = got["flood"]
    assert status == "timeout" and growth_kib < 50 * 1024
