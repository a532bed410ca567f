"""Failure triage as a package: parse (metrics from any log format) -> signals -> classify -> remedies; tool reads a run's files or a log and attaches the remedies (phases/triage_failure.py is the MCP tool)."""

from finetune_mcp.triage.classify import Classification, RunnerUp, classify_file, classify_records, classify_text
from finetune_mcp.triage.remedies import CAUSE_ORDER, Rung, divergence_causes, load_ladder_table, oom_next_rung, rungs_tried
from finetune_mcp.triage.signals import load_signal_table
from finetune_mcp.triage.tool import triage_log_file, triage_run

__all__ = [
    "CAUSE_ORDER", "Classification", "Rung", "RunnerUp", "classify_file", "classify_records", "classify_text", "divergence_causes",
    "load_ladder_table", "load_signal_table", "oom_next_rung", "rungs_tried", "triage_log_file", "triage_run",
]
