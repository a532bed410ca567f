"""triage_failure: classify a failed run of ours (run_id) or any training log (log_path), with evidence and remedies.

The knowledge is in triage/ (parse -> signals -> classify -> remedies); this is the tool's argument check and dispatch.
"""

from __future__ import annotations

from finetune_mcp import schemas as S
from finetune_mcp.common.errors import BadInput
from finetune_mcp.context import PhaseContext
from finetune_mcp.triage.tool import triage_log_file, triage_run


def triage_failure(pc: PhaseContext, args: S.TriageFailureArgs) -> S.TriageResult:
    if bool(args.run_id) == bool(args.log_path):
        raise BadInput("give exactly one of run_id or log_path", where="run_id / log_path",
                       fix="run_id for a run launched here (<experiment>/<YYYYMMDD-HHMM-tag>); log_path for any other training log")
    if args.log_path:
        return triage_log_file(pc.guard.check_read(args.log_path, "log_path"))
    return triage_run(pc, args.run_id)
