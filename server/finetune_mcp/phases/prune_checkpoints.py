"""prune_checkpoints: delete a succeeded run's checkpoints/ once its adapter/ verifies against its DIGEST."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from finetune_mcp import schemas as S
from finetune_mcp.common.errors import Refused
from finetune_mcp.context import PhaseContext
from finetune_mcp.digest import verify_folder
from finetune_mcp.domain.run_notes import cites, note
from finetune_mcp.domain.run_state import run_state
from finetune_mcp.workspace import read_json_file


def prune_checkpoints(pc: PhaseContext, args: S.PruneCheckpointsArgs) -> S.PruneResult:
    run_id = args.run_id
    run_dir = pc.guard.check_read(pc.ws.run_dir(run_id))
    state = run_state(run_dir, read_json_file(run_dir / "run.json"), has_records=True)
    if state.status != "succeeded":
        raise Refused(f"{run_id} is {state.status}, not succeeded: its checkpoints may be all that is left of it",
                      where=str(run_dir / "checkpoints"),
                      fix="prune only after a run succeeded; a failed or stopped run resumes from its checkpoints")
    adapter = run_dir / "adapter"
    if not adapter.is_dir() or adapter.is_symlink():
        raise Refused(f"{run_id} has no adapter/ directory: the product would exist only inside checkpoints/",
                      where=str(adapter), fix="check the run's stdout.log for why train.py did not copy the adapter; keep the checkpoints")
    ok, actual, recorded = verify_folder(adapter)
    if not ok:
        why = "has no DIGEST" if recorded is None else f"does not match its DIGEST (recorded {recorded[:16]}…, files {actual[:16]}…)"
        raise Refused(f"adapter/ {why}; checkpoints are kept until the adapter verifies", where=str(adapter / "DIGEST"),
                      fix="the adapter copy is incomplete or was changed; re-export it from the last checkpoint before pruning")
    cp = run_dir / "checkpoints"
    if cp.is_symlink():
        raise Refused("checkpoints/ is a symbolic link; refusing to delete through it", where=str(cp))
    pc.guard.check_write(cp)
    if not cp.exists():
        return S.PruneResult(summary=f"{run_id}: nothing to prune (no checkpoints/); adapter/ verifies", run_id=run_id, freed_bytes=0)
    if adapter.resolve().is_relative_to(cp.resolve()):
        raise Refused("adapter/ lies inside checkpoints/; nothing is deleted", where=str(adapter))
    freed = _tree_bytes(cp)
    removed = sorted(p.name for p in cp.iterdir())
    shutil.rmtree(cp)
    note(pc, run_dir, "pruned", f"prune_checkpoints: deleted checkpoints/ ({len(removed)} entries, {_human(freed)}); adapter/ verified {actual[:16]}…")
    return S.PruneResult(
        summary=f"{run_id}: freed {_human(freed)} ({', '.join(removed) or 'empty'}); adapter/ kept and verified",
        citations=cites(pc, ("dgx-spark-ops", "run-layout")),
        run_id=run_id, freed_bytes=freed, removed=removed,
    )


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, dirs, files in os.walk(path):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"
