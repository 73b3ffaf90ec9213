"""Generated code cannot harm the run: loops, forks, memory, files, secrets."""

import os
import subprocess

import pytest

from cluster_pipeline.core.sandbox import run_python


def test_a_correct_program_passes_and_a_wrong_one_fails():
    assert run_python("assert 1 + 1 == 2\n").passed
    bad = run_python("def f():\n    return 3\nassert f() == 2, 'wrong'\n")
    assert bad.status == "failed" and "AssertionError: wrong" in bad.detail


def test_an_infinite_loop_is_killed_at_the_timeout():
    r = run_python("while True:\n    pass\n", timeout_s=1.0)
    assert r.status == "timeout" and r.seconds < 5


def test_a_fork_bomb_is_contained():
    program = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    r = run_python(program, timeout_s=2.0)
    assert not r.passed
    # Nothing of it is left running.
    out = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True).stdout
    assert "program.py" not in out


def test_filling_memory_hits_the_limit():
    r = run_python("x = bytearray(4 * 2**30)\n", memory_mb=512)
    assert r.status == "memory"


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


def test_the_environment_is_stripped(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "secret-value")
    r = run_python(
        "import os, sys\nassert 'HF_TOKEN' not in os.environ, dict(os.environ)\n"
        "assert 'secret-value' not in repr(os.environ)\n"
    )
    assert r.passed, r.detail


@pytest.mark.skipif(os.geteuid() != 0, reason="privilege drop applies when running as root")
def test_programs_run_as_nobody_when_started_as_root():
    assert run_python("import os\nassert os.getuid() == 65534\n").passed
