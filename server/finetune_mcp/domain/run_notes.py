"""What the run tools write into a run's roadbook, once each, and the citations they give: the lifecycle notes
poll_progress adds as it sees a run start, end or restart; what this server remembers of them (forget() drops it all,
as a freshly started server would)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from finetune_mcp import roadbook
from finetune_mcp.context import PhaseContext
from finetune_mcp.domain import progress, resume, run_state
from finetune_mcp.domain.run_state import TERMINAL, RunState

def note(pc: PhaseContext, run_dir: Path, event: str, text: str, once: bool = False) -> bool:
    """One line in the run's roadbook (once=True: only the first time this event is noted)."""
    return roadbook.append(pc.guard, run_dir, text, event=event, once=once)

_NOTED: dict[str, set] = {}

def mark_noted(run_dir: Path, event: str) -> None:
    _NOTED.setdefault(str(run_dir), set()).add(event)

def lifecycle_notes(pc: PhaseContext, run_dir: Path, state: RunState, last: dict | None) -> None:
    key = str(run_dir)
    noted = _NOTED.setdefault(key, set())
    todo = []
    if last is not None and "first-step" not in noted:
        first = progress.first_record(run_dir) or last
        todo.append(("first-step", f"poll_progress: first record, step {first['step']} loss {first['loss']:.4g}"))
    if state.status in TERMINAL:
        ev = {"succeeded": "finished", "failed": "failed", "stopped": "stopped"}[state.status]
        if ev not in noted:
            how = state.signal or (f"exit {state.exit_code}" if state.exit_code is not None else "no exit record")
            at = f", last step {last['step']} loss {last['loss']:.4g}" if last else ""
            todo.append((ev, f"poll_progress: {state.status} ({how}){at}" + (f" — {state.detail}" if state.detail and ev == "failed" else "")))
    for ev, text in todo:
        note(pc, run_dir, ev, text, once=True)
        noted.add(ev)
    requeue_notes(pc, run_dir, noted)

_RESUMES_SEEN: dict[str, int] = {}

def requeue_notes(pc: PhaseContext, run_dir: Path, noted: set) -> None:
    """Each time train.py resumed in its own directory (a requeued Slurm job, a restarted trainer), once in the roadbook."""
    path = run_dir / "logs" / "resumes.jsonl"
    try:
        size = os.stat(path).st_size
    except OSError:
        return
    if _RESUMES_SEEN.get(str(path)) == size:
        return  # nothing new since this server last looked
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return
    _RESUMES_SEEN[str(path)] = size
    for i, line in enumerate(lines, 1):
        ev = f"requeued-{i}"
        if ev in noted:
            continue
        try:
            r = json.loads(line)
        except ValueError:
            continue
        note(pc, run_dir, ev, f"train.py restarted in this run directory (attempt {r.get('attempt', '?')}) and resumed from its own "
                                   f"{r.get('checkpoint')}: optimizer, scheduler and RNG state restored; the records of steps it "
                                   f"recomputes after step {r.get('step')} were already written and are not repeated", once=True)
        noted.add(ev)

def forget() -> None:
    """Drop everything this server remembers of runs (tests and benchmarks: a freshly started server)."""
    _NOTED.clear()
    _RESUMES_SEEN.clear()
    resume.forget()
    progress.forget()
    run_state.forget()

def cites(pc: PhaseContext, *refs: tuple[str, str]) -> list[str]:
    """The sections a result applied; one not (yet) in the skills is left out rather than failing the tool."""
    out = []
    for skill, anchor in refs:
        try:
            out.append(pc.skills.cite(skill, anchor))
        except Exception:
            continue
    return out

