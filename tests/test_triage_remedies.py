"""The remedies part of triage alone: divergence causes in their fixed order and the OOM ladder."""

from __future__ import annotations

import itertools

import pytest

from finetune_mcp.common.errors import BadInput
from finetune_mcp.triage import CAUSE_ORDER, divergence_causes, load_ladder_table, oom_next_rung, rungs_tried


# --- divergence causes, in order ---------------------------------------------------------------------

RANGES = {"sft-lora": [1e-4, 3e-4], "dpo": [1e-6, 1e-5], "grpo": [1e-6, 1e-5]}
BF16_OK = {"checks": [{"id": "G7", "status": "pass"}]}


def _never_called():
    raise AssertionError("packing was checked although an earlier cause explained the divergence")


def test_causes_keep_the_fixed_order_and_stop_at_the_first():
    assert CAUSE_ORDER == ("precision", "learning-rate", "packing")
    r = divergence_causes({"fp16": True, "method": "sft-lora", "learning_rate": 2e-4, "packing": True}, BF16_OK, RANGES, _never_called)
    assert [c["cause"] for c in r] == list(CAUSE_ORDER)
    assert [c["verdict"] for c in r] == ["explains", "not-checked", "not-checked"]
    assert "switch to bf16" in r[0]["why"] and "stopped at precision" in r[1]["why"]


def test_learning_rate_checked_once_precision_is_cleared():
    r = divergence_causes({"bf16": True, "method": "dpo", "learning_rate": 2e-4, "packing": True}, BF16_OK, RANGES, _never_called)
    assert [c["verdict"] for c in r] == ["cleared", "explains", "not-checked"]
    assert "bf16 on hardware that supports it" in r[0]["why"]
    assert "sft-lora" in r[1]["why"]  # the rate belongs to another method's range


def test_packing_only_after_both_are_cleared():
    calls = []

    def check():
        calls.append(1)
        return {"ok": False, "why": "sample 3 continues across an EOS with its mask off"}

    cfg = {"training": {"bf16": True, "learning_rate": 2e-4}, "method": "sft-lora", "packing": True}
    r = divergence_causes(cfg, BF16_OK, RANGES, check)
    assert [c["verdict"] for c in r] == ["cleared", "cleared", "explains"] and calls == [1]
    assert "EOS" in r[2]["why"]
    r = divergence_causes({**cfg, "packing": False}, BF16_OK, RANGES, _never_called)
    assert r[2]["verdict"] == "cleared"


def test_bf16_without_support_and_unknown_support():
    no = {"checks": [{"id": "N5", "status": "fail"}]}
    assert divergence_causes({"bf16": True}, no, RANGES, None)[0]["verdict"] == "explains"
    unknown = divergence_causes({"bf16": True, "method": "sft-lora", "learning_rate": 2e-4}, None, RANGES, None)
    assert [c["verdict"] for c in unknown] == ["not-checked", "cleared", "not-checked"]
    fp32 = divergence_causes({"fp16": False, "bf16": False}, None, RANGES, None)
    assert fp32[0]["verdict"] == "cleared"


# --- the OOM ladder ----------------------------------------------------------------------------------

RUNGS = ["flush", "reduce-batch-or-seq", "downgrade-method"]


def test_first_rung_is_flush_never_batch():
    assert oom_next_rung([]).id == "flush"
    # Having already cut the batch does not let the ladder skip the flush.
    assert oom_next_rung(["reduce-batch-or-seq"]).id == "flush"
    assert oom_next_rung(["flush"]).id == "reduce-batch-or-seq"
    assert oom_next_rung(["flush", "reduce-batch-or-seq"]).id == "downgrade-method"


def test_escalation_only_after_every_rung():
    for n in range(len(RUNGS) + 1):
        for tried in itertools.combinations(RUNGS, n):
            nxt = oom_next_rung(list(tried))
            if set(tried) == set(RUNGS):
                assert (nxt.kind, nxt.id) == ("escalation", "smaller-model")
            else:
                assert nxt.kind == "rung" and nxt.id == next(r for r in RUNGS if r not in tried)
    assert oom_next_rung(RUNGS + ["smaller-model"]).id == "multi-node"
    assert oom_next_rung(RUNGS + ["smaller-model", "multi-node"]).kind == "exhausted"


def test_downgrade_follows_bf16_lora_before_qlora():
    assert "full to bf16-lora" in oom_next_rung(["flush", "reduce-batch-or-seq"], current_method="full").detail
    assert "bf16-lora to qlora" in oom_next_rung(["flush", "reduce-batch-or-seq"], current_method="bf16-lora").detail
    spent = oom_next_rung(["flush", "reduce-batch-or-seq"], current_method="qlora")
    assert spent.kind == "escalation" and "already qlora" in spent.detail
    assert oom_next_rung([], current_method="qlora").id == "flush"


def test_ladder_refuses_bad_input():
    with pytest.raises(BadInput):
        oom_next_rung(["halve-batch"])
    with pytest.raises(BadInput):
        oom_next_rung([], current_method="sft-lora")


def test_ladder_table_refuses_batch_first():
    from pydantic import ValidationError

    from finetune_mcp.skilltables import OomLadderTable

    raw = load_ladder_table().model_dump()
    raw["rungs"] = [raw["rungs"][1], raw["rungs"][0], raw["rungs"][2]]
    with pytest.raises(ValidationError, match="in this order"):
        OomLadderTable.model_validate(raw)


def test_rungs_tried_from_config_history():
    history = [
        {"method": "sft-lora", "per_device_train_batch_size": 8, "max_length": 2048},
        {"method": "sft-lora", "per_device_train_batch_size": 8, "max_length": 2048, "oom_rung": "flush"},
        {"method": "sft-lora", "per_device_train_batch_size": 4, "max_length": 2048},
    ]
    assert rungs_tried(history) == ["flush", "reduce-batch-or-seq"]
    assert oom_next_rung(rungs_tried(history)).id == "downgrade-method"
    assert rungs_tried(history + [{"method": "sft-qlora", "per_device_train_batch_size": 4}]) == RUNGS
