"""The child side of the worker protocol: JSON lines on stdout, params as JSON on stdin.

Stdlib only: this runs in the training Python, which may lack pydantic and mcp.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import sys
import threading
import traceback
from typing import Any, Callable

_out = None


def _emit(obj: dict[str, Any]) -> None:
    _out.write(json.dumps(obj, default=str) + "\n")
    _out.flush()


def emit_progress(done: float, total: float | None = None, message: str | None = None) -> None:
    _emit({"event": "progress", "done": done, "total": total, "message": message})


def in_job() -> bool:
    """Whether this process runs as a job (run_main set up the protocol's stream), not as a plain script."""
    return _out is not None


class JobError(Exception):
    """Raise from a job for a failure the caller can act on; kind matches finetune_mcp.common.errors."""

    def __init__(self, message: str, *, kind: str = "BadInput", where: str | None = None, fix: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.where, self.fix = kind, message, where, fix


_lifeline_fd: int | None = None  # the job's lifeline read end, once _watch_parent has taken it


def _wait_for_eof(fd: int) -> None:
    try:
        while os.read(fd, 1):  # nothing is ever written: only the end of the pipe comes
            pass
    except OSError:
        pass


def follow_lifeline() -> None:
    """In a process the job forked (a pool worker's initializer): end it too when the server is gone. A fork copies
    no thread, so the job's watcher does not come along, but the lifeline's read end does. The job's watcher kills its
    whole process group; this is the same end for a process that missed that kill (one forked at that moment)."""
    fd = _lifeline_fd
    if fd is None:
        return

    def watch() -> None:
        _wait_for_eof(fd)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="finetune-mcp-lifeline", daemon=True).start()


def _watch_parent() -> None:
    """End this job, its process group and its scratch paths when the server that started it is gone.

    finetune_mcp.worker passes the read end of a pipe only the server can write to (FINETUNE_MCP_LIFELINE_FD):
    a read returns EOF the moment the server has ended, however it ended. The job leads its own process group
    (a cold job's own session, a warm child's setsid), so the group is the job and what it started (a pool of
    forked workers). The variables are taken out of the environment so nothing the job starts inherits them.
    """
    fd = os.environ.pop("FINETUNE_MCP_LIFELINE_FD", None)
    scratch = os.environ.pop("FINETUNE_MCP_SCRATCH", None)
    if not fd:
        return
    try:
        fd_n = int(fd)
        paths = [str(p) for p in json.loads(scratch or "[]")]
        if not stat.S_ISFIFO(os.fstat(fd_n).st_mode):  # not the pipe it was meant to be: nothing to watch
            return
    except (ValueError, OSError, TypeError):
        return

    global _lifeline_fd
    _lifeline_fd = fd_n

    def watch() -> None:
        _wait_for_eof(fd_n)
        for p in paths:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    os.unlink(p)
                except OSError:
                    pass
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="finetune-mcp-lifeline", daemon=True).start()


def run_main(fn: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Read params from stdin, call fn, print the result. Library chatter on stdout goes to stderr."""
    global _out
    _watch_parent()
    _out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    # Keep stray prints from libraries off the protocol channel.
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        params = json.loads(sys.stdin.read() or "{}")
        data = fn(params)
        _emit({"event": "result", "data": data})
    except JobError as e:
        _emit({"event": "error", "kind": e.kind, "message": e.message, "where": e.where, "fix": e.fix})
        sys.exit(2)
    except Exception as e:  # the traceback goes to stderr; the parent shows its tail
        traceback.print_exc()
        _emit({"event": "error", "kind": "JobFailed", "message": f"{type(e).__name__}: {e}", "where": None, "fix": None})
        sys.exit(1)
