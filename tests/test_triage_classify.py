"""The classify part of triage alone: priorities, never silent on a failure, confidence, runner-up and missing evidence.

Findings are built from real dev-corpus lines and the table's own signals, so the rules are tested
apart from the log scanning.
"""

from __future__ import annotations

from pathlib import Path

from finetune_mcp.triage.classify import Classification, decide
from finetune_mcp.triage.parse import Metric
from finetune_mcp.triage.signals import Findings, Hit, find, load_signal_table

LOGS = Path(__file__).parent / "fixtures" / "logs"
TABLE = load_signal_table()
SIG = {s.id: s for s in TABLE.signals}


def _findings(hits=(), *, metrics=(), markers=(), exception=None, exit_code=None) -> Findings:
    return Findings(list(hits), list(metrics), list(markers), exception, False, exit_code, table=TABLE)


def test_highest_priority_wins_and_the_rest_is_the_runner_up():
    oom = Hit(SIG["cuda-oom"], [(9, "torch.OutOfMemoryError: CUDA out of memory.")])
    nccl = Hit(SIG["nccl-timeout"], [(3, "Watchdog caught collective operation timeout")])
    c = decide(_findings([nccl, oom]))
    assert (c.failure_class, c.signals[0]) == ("oom", "cuda-oom")
    assert c.runner_up.failure_class == "environment" and c.runner_up.confidence < c.confidence
    assert c.evidence == [(9, "torch.OutOfMemoryError: CUDA out of memory.")]


def test_never_silent_a_failure_with_no_signal_gets_a_weak_class():
    exc = (2, "KeyError: 'text'")
    c = decide(_findings(markers=[(1, "Traceback (most recent call last):")], exception=exc))
    assert c.failure_class == "environment" and c.signals[0] == "fallback-setup"
    assert c.confidence < 0.5 and c.evidence[-1] == exc and c.missing_evidence
    # By exception type: a memory error reads oom, a floating-point error divergence.
    assert decide(_findings(exception=(1, "MemoryError"))).failure_class == "oom"
    assert decide(_findings(exception=(1, "FloatingPointError: Loss became infinite"))).failure_class == "divergence"
    assert decide(_findings(exit_code=2)).failure_class == "environment"


def test_a_requested_stop_is_none_stopped_and_outranks_only_the_fallback():
    stop = Hit(SIG["user-interrupt"], [(5, "KeyboardInterrupt")])
    c = decide(_findings([stop], exception=(5, "KeyboardInterrupt")))
    assert (c.failure_class, c.healthy_or_unrecognised) == ("none", "stopped")
    oom = Hit(SIG["cuda-oom"], [(2, "CUDA out of memory")])
    assert decide(_findings([stop, oom])).failure_class == "oom"


def test_healthy_reads_none_and_says_what_it_checked():
    ms = [Metric(i, f"l{i}", step=i, loss=2.0 - i / 10) for i in range(1, 8)]
    c = decide(_findings(metrics=ms))
    assert (c.failure_class, c.healthy_or_unrecognised) == ("none", "healthy")
    assert c.runner_up.failure_class == "divergence" and "no other class has evidence" in c.runner_up.why
    assert "7 logged loss values" in c.reason and c.metrics["loss_min"] == 1.3
    bare = decide(_findings())
    assert bare.failure_class == "none" and bare.confidence < c.confidence and bare.missing_evidence


def test_numbers_alone_say_so_in_missing_evidence():
    text = (LOGS / "divergence-loss-zero-grad-norm-nan-minicpm-lora.log").read_text()
    c = decide(find(text))
    assert c.failure_class == "divergence" and "loss-zero-grad-nan" in c.signals
    assert any("rests on the logged numbers" in m for m in c.missing_evidence)
    lines = text.split("\n")
    assert all(lines[n - 1] == t for n, t in c.evidence)


def test_to_dict_carries_the_new_fields():
    d = Classification("oom", "r", [(1, "x")], ["cuda-oom"], confidence=0.9).to_dict()
    assert d["evidence"] == [{"line": 1, "text": "x"}] and d["confidence"] == 0.9 and d["runner_up"] is None
    # Every verdict names a runner-up, even when no other class has evidence.
    alone = decide(_findings([Hit(SIG["sigkill-in-log"], [(1, "Killed")])]))
    assert alone.runner_up.failure_class == "environment" and alone.runner_up.confidence < alone.confidence
