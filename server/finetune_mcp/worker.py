"""Runs heavy jobs (tokenize/pack, probe, evaluate, merge, convert) in a child of the training Python.

The child speaks JSON lines on stdout (see jobs/_proto.py). The server never imports the heavy
stack itself, so it starts fast, stays small and survives a crash of that stack.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from finetune_mcp.errors import JobFailed, from_dict

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


def run_job(
    job: str,
    params: dict[str, Any],
    *,
    progress: ProgressFn | None = None,
    python: str | None = None,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run finetune_mcp.jobs.<job> in the training Python and return its result dict.

    Raises the child's own FtError (BadInput, NotFound, ...) or JobFailed with the tail of its stderr.
    """
    cmd = [python or train_python(), "-m", f"finetune_mcp.jobs.{job}"]
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=child_env(env), start_new_session=True
        )
        timer = None
        if timeout:
            timer = threading.Timer(timeout, lambda: _kill_group(proc))
            timer.start()
        result: dict[str, Any] | None = None
        error: dict[str, Any] | None = None
        try:
            assert proc.stdin and proc.stdout
            proc.stdin.write(json.dumps(params).encode())
            proc.stdin.close()
            for raw in proc.stdout:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("{"):
                    continue
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    continue
                ev = msg.get("event")
                if ev == "progress" and progress:
                    progress(float(msg.get("done", 0)), msg.get("total"), msg.get("message"))
                elif ev == "result":
                    result = msg.get("data") or {}
                elif ev == "error":
                    error = msg
            rc = proc.wait()
        finally:
            if timer:
                timer.cancel()
            if proc.poll() is None:
                _kill_group(proc)
                proc.wait()
        if error is not None:
            raise from_dict(error)
        if result is not None and rc == 0:
            return result
        err.seek(0)
        tail = err.read().decode("utf-8", "replace")[-4000:]
        how = f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
        raise JobFailed(
            f"job {job} {how} in {cmd[0]}" + (f" (timeout {timeout:.0f}s)" if timeout and rc < 0 else ""),
            where=" ".join(cmd),
            fix="its stderr ends with:\n" + tail if tail.strip() else "check that the training environment has the train extra installed",
        )


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
