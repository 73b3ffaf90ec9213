"""Running untrusted, model-generated Python programs in a bubblewrap sandbox.

Each program runs under ``bwrap`` (Debian package ``bubblewrap``) in new PID, network, IPC and
UTS namespaces: it sees read-only system paths (``/usr``, ``/etc`` and the Python
installation), a private ``/tmp`` and ``/dev/shm`` and an empty working folder, all gone when it
ends; nothing of the project, its data folder, ``DAGSTER_HOME`` or any home directory is
mounted, and the only network is an unconnected loopback. ``--die-with-parent`` ties the
sandbox to the evaluator, and when the timeout passes the sandbox's PID namespace is killed, which
ends every process the program started, whatever it forked or ``setsid``-ed. Inside, rlimits cap
address space, CPU seconds, file size, open files and processes; when the evaluator is root, the
program runs as ``nobody`` (Linux does not apply RLIMIT_NPROC to root). Started by an
unprivileged user, bwrap uses a user namespace instead. stdout is discarded and at most the last
64 KiB of stderr is kept, so a program that floods its output cannot grow the evaluator's memory.

Where namespaces cannot be created (bwrap missing, or a container that forbids them),
:func:`run_python` refuses with :class:`SandboxUnavailableError` saying why, unless the caller
passes ``unsafe=True``: then the program runs in a plain subprocess with the same rlimits and
output cap but none of the isolation above (``eval_report``'s ``unsafe_sandbox`` option, which
the report then states in its first lines).
"""

from __future__ import annotations

import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
# stderr kept per program (its tail: the traceback); stdout is discarded.
OUTPUT_LIMIT = 64 * 1024
_SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")


class SandboxUnavailableError(RuntimeError):
    """Generated code cannot be isolated on this machine; the message says why and what to do."""


@dataclass(frozen=True)
class ExecutionResult:
    """Outcome of one program.

    ``status`` is ``passed`` (exit 0), ``failed`` (non-zero exit, e.g. a failed assert),
    ``timeout`` (wall clock or CPU limit) or ``memory`` (address-space limit hit); ``detail``
    is the tail of stderr; ``seconds`` the wall time including the sandbox's start.
    """

    status: str
    detail: str
    seconds: float

    @property
    def passed(self) -> bool:
        """Whether the program exited 0 within its limits."""
        return self.status == "passed"


def _world_readable(path: Path) -> bool:
    """True if ``path`` and every directory above it can be used by any user (o+rx)."""
    path = path.resolve()
    return all(p.stat().st_mode & 0o005 == 0o005 for p in [path, *path.parents] if p.exists())


def _python() -> Path:
    """The interpreter programs run with (``-I``: the standard library only): the base
    interpreter of this one (not a virtualenv's), unless programs run as ``nobody`` and cannot
    reach it (e.g. it lives under /root), then the system's python3.

    Raises:
        SandboxUnavailableError: no interpreter ``nobody`` can use.
    """
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    base = base if base.exists() else Path(sys.executable).resolve()
    if os.geteuid() != 0 or _world_readable(Path(sys.base_prefix) / "lib"):
        return base
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if Path(candidate).exists() and _world_readable(Path(candidate)):
            return Path(candidate)
    raise SandboxUnavailableError(
        "no Python interpreter that user 'nobody' can run; install the system python3 "
        "(apt-get install python3) or run the evaluation as a non-root user."
    )


def _bwrap_command(python: Path, program: Path) -> list[str]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailableError(
            "bubblewrap (bwrap) is not installed; install it with `apt-get install bubblewrap` "
            "(`make setup` does)."
        )
    cmd = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net"]
    cmd += ["--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if os.geteuid() != 0:
        cmd.append("--unshare-user")
    for d in _SYSTEM_DIRS:
        path = Path(d)
        if path.is_symlink():
            cmd += ["--symlink", os.readlink(path), d]
        elif path.is_dir():
            cmd += ["--ro-bind", d, d]
    prefix = python.resolve().parents[1]  # <prefix>/bin/pythonX.Y
    if not any(prefix.is_relative_to(d) for d in _SYSTEM_DIRS):
        cmd += ["--ro-bind", str(prefix), str(prefix)]
    cmd += ["--proc", "/proc", "--dev", "/dev"]
    cmd += ["--perms", "1777", "--tmpfs", "/dev/shm", "--perms", "1777", "--tmpfs", "/tmp"]
    cmd += ["--perms", "1777", "--tmpfs", "/sandbox"]
    cmd += ["--ro-bind", str(program), "/sandbox/program.py", "--chdir", "/sandbox"]
    cmd += ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/sandbox"]
    cmd += ["--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8"]
    cmd += ["--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--", str(python)]
    return cmd


@functools.cache
def sandbox_problem() -> str | None:
    """Why programs cannot be isolated here (bwrap missing, or namespaces refused), or None.
    Checked once per process by starting an empty sandbox."""
    with tempfile.TemporaryDirectory(prefix="sandbox_probe_") as tmp:
        program = Path(tmp) / "program.py"
        program.write_text("")
        os.chmod(tmp, 0o755)
        os.chmod(program, 0o644)
        try:
            cmd = _bwrap_command(_python(), program)
        except SandboxUnavailableError as e:
            return str(e)
        try:
            out = subprocess.run(
                [*cmd, "-I", "program.py"], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bwrap could not start a sandbox ({e})."
    if out.returncode != 0:
        return (
            f"bwrap cannot create namespaces here ({out.stderr.strip()[-300:]}); containers "
            "often forbid them: allow user namespaces, or run as root."
        )
    return None


def check_sandbox(unsafe: bool = False) -> None:
    """Raise :class:`SandboxUnavailableError` (with the reason and the options) unless
    programs can be isolated here or ``unsafe`` is set."""
    problem = None if unsafe else sandbox_problem()
    if problem:
        raise SandboxUnavailableError(
            f"refusing to run generated code: {problem} Or set eval_report's `unsafe_sandbox: "
            "true` to run it without isolation (the report then says so), or `generate: false` "
            "for likelihood metrics only."
        )


# Runs first inside the sandbox (no preexec_fn, so callers may use threads): set the limits,
# drop to nobody if root, then run the program as __main__.
_BOOT = """
import os, resource, runpy, sys
mem, cpu, nproc = map(int, sys.argv[1:4])
for name, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu),
                    (resource.RLIMIT_FSIZE, 16 << 20), (resource.RLIMIT_NOFILE, 64),
                    (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(name, (value, value))
if os.geteuid() == 0:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
sys.argv = ["program.py"]
runpy.run_path("program.py", run_name="__main__")
"""


def _collect(proc: subprocess.Popen, deadline: float) -> tuple[bytes, bool]:
    """Read ``proc``'s stderr until it exits or ``deadline`` (perf_counter seconds) passes,
    keeping the last :data:`OUTPUT_LIMIT` bytes; returns (tail, timed out)."""
    assert proc.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    # A pidfd wakes the loop when the process exits (Linux >= 5.3); elsewhere, poll.
    exited = os.pidfd_open(proc.pid) if hasattr(os, "pidfd_open") else None
    if exited is not None:
        sel.register(exited, selectors.EVENT_READ, "exit")
    tail = bytearray()
    timed_out = False
    try:
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                timed_out = True
                break
            events = sel.select(remaining if exited is not None else min(remaining, 0.02))
            if any(key.data == "exit" for key, _ in events) or (
                exited is None and proc.poll() is not None
            ):
                break
            for _key, _ in events:
                chunk = os.read(proc.stderr.fileno(), 65536)
                if not chunk:
                    sel.unregister(proc.stderr)
                    break
                tail += chunk
                if len(tail) > OUTPUT_LIMIT:
                    del tail[:-OUTPUT_LIMIT]
        if not timed_out:  # what the program wrote just before it ended
            os.set_blocking(proc.stderr.fileno(), False)
            while True:
                try:
                    chunk = os.read(proc.stderr.fileno(), 65536)
                except (BlockingIOError, OSError):
                    break
                if not chunk:
                    break
                tail += chunk
                if len(tail) > OUTPUT_LIMIT:
                    del tail[:-OUTPUT_LIMIT]
    finally:
        sel.close()
        if exited is not None:
            os.close(exited)
    return bytes(tail), timed_out


def _wait_for_namespace_end(info_fd: int, limit_s: float = 5.0) -> None:
    """Return once every process of a finished sandbox has exited: the kernel kills a PID
    namespace's processes when its init dies, and that init exits only after all of them have
    (``zap_pid_ns_processes``), so this waits for the init, whose host PID bwrap wrote to
    ``info_fd`` (``--info-fd``), to be a zombie or gone. Without it a ``setsid``-ed child could
    still be listed for a few milliseconds after :func:`run_python` returned. Closes
    ``info_fd``; gives up after ``limit_s`` seconds (bwrap wrote nothing: it failed to start)."""
    with os.fdopen(info_fd, "rb") as f:
        raw = f.read()
    try:
        pid = int(json.loads(raw)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.002)


def run_python(
    program: str,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    max_processes: int = 8,
    unsafe: bool = False,
) -> ExecutionResult:
    """Run ``program`` (Python source) in the sandbox described in the module docstring.

    Args:
        program: the whole program (e.g. prompt + completion + tests).
        timeout_s: wall-clock seconds before the sandbox is killed; the CPU rlimit is the
            same, rounded up.
        memory_mb: address-space limit (MiB).
        max_processes: process-count limit inside the sandbox.
        unsafe: run without namespaces where bwrap cannot isolate (module docstring).

    Raises:
        SandboxUnavailableError: programs cannot be isolated here and ``unsafe`` is not set.
    """
    check_sandbox(unsafe)
    python = _python()
    workdir = Path(tempfile.mkdtemp(prefix="sandbox_"))
    start = time.perf_counter()
    try:
        path = workdir / "program.py"
        path.write_text(program)
        os.chmod(workdir, 0o755)
        os.chmod(path, 0o644)
        limits = [str(memory_mb * 2**20), str(int(timeout_s) + 1), str(max_processes)]
        isolated = sandbox_problem() is None
        # bwrap writes the sandbox's host PID (its PID namespace's init) to this pipe.
        info_read, info_write = os.pipe() if isolated else (-1, -1)
        if isolated:
            bwrap = _bwrap_command(python, path)
            cmd = [bwrap[0], "--info-fd", str(info_write), *bwrap[1:], "-I", "-c", _BOOT, *limits]
            cwd, env = None, {"PATH": "/usr/bin:/bin"}
        else:  # unsafe: the same limits, in a plain subprocess
            cmd = [str(python), "-I", "-c", _BOOT, *limits]
            env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir)}
            env |= {"LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
            cwd = workdir
            if os.geteuid() == 0:
                os.chown(workdir, NOBODY, NOBODY)
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            pass_fds=(info_write,) if isolated else (),
        )
        if isolated:
            os.close(info_write)
        try:
            err, timed_out = _collect(proc, start + timeout_s)
        finally:
            # bwrap's own group; its death kills the sandbox's PID namespace (--die-with-parent).
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()
            if isolated:
                _wait_for_namespace_end(info_read)
        seconds = time.perf_counter() - start
        text = err.decode(errors="replace")[-2000:]
        if timed_out or proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU):
            return ExecutionResult("timeout", text or f"killed after {timeout_s} s", seconds)
        if proc.returncode == 0:
            return ExecutionResult("passed", "", seconds)
        if "MemoryError" in text:
            return ExecutionResult("memory", text, seconds)
        return ExecutionResult("failed", text, seconds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
