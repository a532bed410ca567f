"""poll_progress: a run's status and new progress records from a cursor, with anomalies, pace and (on request) the
loss curve. The run's state lives in its directory (domain/run_state.py); its records are read by cursor
(domain/progress.py); this module checks for stalls and resume jumps, notes the lifecycle in the roadbook, and
shapes the result."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

from finetune_mcp import schemas as S
from finetune_mcp.context import PhaseContext
from finetune_mcp.domain import progress
from finetune_mcp.domain.resume import resume_jumps
from finetune_mcp.domain.run_notes import cites, lifecycle_notes
from finetune_mcp.domain.run_state import config_value, run_state
from finetune_mcp.workspace import read_json_file
from finetune_mcp.worker import run_job


def poll_progress(pc: PhaseContext, args: S.PollProgressArgs) -> S.PollResult:
    run_id, cursor, limit, plot = args.run_id, args.cursor, args.limit, args.plot
    run_dir = pc.guard.check_read(pc.ws.run_dir(run_id))
    run_json = read_json_file(run_dir / "run.json")
    got = progress.read(run_dir, cursor, limit, progress.spike_rule(pc.skills))
    last, anomalies = got.last, got.anomalies

    state = run_state(run_dir, run_json, has_records=last is not None)
    if state.status in ("starting", "running") and run_json is not None:
        minutes = progress.stall_minutes()
        since = got.mtime if got.mtime is not None else (run_dir / "run.json").stat().st_mtime
        idle = (time.time() - since) / 60.0
        if idle >= minutes:
            what = f"no new step for {idle:.0f} minutes" if last else f"no first step {idle:.0f} minutes after launch"
            anomalies.append(S.Anomaly(kind="stalled", step=last["step"] if last else None,
                                       message=f"{what} (threshold {minutes:g} min, FINETUNE_MCP_STALL_MINUTES)"))

    anomalies += resume_jumps(pc, run_dir, got.records)
    lifecycle_notes(pc, run_dir, state, last)
    pace = progress.throughput(run_dir, last["step"] if last else None, running=state.status == "running")

    if last is not None:
        max_steps = config_value(run_dir, "max_steps")
        total = float(max_steps) if isinstance(max_steps, (int, float)) and max_steps > 0 else None
        pc.progress(float(last["step"]), total, f"step {last['step']} loss {_loss_text(last['loss'])}"
                    + (f", {_duration(pace.eta_s)} left" if pace.eta_s is not None else ""))

    n = len(got.records)
    bits = [f"{run_id}: {state.status}"]
    if state.exit_code is not None or state.signal:
        bits.append(f"({state.signal or 'exit ' + str(state.exit_code)})")
    if last is not None:
        bits.append(f"at step {last['step']}, loss {_loss_text(last['loss'])}")
    if pace.tokens_per_s is not None:
        bits.append(f"; {pace.tokens_per_s:,.0f} tokens/s")
    if pace.eta_s is not None:
        bits.append(f"; about {_duration(pace.eta_s)} left")
    bits.append(f"; {n} new record{'s' if n != 1 else ''}" + (" (more waiting)" if got.more else ""))
    if anomalies:
        bits.append(f"; {len(anomalies)} anomal{'y' if len(anomalies) == 1 else 'ies'}: " + ", ".join(sorted({a.kind for a in anomalies})))
    result = S.PollResult(
        summary=" ".join(bits).replace(" ;", ";"),
        citations=cites(pc, ("dgx-spark-ops", "failure-signals")),
        run_id=run_id, status=state.status, exit_code=state.exit_code, signal=state.signal, detail=state.detail,
        records=[S.ProgressRecord(**r) for r in got.records],
        last=S.ProgressRecord(**last) if last else None,
        anomalies=anomalies, cursor=cursor, next_cursor=got.next_cursor, more=got.more,
        tokens_per_s=pace.tokens_per_s, steps_per_s=pace.steps_per_s, eta_s=pace.eta_s,
    )
    if plot:
        result._image_png = _loss_png(pc, run_dir, run_id, got.src is not None)
    return result


def _loss_text(loss: float) -> str:
    return f"{loss:.4g}" if math.isfinite(loss) else str(loss)


def _loss_png(pc: PhaseContext, run_dir: Path, run_id: str, has_records: bool) -> bytes | None:
    png = run_dir / "loss.png"
    if png.is_file():
        return pc.guard.read_bytes(png)
    if not has_records:
        return None
    with tempfile.TemporaryDirectory(prefix="ftmcp-plot-") as tmp:
        out = Path(tmp) / "loss.png"
        points = [[r["step"], r["loss"]] for r in progress.all_records(run_dir)]
        run_job("plot_loss", {"out": str(out), "title": run_id, "points": points}, timeout=120, light=True)
        return out.read_bytes()


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 90:
        return f"{s}s"
    if s < 90 * 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"
