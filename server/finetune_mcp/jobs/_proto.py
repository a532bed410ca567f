"""The child side of the worker protocol: JSON lines on stdout, params as JSON on stdin.

Stdlib only: this runs in the training Python, which may lack pydantic and mcp.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any, Callable

_out = None


def _emit(obj: dict[str, Any]) -> None:
    _out.write(json.dumps(obj, default=str) + "\n")
    _out.flush()


def emit_progress(done: float, total: float | None = None, message: str | None = None) -> None:
    _emit({"event": "progress", "done": done, "total": total, "message": message})


class JobError(Exception):
    """Raise from a job for a failure the caller can act on; kind matches finetune_mcp.errors."""

    def __init__(self, message: str, *, kind: str = "BadInput", where: str | None = None, fix: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.where, self.fix = kind, message, where, fix


def run_main(fn: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Read params from stdin, call fn, print the result. Library chatter on stdout goes to stderr."""
    global _out
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
