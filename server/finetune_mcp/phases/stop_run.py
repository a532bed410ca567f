"""stop_run: stop a run cleanly. SIGTERM first (train.py saves a checkpoint and exits 143), SIGKILL after the grace
period; the launcher that started the run sends them (a process group, a container, a Slurm job)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from finetune_mcp import schemas as S
from finetune_mcp.common.errors import Refused
from finetune_mcp.context import PhaseContext
from finetune_mcp.domain.run_notes import cites, mark_noted, note
from finetune_mcp.domain.run_state import TERMINAL, latest_checkpoint, run_state
from finetune_mcp.launchers import get_launcher
from finetune_mcp.launchers.base import STOP_MARKER
from finetune_mcp.workspace import atomic_write_json, read_json_file, utc_now


def stop_run(pc: PhaseContext, args: S.StopRunArgs) -> S.StopResult:
    run_id, grace_seconds = args.run_id, args.grace_seconds
    run_dir = pc.guard.check_read(pc.ws.run_dir(run_id))
    pc.guard.check_write(run_dir / STOP_MARKER)
    run_json = read_json_file(run_dir / "run.json")
    if run_json is None:
        raise Refused(f"{run_id} has no run.json yet: its launch has not completed", where=str(run_dir / "run.json"),
                      fix="poll_progress until it reports running, then stop it")
    state = run_state(run_dir, run_json, has_records=True)
    if state.status in TERMINAL:
        return S.StopResult(summary=f"{run_id} had already ended: {state.status}" + (f" ({state.detail})" if state.detail else ""),
                            run_id=run_id, status=state.status, signal_sent=[], checkpoint=latest_checkpoint(run_dir))
    pc.guard.write_text(run_dir / STOP_MARKER, json.dumps({"requested_at": utc_now(), "by": "stop_run",
                                                           "grace_seconds": grace_seconds}) + "\n")
    note(pc, run_dir, "stop-requested", f"stop_run: SIGTERM (the trainer saves a checkpoint), SIGKILL after {grace_seconds:g}s")
    lau = get_launcher(run_json.get("launcher") or "local")
    t0 = time.monotonic()
    sent = lau.stop(run_dir, run_json, float(grace_seconds),
                    tick=lambda what: pc.progress(time.monotonic() - t0, float(grace_seconds), what))
    if read_json_file(run_dir / "exit.json") is None and not lau.alive(run_dir, run_json):
        # The supervisor died without recording the exit (it was killed with the group): record it here.
        atomic_write_json(run_dir / "exit.json", {"returncode": 137, "signal": "SIGKILL", "ended_at": utc_now(),
                                                  "stopped_by": "stop_run", "pid": None, "wrapper_pid": run_json.get("pid"),
                                                  "note": "written by stop_run: the supervisor recorded no exit"})
    state = run_state(run_dir, run_json, has_records=True)
    cp = latest_checkpoint(run_dir)
    note(pc, run_dir, "stopped", f"stop_run: {state.status} after {', '.join(sent) or 'no signal'}"
              + (f"; last checkpoint {Path(cp).name}" if cp else "; no checkpoint"), once=True)
    mark_noted(run_dir, "stopped")
    return S.StopResult(
        summary=f"{run_id}: {state.status} ({' then '.join(sent) or 'no signal needed'})"
                + (f"; checkpoint kept: {Path(cp).name}" if cp else "; no checkpoint was saved"),
        citations=cites(pc, ("dgx-spark-ops", "failure-signals"), ("dgx-spark-ops", "run-layout")),
        run_id=run_id, status=state.status, signal_sent=sent, checkpoint=cp,
    )
