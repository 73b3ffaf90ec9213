"""Running untrusted, model-generated Python programs.

Each program runs in its own subprocess and session, in a fresh temporary folder (deleted
afterwards), with an environment holding only PATH, HOME, TMPDIR and LANG, under rlimits on
address space, CPU seconds, file size, open files and process count, and with a wall-clock
timeout after which its whole process group is killed. When the caller is root, the program
also runs as the unprivileged user ``nobody``, so it cannot touch files it was not given and
the process-count limit applies (Linux does not enforce RLIMIT_NPROC for root).
"""

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534


@dataclass(frozen=True)
class ExecutionResult:
    """Outcome of one program.

    ``status`` is ``passed`` (exit 0), ``failed`` (non-zero exit, e.g. a failed assert),
    ``timeout`` (wall clock or CPU limit) or ``memory`` (address-space limit hit).
    """

    status: str
    detail: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _world_executable(path: Path) -> bool:
    """True if every directory on the way to ``path`` and the file itself can be used by
    another user (o+x)."""
    path = path.resolve()
    return all(p.stat().st_mode & stat.S_IXOTH for p in [path, *path.parents] if p.exists())


def sandbox_interpreter(drop_privileges: bool) -> str:
    """The Python to run programs with: this interpreter, unless ``nobody`` cannot execute it
    (e.g. it lives under /root), then the system's python3.

    Raises:
        FileNotFoundError: no usable interpreter.
    """
    if not drop_privileges or _world_executable(Path(sys.executable)):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        if Path(candidate).exists() and _world_executable(Path(candidate)):
            return candidate
    raise FileNotFoundError(
        "no Python interpreter that user 'nobody' can execute; install "
        "the system python3 or run as a non-root user"
    )


# Runs first inside the sandbox process (no preexec_fn, so callers may use threads): set the
# limits, drop to nobody if asked, then run the program as __main__.
_BOOT = """
import os, resource, runpy, sys
mem, cpu, nproc, drop = map(int, sys.argv[1:5])
for name, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu),
                    (resource.RLIMIT_FSIZE, 16 << 20), (resource.RLIMIT_NOFILE, 64),
                    (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(name, (value, value))
if drop:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
sys.argv = ["program.py"]
runpy.run_path("program.py", run_name="__main__")
"""


def run_python(
    program: str,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    max_processes: int = 8,
) -> ExecutionResult:
    """Run ``program`` (Python source) in the sandbox described in the module docstring.

    Args:
        program: the whole program (e.g. prompt + completion + tests).
        timeout_s: wall-clock seconds before the process group is killed; the CPU rlimit is
            the same, rounded up.
        memory_mb: address-space limit (MiB).
        max_processes: process-count limit for the sandbox user.
    """
    drop = os.geteuid() == 0
    python = sandbox_interpreter(drop)
    workdir = Path(tempfile.mkdtemp(prefix="sandbox_"))
    start = time.perf_counter()
    try:
        (workdir / "program.py").write_text(program)
        if drop:
            os.chown(workdir, NOBODY, NOBODY)
            os.chown(workdir / "program.py", NOBODY, NOBODY)
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(workdir),
            "TMPDIR": str(workdir),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        limits = [
            str(memory_mb * 2**20),
            str(int(timeout_s) + 1),
            str(max_processes),
            str(int(drop)),
        ]
        proc = subprocess.Popen(
            [python, "-I", "-c", _BOOT, *limits],
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            _, err = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            _, err = b"", b""
        finally:
            # The program may have started children; they share its session's process group.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if timed_out:
                proc.communicate()
        seconds = time.perf_counter() - start
        text = err.decode(errors="replace")[-2000:]
        if timed_out or proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            return ExecutionResult("timeout", text or f"killed after {timeout_s} s", seconds)
        if proc.returncode == 0:
            return ExecutionResult("passed", "", seconds)
        if "MemoryError" in text:
            return ExecutionResult("memory", text, seconds)
        return ExecutionResult("failed", text, seconds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
