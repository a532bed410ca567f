"""Runs heavy jobs (tokenize/pack, probe, evaluate, merge, convert) in a child of the training Python.

The child speaks JSON lines on stdout (see common/proto.py). The server never imports the heavy
stack itself, so it starts fast, stays small and survives a crash of that stack.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from finetune_mcp.common.errors import JobFailed, from_dict

ProgressFn = Callable[[float, float | None, str | None], None]
_PKG_DIR = Path(__file__).resolve().parent


def train_python() -> str:
    """The interpreter of the training environment: FINETUNE_MCP_TRAIN_PYTHON, else the server's own."""
    return os.environ.get("FINETUNE_MCP_TRAIN_PYTHON") or sys.executable


def package_path_dir() -> Path:
    """A folder holding only a link to this package, for the child's PYTHONPATH.

    Putting our site-packages on the path of another venv's Python would drag the server's torch
    and transformers into it; a folder with just `finetune_mcp` in it does not.
    """
    key = hashlib.sha256(str(_PKG_DIR).encode()).hexdigest()[:12]
    d = Path(tempfile.gettempdir()) / f"finetune-mcp-pkg-{os.getuid()}-{key}"
    link = d / "finetune_mcp"
    if not link.exists():
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".link-{os.getpid()}"
        try:
            os.symlink(_PKG_DIR, tmp)
            os.replace(tmp, link)
        except FileExistsError:
            pass
    return d


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(package_path_dir())] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # No model hub here or on air-gapped training boxes: a hub lookup must fail fast, not hang.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    # On a busy CPU box OpenMP's spinning waits cost several-fold (measured: 1.5 vs 21.6 steps/s).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if extra:
        env.update(extra)
    return env


JOB_TIMEOUT_DEFAULT_S = 3600.0  # a job that names no limit of its own (building the tiny model takes a minute)

# A job outlives nothing it works for. Each job holds the read end of a pipe whose only write end this process
# keeps (os.pipe's ends are not inherited across exec, so no run, tool or worker ever holds it): the kernel
# closes it when this process ends, however it ends (kill -9 included), and the job's watchdog thread
# (common/proto.py) reads EOF, removes the job's scratch paths and kills the job's process group. A death
# signal (PR_SET_PDEATHSIG) would not do: it fires when the *thread* that started the child ends (tool calls
# run in pool threads that come and go), and it does not pass through the warm worker's fork. Detached
# training runs get no lifeline: they are meant to outlive the server.
LIFELINE_ENV = "FINETUNE_MCP_LIFELINE_FD"
SCRATCH_ENV = "FINETUNE_MCP_SCRATCH"
_lifeline: tuple[int, int, int] | None = None  # (pid, read end, write end)
_lifeline_lock = threading.Lock()


def lifeline_fd() -> int:
    """The read end of this process's lifeline (made on first use, and anew in a forked child)."""
    global _lifeline
    with _lifeline_lock:
        if _lifeline is None or _lifeline[0] != os.getpid():
            r, w = os.pipe()
            _lifeline = (os.getpid(), r, w)
        return _lifeline[1]


def _lifeline_env(env: dict[str, str], scratch: list[str]) -> dict[str, str]:
    return {**env, LIFELINE_ENV: str(lifeline_fd()), SCRATCH_ENV: json.dumps(scratch)}


def run_job(
    job: str,
    params: dict[str, Any],
    *,
    progress: ProgressFn | None = None,
    python: str | None = None,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    light: bool = False,
    scratch: list[str] | None = None,
) -> dict[str, Any]:
    """Run finetune_mcp.jobs.<job> in the training Python and return its result dict.

    The job runs in a fresh process either way: forked from the warm worker when one is up for this
    Python and environment (see jobs/_zygote.py), else started cold as `python -m finetune_mcp.jobs.<job>`.
    `light`: the job needs none of the stack the warm worker preloads (a plot), so it uses the worker
    only when one is already up and never starts one for itself.
    Raises the child's own FtError (BadInput, NotFound, ...) or JobFailed with the tail of its stderr.
    Every job has a time limit: `timeout`, else JOB_TIMEOUT_DEFAULT_S.
    Every job ends when this process does (see LIFELINE_ENV); `scratch`: paths it writes (a staging folder)
    that go with it then, since nobody is left to remove them. Its TMPDIR is a folder of its own, removed when
    it ends either way: what its libraries leave there (wandb makes two folders at import) goes too.
    """
    timeout = timeout or JOB_TIMEOUT_DEFAULT_S
    py = python or train_python()
    full_env = child_env(env)
    warm = _warm_for(py, full_env, start=not light)
    tmp = tempfile.mkdtemp(prefix="finetune-mcp-job-tmp-")
    job_env, scratch = {**full_env, "TMPDIR": tmp}, [*(scratch or []), tmp]
    try:
        if warm is not None and (not light or warm.ready.is_set()):
            try:
                return warm.run(job, params, job_env, progress=progress, timeout=timeout, scratch=scratch)
            except _WarmUnavailable:
                pass
        return _run_cold(job, params, py, job_env, progress, timeout, scratch)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_cold(job: str, params: dict[str, Any], py: str, env: dict[str, str], progress: ProgressFn | None, timeout: float | None,
              scratch: list[str]) -> dict[str, Any]:
    cmd = [py, "-m", f"finetune_mcp.jobs.{job}"]
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=_lifeline_env(env, scratch),
                                start_new_session=True, pass_fds=(lifeline_fd(),))
        timer = None
        if timeout:
            timer = threading.Timer(timeout, lambda: _kill_group(proc.pid))
            timer.start()
        reader = _Events(progress)
        try:
            assert proc.stdin and proc.stdout
            proc.stdin.write(json.dumps(params).encode())
            proc.stdin.close()
            for raw in proc.stdout:
                reader.feed(raw)
            rc = proc.wait()
        finally:
            if timer:
                timer.cancel()
            if proc.poll() is None:
                _kill_group(proc.pid)
                proc.wait()
        err.seek(0)
        return reader.outcome(job, rc, " ".join(cmd), timeout, lambda: err.read().decode("utf-8", "replace"))


class _Events:
    """The parent's side of the JSON-lines protocol: progress passed on, the result or error kept."""

    def __init__(self, progress: ProgressFn | None):
        self.progress = progress
        self.result: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.pid: int | None = None
        self.rc: int | None = None
        self.expired = False

    def expire(self) -> None:
        """The job's time is up: kill its process group now, or as soon as its pid is known."""
        self.expired = True
        if self.pid is not None:
            _kill_group(self.pid)

    def feed(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("{"):
            return
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            return
        ev = msg.get("event")
        if ev == "progress" and self.progress:
            self.progress(float(msg.get("done", 0)), msg.get("total"), msg.get("message"))
        elif ev == "result":
            self.result = msg.get("data") or {}
        elif ev == "error":
            self.error = msg
        elif ev == "pid":
            self.pid = int(msg["pid"])
            if self.expired:
                _kill_group(self.pid)
        elif ev == "exit":
            self.rc = int(msg["rc"])

    def outcome(self, job: str, rc: int | None, where: str, timeout: float | None, stderr: Callable[[], str]) -> dict[str, Any]:
        if self.error is not None:
            raise from_dict(self.error)
        if self.result is not None and rc in (0, None):
            return self.result
        tail = stderr()[-4000:]
        if rc is None:
            how = "ended without saying how (the warm worker went away)"
        else:
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
        raise JobFailed(
            f"job {job} {how} in {where.split()[0]}" + (f" (timeout {timeout:.0f}s)" if timeout and rc is not None and rc < 0 else ""),
            where=where,
            fix="its stderr ends with:\n" + tail if tail.strip() else "check that the training environment has the train extra installed",
        )


# --- the warm worker -------------------------------------------------------------------------------------------

class _WarmUnavailable(Exception):
    """The warm worker cannot take this job (gone, or never came up); run it cold instead."""


def warm_enabled() -> bool:
    return os.environ.get("FINETUNE_MCP_WARM_WORKER", "1").strip().lower() not in ("0", "false", "no", "off")


class _Warm:
    """One zygote process (jobs/_zygote.py) in the training Python, with the environment jobs get."""

    READY_TIMEOUT_S = 300.0

    def __init__(self, python: str, env: dict[str, str]):
        self.python, self.env = python, env
        self.dir = tempfile.mkdtemp(prefix="finetune-mcp-warm-")
        self.sock = os.path.join(self.dir, "s")
        self.err = open(os.path.join(self.dir, "zygote.err"), "wb")
        # The worker itself watches its stdin for its parent; the lifeline is for the jobs it forks. Its TMPDIR
        # is its own folder, which goes with it: what the preloads leave there (wandb makes two folders) too.
        self.proc = subprocess.Popen(
            [python, "-m", "finetune_mcp.jobs._zygote", self.sock],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, env={**env, "TMPDIR": self.dir}, start_new_session=True,
            pass_fds=(lifeline_fd(),),
        )
        self.ready = threading.Event()
        self.info: dict[str, Any] = {}
        threading.Thread(target=self._await_ready, name="finetune-mcp-warm-ready", daemon=True).start()

    def _await_ready(self) -> None:
        assert self.proc.stdout
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if msg.get("event") == "ready":
                self.info = msg
                break
        self.ready.set()  # also on EOF: run() then sees a dead process

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, job: str, params: dict[str, Any], env: dict[str, str], *, progress: ProgressFn | None, timeout: float | None,
            scratch: list[str]) -> dict[str, Any]:
        started = time.monotonic()
        if not self.ready.wait(self.READY_TIMEOUT_S) or not self.alive() or not self.info:
            raise _WarmUnavailable()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _connect(conn, self.sock)
        except OSError:
            conn.close()
            raise _WarmUnavailable() from None
        # Outside self.dir: a job in flight outlives a close() of its worker (a run launched meanwhile).
        fd, err_path = tempfile.mkstemp(prefix="finetune-mcp-job-err-")
        os.close(fd)
        reader = _Events(progress)
        timer = None
        try:
            req = {"job": job, "params": params, "env": _lifeline_env(env, scratch + [err_path]), "cwd": os.getcwd(), "stderr": err_path}
            conn.sendall((json.dumps(req) + "\n").encode())
            if timeout:
                # The wait for the worker to come up counts against the job's own limit.
                timer = threading.Timer(max(0.0, timeout - (time.monotonic() - started)), reader.expire)
                timer.start()
            with conn.makefile("rb") as stream:
                for raw in stream:
                    reader.feed(raw)
        finally:
            if timer:
                timer.cancel()
            conn.close()
        try:
            with open(err_path, "rb") as f:
                tail = f.read().decode("utf-8", "replace")
        finally:
            Path(err_path).unlink(missing_ok=True)
        return reader.outcome(job, reader.rc, f"{self.python} -m finetune_mcp.jobs.{job} (forked from the warm worker)", timeout, lambda: tail)

    def close(self) -> None:
        if self.alive():
            try:
                if not self.ready.is_set():
                    raise OSError("still importing: nothing to wind down")
                assert self.proc.stdin
                self.proc.stdin.write(b"exit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=3)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                _kill_group(self.proc.pid)
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream and stream.close()
            except OSError:
                pass
        self.err.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _connect(conn: socket.socket, path: str) -> None:
    """Connect to the worker's socket, also when its path is longer than a socket address may be (a deep
    TMPDIR): then through this process's descriptor of its folder, /proc/self/fd/N/s, which is short. A
    chdir would do too, but it is process-wide and this server has threads."""
    if len(os.fsencode(path)) <= 107:  # sockaddr_un.sun_path: 108 bytes on Linux, with its NUL
        conn.connect(path)
        return
    fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        conn.connect(f"/proc/self/fd/{fd}/{os.path.basename(path)}")
    finally:
        os.close(fd)


_warm: _Warm | None = None
# Set afresh by pytest for every test phase and read by nothing a worker preloads. Every other variable
# counts: a library may read it at import (HF_HOME, CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS...), so a change
# means a new worker. The job's child gets the caller's exact environment either way.
_VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})


def _env_key(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _VOLATILE_ENV}


_warm_lock = threading.Lock()


def _warm_for(python: str, env: dict[str, str], start: bool = True) -> _Warm | None:
    """The warm worker for this Python and environment, started when there is none; None when disabled.

    A job asking for another environment than the current worker's (its own `env=`) runs cold; a change of
    the server's environment or Python replaces the worker.
    """
    global _warm
    if not warm_enabled():
        return None
    with _warm_lock:
        w = _warm
        key = _env_key(env)
        if w is not None and w.alive() and w.python == python and _env_key(w.env) == key:
            return w
        if python != train_python() or key != _env_key(child_env(None)):
            return None  # a one-off Python or environment (a job's own `env=`): cold, and keep the worker
        if w is not None:
            w.close()
            _warm = None
        if not start:
            return None
        _warm = _Warm(python, env)
        return _warm


def prewarm() -> None:
    """Start the warm worker now (without waiting), so its imports overlap the caller's light work."""
    _warm_for(train_python(), child_env(None))


def release_warm() -> None:
    """Stop the warm worker and give its memory back (before a training run takes the machine)."""
    global _warm
    with _warm_lock:
        if _warm is not None:
            _warm.close()
            _warm = None


atexit.register(release_warm)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
