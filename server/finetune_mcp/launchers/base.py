"""The launcher interface (check / render / start / alive / stop) and the supervised-process machinery local runs share.

A launcher decides *where* a run executes. Every launcher here starts the same supervisor
(runwrap.py, copied into the run directory) detached from the server, in its own session and
process group; the supervisor runs the command the launcher renders and writes exit.json when it
ends. Run state therefore lives in files (run.json, exit.json) plus a liveness probe, so a server
started later sees exactly what the one that launched saw.

A batch-system launcher (Slurm) fits the same interface: render → the batch script, start → submit
and record the job id, alive → ask the scheduler, stop → cancel with a signal.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

import psutil

from finetune_mcp.common.errors import JobFailed
from finetune_mcp.launchers.runwrap import run_processes

WRAPPER_NAME = ".runwrap.py"
STOP_MARKER = "stop-requested"
WRAPPER_SRC = Path(__file__).resolve().parent / "runwrap.py"


@dataclass(frozen=True)
class RunSpec:
    """Everything a launcher needs to know about one run."""

    run_ref: str  # <experiment>/<run-id>
    run_dir: Path
    python: str  # the training interpreter on this host
    script: str = "train.py"
    config: str = "config.yaml"
    nproc: int = 1
    device: str = "cpu"  # "cpu" | "cuda"
    gpus: tuple[str, ...] = ()  # device ids the run holds; ("all",) when nothing narrows it
    env: Mapping[str, str] = field(default_factory=dict)
    mounts: Mapping[str, Path] = field(default_factory=dict)  # container launchers: named host paths
    options: Mapping[str, Any] = field(default_factory=dict)  # launcher-specific settings

    @property
    def config_path(self) -> Path:
        return self.run_dir / self.config


Tick = Callable[[str], None]


def process_alive(pid: int | None, start_time: float | None) -> bool:
    """True when pid is running and is the very process recorded (same start time), not a zombie."""
    if not pid:
        return False
    try:
        p = psutil.Process(pid)
        if start_time is not None and abs(p.create_time() - float(start_time)) > 0.05:
            return False  # the pid was recycled by an unrelated process
        return p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


class Launcher(ABC):
    name: ClassVar[str]

    def check(self, spec: RunSpec) -> None:
        """Raise Refused when this launcher cannot run here; called before anything is created."""

    @abstractmethod
    def render(self, spec: RunSpec) -> list[str]:
        """The command that runs the trainer, as argv (run with cwd = the run directory)."""

    @abstractmethod
    def start(self, spec: RunSpec) -> dict[str, Any]:
        """Start the run detached; return the fields recorded in run.json (pid, pgid, start_time, command, job_id)."""

    @abstractmethod
    def alive(self, run_dir: Path, run_json: dict[str, Any]) -> bool:
        """Whether the run's supervisor is still running (the run has not ended)."""

    @abstractmethod
    def stop(self, run_dir: Path, run_json: dict[str, Any], grace: float, tick: Tick | None = None) -> list[str]:
        """Ask the run to stop (SIGTERM), escalate to SIGKILL after `grace` seconds; return the signals sent."""


class SupervisedLauncher(Launcher):
    """Runs the rendered command under the run supervisor, as a detached local process."""

    def supervisor_python(self, spec: RunSpec) -> str:
        return spec.python

    def start(self, spec: RunSpec) -> dict[str, Any]:
        cmd = self.render(spec)
        wrapper = spec.run_dir / WRAPPER_NAME
        shutil.copyfile(WRAPPER_SRC, wrapper)
        (spec.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        argv = [self.supervisor_python(spec), str(wrapper), "--run-dir", str(spec.run_dir), "--", *cmd]
        # The supervisor's own complaints (it cannot even start) land here; the trainer's in stdout.log.
        with open(spec.run_dir / "logs" / "supervisor.log", "ab") as err:
            try:
                proc = subprocess.Popen(argv, cwd=spec.run_dir, env=dict(spec.env), stdin=subprocess.DEVNULL,
                                        stdout=err, stderr=err, start_new_session=True, close_fds=True)
            except OSError as e:
                raise JobFailed(f"cannot start the run supervisor: {e}", where=" ".join(argv[:2]),
                                fix="check FINETUNE_MCP_TRAIN_PYTHON names a working Python interpreter") from None
        # Reap it if it ends while this server lives, so it never lingers as a zombie; the server
        # holds no other handle, and the run continues if the server goes away.
        threading.Thread(target=proc.wait, name=f"reap-{proc.pid}", daemon=True).start()
        try:
            start_time = psutil.Process(proc.pid).create_time()
        except psutil.NoSuchProcess:
            start_time = None
        return {"pid": proc.pid, "pgid": proc.pid, "start_time": start_time, "command": cmd,
                "supervisor": argv[:2], "job_id": None}

    def alive(self, run_dir: Path, run_json: dict[str, Any]) -> bool:
        return process_alive(run_json.get("pid"), run_json.get("start_time"))

    def terminate(self, run_dir: Path, run_json: dict[str, Any]) -> None:
        """The polite stop: SIGTERM to the run's process group (supervisor, trainer and whatever it started).

        The supervisor sees the stop-requested marker and does not pass it on, so the trainer gets it once.
        """
        os.killpg(int(run_json.get("pgid") or run_json["pid"]), signal.SIGTERM)

    def trainer_pid(self, run_dir: Path, run_json: dict[str, Any]) -> int | None:
        """The supervisor's child (what the rendered command started), as the supervisor recorded it."""
        try:
            pid = int((run_dir / ".trainer.pid").read_text())
            return pid if psutil.Process(pid).ppid() == run_json.get("pid") else None
        except (OSError, ValueError, psutil.NoSuchProcess):
            return None

    def escalate(self, run_dir: Path, run_json: dict[str, Any]) -> None:
        """SIGKILL what the supervisor runs, never the supervisor: it must live to write exit.json."""
        try:
            sup = psutil.Process(run_json["pid"])
            victims = sup.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        # Ranks torchrun started in sessions of their own, or orphaned ones, carry the run's marker.
        known = {p.pid for p in victims}
        for pid in run_processes(str(run_dir), exclude=sup.pid):
            if pid not in known:
                try:
                    victims.append(psutil.Process(pid))
                except psutil.NoSuchProcess:
                    pass
        for p in victims:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass

    def stop(self, run_dir: Path, run_json: dict[str, Any], grace: float, tick: Tick | None = None) -> list[str]:
        sent: list[str] = []
        if not self.alive(run_dir, run_json):
            return sent
        try:
            self.terminate(run_dir, run_json)
            sent.append("SIGTERM")
        except ProcessLookupError:
            return sent
        if wait_until(lambda: not self.alive(run_dir, run_json), grace, tick, "waiting for the trainer to save and exit"):
            return sent
        self.escalate(run_dir, run_json)
        sent.append("SIGKILL")
        if wait_until(lambda: not self.alive(run_dir, run_json), 15.0, tick, "waiting for the supervisor to record the exit"):
            return sent
        # A supervisor that cannot even record the exit is beyond saving; the caller writes exit.json.
        try:
            os.killpg(int(run_json.get("pgid") or run_json["pid"]), signal.SIGKILL)
        except ProcessLookupError:
            pass
        wait_until(lambda: not self.alive(run_dir, run_json), 5.0, None, "")
        return sent


def wait_until(done: Callable[[], bool], seconds: float, tick: Tick | None, what: str) -> bool:
    """Whether `done()` came true within `seconds` (checked every 0.1 s), telling `tick` `what` once a second."""
    deadline = time.monotonic() + seconds
    last_tick = 0.0
    while True:
        if done():
            return True
        now = time.monotonic()
        if now >= deadline:
            return done()
        if tick and now - last_tick >= 1.0:
            tick(what)
            last_tick = now
        time.sleep(0.1)
