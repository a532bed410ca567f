"""A run's roadbook.md: what happened to it, one line per event, appended by every tool under the run's lock."""

from __future__ import annotations

import fcntl
from pathlib import Path

from finetune_mcp.common.errors import FtError
from finetune_mcp.workspace import utc_now

LOCK_NAME = ".roadbook.lock"


def append(guard, run_dir: Path, text: str, event: str | None = None, once: bool = False) -> bool:
    """Append one line; with once=True only if `event` is not there yet. False when nothing was written.

    Every writer (a poll noting the first step, stop_run, export, another server) takes the run's lock
    around read-modify-rename, so two appends at once never lose one another's line. A role that may
    not write here (the eval side polling) only reads.
    """
    path = run_dir / "roadbook.md"
    try:
        guard.check_write(path)
    except FtError:
        return False
    with open(run_dir / LOCK_NAME, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            existing = path.read_text(encoding="utf-8") if path.exists() else ""
            if once and event and f"<!-- event:{event} -->" in existing:
                return False
            if not existing:
                existing = f"# Roadbook: {run_dir.parent.name}/{run_dir.name}\n\n"
            line = (f"- {utc_now()} **{event}** — {text} <!-- event:{event} -->\n" if event else f"- {utc_now()} {text}\n")
            guard.write_text(path, existing + line)
            return True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
