"""A one-node Slurm cluster on 127.0.0.1 for tests: munged, slurmctld and slurmd run as root
with their state, sockets, logs and configuration under one folder, on free ports, so they
neither need nor touch a system-wide Slurm. Debian packages: slurm-wlm (or slurmctld, slurmd,
slurm-client) and munge."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
NODE = "localhost"


def missing_packages() -> list[str]:
    """The Slurm/munge programs that are not installed (empty when a cluster can start)."""
    programs = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel", "sinfo")
    return [p for p in programs if shutil.which(p) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalSlurm:
    """A running one-node cluster. ``env`` points Slurm's clients (sbatch, squeue, ...) at it."""

    root: Path
    cpus: int
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *command: str, check: bool = True) -> str:
        """A Slurm client command against this cluster; its stdout."""
        out = subprocess.run(
            command, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30
        )
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {out.stderr.strip()}")
        return out.stdout

    def jobs(self) -> list[str]:
        """Pending, running or completing jobs (``squeue``'s default view): id and state."""
        return self.run("squeue", "-h", "-o", "%i %T").split()

    def log_tail(self, chars: int = 3000) -> str:
        """The end of slurmctld's and slurmd's logs, for a test's failure message."""
        tails = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / "log" / name
            text = path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"
            tails.append(f"--- {path} ends:\n{text}")
        return "\n".join(tails)

    def stop(self) -> None:
        """Cancel every job, stop the daemons, and kill whatever of theirs is left."""
        if self.processes and self.processes[-1].poll() is None:
            self.run("scancel", "--full", "--user=root", check=False)
        for proc in reversed(self.processes):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        # slurmstepd outlives slurmd by design; end what still runs for this cluster.
        for pid in _pids_with_env(f"SLURM_CONF={self.conf}"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _pids_with_env(assignment: str) -> list[int]:
    """Processes started with ``NAME=value`` in their environment, other than this process and
    its ancestors."""
    spared, pid = set(), os.getpid()
    while pid > 1:
        spared.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in spared:
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if assignment.encode() in environ:
            found.append(int(entry.name))
    return found


def start_local_slurm(root: Path, cpus: int = 4, timeout_s: float = 60.0) -> LocalSlurm:
    """Start munged, slurmctld and slurmd (as root) with everything under ``root``; wait until
    ``sinfo`` shows the node idle.

    ``cpus``: CPUs the node declares (may exceed the machine's; tasks are not bound).

    Raises:
        RuntimeError: a daemon did not come up within ``timeout_s`` seconds (its log is quoted).
    """
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(exist_ok=True)
    os.chmod(root / "munge", 0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    munge_socket = root / "munge" / "munge.socket"
    cluster = LocalSlurm(root=root, cpus=cpus)
    # Job ids of their own: the launcher derives the rendezvous port and id from the job id, so
    # two test clusters that both numbered from 1 (two sessions at once) would join one store.
    first_job_id = random.randrange(1000, 19000)
    conf = f"""\
ClusterName=cptest{os.getpid()}
FirstJobId={first_job_id}
SlurmctldHost={NODE}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.pid"}
SlurmctldLogFile={root / "log" / "slurmctld.log"}
SlurmdLogFile={root / "log" / "slurmd.log"}
SlurmctldDebug=info
SlurmdDebug=info
KillWait=5
MinJobAge=600
InactiveLimit=0
MessageTimeout=20
NodeName={NODE} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
    cluster.conf.write_text(conf)
    env = {**os.environ, **cluster.env}
    log = root / "log"

    def daemon(*command: str, name: str) -> None:
        out = open(log / f"{name}.out", "w")  # noqa: SIM115 (closed with the process)
        cluster.processes.append(
            subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        )

    try:
        daemon(
            "munged",
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={munge_socket}",
            f"--pid-file={root / 'munge' / 'munged.pid'}",
            f"--log-file={log / 'munged.log'}",
            f"--seed-file={root / 'munge' / 'munged.seed'}",
            name="munged",
        )
        _wait(lambda: munge_socket.exists(), timeout_s, "munged", log / "munged.out", cluster)
        daemon("slurmctld", "-D", "-i", "-f", str(cluster.conf), name="slurmctld")
        _wait(
            lambda: cluster.run("sinfo", "-h", check=False) != "",
            timeout_s,
            "slurmctld",
            log / "slurmctld.log",
            cluster,
        )
        daemon("slurmd", "-D", "-N", NODE, "-f", str(cluster.conf), name="slurmd")
        _wait(
            lambda: cluster.run("sinfo", "-h", "-o", "%T", check=False).strip() == "idle",
            timeout_s,
            "slurmd",
            log / "slurmd.log",
            cluster,
        )
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait(ready, timeout_s: float, name: str, log: Path, cluster: LocalSlurm) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        if any(p.poll() is not None for p in cluster.processes):
            break
        time.sleep(0.3)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
    raise RuntimeError(f"{name} did not come up (config {cluster.conf}); its log:\n{tail}")
