"""What the Makefile installs on the system, and how (issue 44, item 2): `make run` (and `make
dev`, `make compare`) set up only what the main job uses, bubblewrap for the sandbox; Slurm and
munge belong to `make setup` and `make test`. A system package is announced before apt-get
runs, and another apt process's lock is waited for, not a failure.

The targets' plans are read from `make -n` (what make would run, nothing run); the install
itself runs for real, with fake `apt-get`, `sudo` and `id` on a PATH of their own that record
every call."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCKED = "E: Could not get lock /var/lib/apt/lists/lock. It is held by process 4242 (apt-get)"


def _dry_run(target: str, tmp_path: Path) -> str:
    """`make -n <target>` with the Python environment up to date and neither bwrap nor Slurm
    installed (their marker files point nowhere)."""
    venv = tmp_path / "venv"
    venv.mkdir(exist_ok=True)
    (venv / ".installed").touch()
    out = subprocess.run(
        [
            *["make", "-n", target, f"VENV={venv}"],
            f"BWRAP={tmp_path}/no/bwrap",
            f"SLURMCTLD={tmp_path}/no/slurmctld",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


@pytest.mark.parametrize("target", ["run", "dev", "compare"])
def test_the_main_jobs_targets_install_bubblewrap_and_not_slurm(target, tmp_path):
    plan = _dry_run(target, tmp_path)
    assert ".ci/apt-install" in plan and "bubblewrap" in plan
    assert "slurm-wlm" not in plan and "munge" not in plan


@pytest.mark.parametrize("target", ["setup", "test"])
def test_setup_and_test_install_slurm_and_munge_too(target, tmp_path):
    plan = _dry_run(target, tmp_path)
    assert "bubblewrap" in plan
    assert "slurm-wlm munge" in plan


def test_validate_and_mlflow_need_no_system_package(tmp_path):
    for target in ("validate", "mlflow"):
        assert ".ci/apt-install" not in _dry_run(target, tmp_path)


def test_run_ends_with_the_report_command_not_a_fixed_path(tmp_path):
    # The dataset reaches the recipe through the environment (issue 43's quoting): the shell
    # expands "$DATASET", which make exports.
    plan = _dry_run("run", tmp_path).splitlines()
    assert plan[-1].endswith('/bin/cluster-pipeline report "$DATASET"')


def _fake_system(tmp_path: Path, update_failures: list[str]) -> tuple[dict[str, str], Path]:
    """A PATH holding fake ``apt-get`` (each call's arguments appended to ``calls``; ``apt-get
    update`` prints ``update_failures[i]`` to stderr and fails on its i-th call, then succeeds),
    ``sudo`` (recorded, then runs its command), ``id`` (a user that is not root), and the real
    tools the recipe and .ci/apt-install use; no bwrap."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    for tool in ("sh", "bash", "grep", "mktemp", "rm", "cat", "sleep", "env", "head", "tail", "mv"):
        real = shutil.which(tool)
        assert real, tool
        (bin_dir / tool).symlink_to(real)
    failures = tmp_path / "failures"
    failures.write_text("".join(f"{line}\n" for line in update_failures))
    scripts = {
        "apt-get": f"""#!/bin/bash
echo "apt-get $*" >> {calls}
echo "apt-get $*" >&2
if [[ " $* " == *" update "* ]]; then
  first=$(head -n 1 {failures})
  if [ -n "$first" ]; then
    tail -n +2 {failures} > {failures}.rest && mv {failures}.rest {failures}
    echo "$first" >&2
    exit 100
  fi
fi
""",
        "sudo": f'#!/bin/bash\necho "sudo $*" >> {calls}\nexec "$@"\n',
        "id": "#!/bin/bash\necho 1000\n",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"PATH": str(bin_dir), "HOME": str(tmp_path), "APT_RETRY_S": "0"}, calls


def _install_bwrap(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The Makefile's bwrap target, run for real (``make`` itself from the real PATH)."""
    target = f"{tmp_path}/no/bwrap"
    return subprocess.run(
        [shutil.which("make") or "make", target, f"BWRAP={target}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )


def test_bwrap_is_announced_then_installed_waiting_for_apts_lock(tmp_path):
    env, calls = _fake_system(tmp_path, [LOCKED, LOCKED])
    done = _install_bwrap(tmp_path, env)
    assert done.returncode == 0, done.stderr
    lock = "-o DPkg::Lock::Timeout=600"
    assert calls.read_text().splitlines() == [
        *[f"sudo apt-get {lock} update -qq", f"apt-get {lock} update -qq"] * 3,
        f"sudo env DEBIAN_FRONTEND=noninteractive apt-get {lock} install -y -qq bubblewrap",
        f"apt-get {lock} install -y -qq bubblewrap",
    ]
    err = done.stderr.splitlines()
    assert err[0] == (
        "installing the Debian package(s) bubblewrap (bwrap, the sandbox eval_report runs "
        "generated code in): sudo apt-get update and apt-get install, waiting up to 600 s for "
        "another apt process to finish"
    )
    # Said once when the wait starts (then every 30 s), not at each retry.
    waiting = [line for line in err if "holds the package lists' lock" in line]
    assert waiting == [
        "apt-get update: another apt process holds the package lists' lock; waiting up to 600 s"
    ]


def test_another_apt_failure_is_not_waited_for(tmp_path):
    env, calls = _fake_system(tmp_path, ["E: Failed to fetch http://deb.debian.org/ 404"])
    done = _install_bwrap(tmp_path, env)
    assert done.returncode != 0
    assert "E: Failed to fetch http://deb.debian.org/ 404" in done.stderr
    assert calls.read_text().count("update") == 2  # sudo's line and apt-get's: one call
    assert "install" not in calls.read_text()


def test_the_wait_for_the_lock_is_bounded(tmp_path):
    env, calls = _fake_system(tmp_path, [LOCKED] * 5)
    done = _install_bwrap(tmp_path, {**env, "APT_LOCK_WAIT": "0"})
    assert done.returncode != 0
    assert LOCKED in done.stderr
    assert "install" not in calls.read_text()


def test_an_installed_bwrap_is_left_alone(tmp_path):
    env, calls = _fake_system(tmp_path, [])
    (Path(env["PATH"]) / "bwrap").symlink_to(shutil.which("true") or "/bin/true")
    done = _install_bwrap(tmp_path, env)
    assert done.returncode == 0 and not calls.exists() and done.stderr == ""


def test_make_passes_apt_lock_wait_to_the_installer(tmp_path):
    env, calls = _fake_system(tmp_path, [])
    target = f"{tmp_path}/no/bwrap"
    done = subprocess.run(
        [shutil.which("make") or "make", target, f"BWRAP={target}", "APT_LOCK_WAIT=30"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "waiting up to 30 s" in done.stderr
    assert "apt-get -o DPkg::Lock::Timeout=30 install -y -qq bubblewrap" in calls.read_text()
