"""A real one-node Slurm cluster for the tests: munged, slurmctld and slurmd started by hand under a temp dir.

Facts this relies on (Debian 12, Slurm 22.05): auth/munge is the only real auth plugin (auth/slurm
came later); munged's socket directory must be mode 755 or clients cannot reach it; the node line
comes from `slurmd -C`; SelectTypeParameters=CR_Core (CR_Core_Memory would run one job at a time
with no memory requested); there is no slurmdbd, so job history comes from scontrol while the
controller remembers the job and from jobcomp/filetxt after.

Every daemon runs in the foreground as our own child, so the session stops them by pid and never
by name. Without the binaries, `slurm_cluster` skips loudly with the reason.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel", "srun")
SETUP_HINT = "install them with .ci/slurm-setup.sh (Debian: apt-get install slurmctld slurmd slurm-client munge)"


def _which(name: str) -> str | None:
    # Debian puts the daemons in /usr/sbin, which a non-login PATH may lack.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin:/sbin")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if _which(b) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_line(slurmd: str) -> tuple[str, str]:
    """NodeName and hardware fields as slurmd itself detects them (`slurmd -C`), minus UpTime."""
    out = subprocess.run([slurmd, "-C"], capture_output=True, text=True, timeout=30).stdout
    first = next((ln for ln in out.splitlines() if ln.startswith("NodeName=")), None)
    if not first:
        raise RuntimeError(f"slurmd -C printed no NodeName line: {out!r}")
    fields = [f for f in first.split() if not f.startswith("UpTime=")]
    name = fields[0].split("=", 1)[1]
    return name, " ".join(fields[1:])


@dataclass
class SlurmCluster:
    base: Path
    node: str = ""
    conf: Path = field(init=False)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.conf = self.base / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, scontrol, the MCP server) needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    @property
    def jobcomp(self) -> Path:
        return self.base / "log" / "jobcomp.txt"

    def _write_conf(self, min_job_age: int, kill_wait: int) -> None:
        b = self.base
        for d in ("etc", "state", "spool", "log", "run", "munge"):
            (b / d).mkdir(parents=True, exist_ok=True)
        # munged refuses a socket directory clients cannot traverse, and clients need 755 to connect.
        os.chmod(b / "munge", 0o755)
        self.node, hw = _node_line(_which("slurmd"))
        conf = f"""\
# Written by tests/slurm_cluster.py for one test session; removed with its temp dir.
ClusterName=ftmcp-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={b / 'munge' / 'munge.socket.2'}
StateSaveLocation={b / 'state'}
SlurmdSpoolDir={b / 'spool'}
SlurmctldPidFile={b / 'run' / 'slurmctld.pid'}
SlurmdPidFile={b / 'run' / 'slurmd.pid'}
SlurmctldLogFile={b / 'log' / 'slurmctld.log'}
SlurmdLogFile={b / 'log' / 'slurmd.log'}
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={self.jobcomp}
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MinJobAge={min_job_age}
KillWait={kill_wait}
InactiveLimit=0
NodeName={self.node} NodeAddr=127.0.0.1 {hw} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
# Accepts jobs and never starts them (Reason=PartitionDown): a job that stays PENDING on demand.
PartitionName=held Nodes=ALL Default=NO MaxTime=INFINITE State=DOWN
"""
        self.conf.write_text(conf)
        key = b / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o400)

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.base / "log" / f"{name}.console", "ab")
        env = {**os.environ, **self.env}
        # Own session: a Ctrl-C on the test run reaches the daemons only through stop().
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, start_new_session=True)
        log.close()

    def _wait(self, what: str, probe, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode} while waiting for {what}:\n{self.log_tail(name)}")
            if probe():
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}:\n{self.log_tail()}")

    def client(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run([_which(argv[0]) or argv[0], *argv[1:]], capture_output=True, text=True,
                              env={**os.environ, **self.env}, timeout=timeout)

    def node_state(self) -> str:
        p = self.client("sinfo", "-h", "-p", "debug", "-n", self.node, "-o", "%T")
        return p.stdout.strip() if p.returncode == 0 else ""

    def start(self, *, min_job_age: int = 300, kill_wait: int = 30, timeout: float = 60) -> "SlurmCluster":
        t0 = time.monotonic()
        self._write_conf(min_job_age, kill_wait)
        m = self.base / "munge"
        self._spawn("munged", [_which("munged"), "--foreground", "--force", f"--socket={m / 'munge.socket.2'}",
                               f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
                               f"--seed-file={m / 'munged.seed'}", f"--log-file={self.base / 'log' / 'munged.log'}"])
        self._wait("munged's socket", (m / "munge.socket.2").exists, 20)
        # -i: ignore state left by an earlier cluster; -D: stay in the foreground as our child.
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait("slurmctld to answer", lambda: self.client("scontrol", "ping").returncode == 0, 30)
        self._spawn("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(f"node {self.node} to be idle", lambda: self.node_state().startswith("idle"), timeout)
        self.timings["start_s"] = time.monotonic() - t0
        return self

    def restart_controller(self, *, clear_state: bool = False, timeout: float = 60) -> None:
        """Stop slurmctld by pid and start it again; clear_state (-c) drops every job record, as the
        controller does for finished jobs once MinJobAge has passed."""
        p = self.procs["slurmctld"]
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-c" if clear_state else "-i", "-f", str(self.conf)])
        self._wait("slurmctld to answer", lambda: self.client("scontrol", "ping").returncode == 0, 30)
        self._wait(f"node {self.node} to be back", lambda: self.node_state().rstrip("*") in ("idle", "mixed", "allocated"), timeout)

    def cancel_all(self) -> None:
        p = self.client("squeue", "-h", "-o", "%i")
        ids = p.stdout.split() if p.returncode == 0 else []
        if ids:
            self.client("scancel", *ids)

    def stop(self) -> None:
        """Cancel what is still queued, then stop the daemons by pid: slurmd, slurmctld, munged."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                self.cancel_all()
                # Let the jobs end while slurmd can still report it, or their slurmstepd would linger.
                deadline = time.monotonic() + 90
                while time.monotonic() < deadline and self.client("squeue", "-h", "-o", "%i").stdout.strip():
                    time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)

    def log_tail(self, name: str | None = None, lines: int = 30) -> str:
        names = [name] if name else ["munged", "slurmctld", "slurmd"]
        out = []
        for n in names:
            for f in (self.base / "log" / f"{n}.log", self.base / "log" / f"{n}.console"):
                if f.is_file():
                    tail = f.read_text(errors="replace").splitlines()[-lines:]
                    out.append(f"--- {f}\n" + "\n".join(tail))
        return "\n".join(out)

    def job(self, job_id: str) -> dict[str, str]:
        """scontrol's one-line record of a job as key -> value ({} once the controller forgot it)."""
        p = self.client("scontrol", "show", "job", "-o", job_id)
        if p.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", p.stdout))


@contextlib.contextmanager
def running_cluster(base: Path | None = None, **start_kw):
    """Start a cluster (skipping loudly when Slurm is not installed) and always stop it by pid."""
    missing = missing_binaries()
    if missing:
        pytest.skip(f"SLURM NOT INSTALLED: missing {', '.join(missing)}; the Slurm launcher tests did not run. {SETUP_HINT}")
    if os.geteuid() != 0:
        pytest.skip("SLURM TESTS NEED ROOT: the test cluster runs slurmd as root (SlurmdUser=root); the Slurm launcher tests did not run")
    # Short path: unix socket paths are limited to 107 bytes.
    own = base is None
    base = Path(tempfile.mkdtemp(prefix="ftmcp-slurm-")) if own else base
    cluster = SlurmCluster(base)
    try:
        try:
            cluster.start(**start_kw)
        except Exception as e:
            cluster.stop()
            pytest.fail(f"the test Slurm cluster did not start: {e}")
        yield cluster
    finally:
        cluster.stop()
        if own:
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster():
    """One cluster for the whole test session; its SLURM_CONF is what clients and the MCP server need."""
    with running_cluster() as cluster:
        yield cluster
