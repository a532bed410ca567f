"""Pydantic models for every skills/<skill>/tables/<table>.yaml; unknown keys are refused.

One section per skill. TABLES maps (skill, table) to the model that validates it; a table file
with no model here is itself an error, so nothing in skills/ goes unchecked.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


TABLES: dict[tuple[str, str], type[BaseModel]] = {}


def table(skill: str, name: str):
    def deco(cls):
        TABLES[(skill, name)] = cls
        return cls

    return deco


# --- dataset-curation ---


# --- spark-preflight ---


# --- dgx-spark-ops ---

import re as _re  # noqa: E402  (section-local import keeps the sections independent)

from pydantic import field_validator as _field_validator, model_validator as _model_validator  # noqa: E402

# The preflight check ids (spark-preflight's checks table); triage names one of them.
OpsCheckId = Literal["G1", "G2", "G3", "G4", "G5", "G6", "G7", "N1", "N2", "N3", "N4", "N5", "N6", "N7", "C1"]


def _compiles(patterns: list[str], flags: int = 0) -> list[str]:
    for p in patterns:
        try:
            _re.compile(p, flags)
        except _re.error as e:
            raise ValueError(f"pattern {p!r} is not a valid regex: {e}") from None
    return patterns


class SignalCheck(Strict):
    generic: OpsCheckId | None = Field(None, description="check to re-run on generic-nvidia or cpu")
    spark: OpsCheckId | None = Field(None, description="check to re-run on dgx-spark (a G-number)")


class FailureSignal(Strict):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    failure_class: Literal["environment", "divergence", "oom", "none"] = Field(alias="class")
    priority: int = Field(ge=0, le=100, description="the highest-priority matching signal decides the class")
    patterns: list[str] = Field(default_factory=list, description="regexes searched in each log line")
    ignore_case: bool = False
    exit_codes: list[int] = Field(default_factory=list, description="exit statuses that show this signal")
    exit_signals: list[int] = Field(default_factory=list, description="terminating signals that show this signal")
    records_rule: Literal["nonfinite-loss", "nonfinite-grad-norm", "loss-spike", "grad-norm-explosion", "flat-loss"] | None = None
    explained_by_stop: bool = Field(False, description="a stop we asked for explains it (a SIGKILL from stop_run)")
    stop_request: bool = Field(False, description="present whenever stop_run asked the run to end")
    check: SignalCheck | None = None
    none_kind: Literal["healthy", "stopped"] | None = None
    note: str
    source: list[str] = Field(min_length=1)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @_model_validator(mode="after")
    def _consistent(self):
        _compiles(self.patterns, _re.I if self.ignore_case else 0)
        if not (self.patterns or self.exit_codes or self.exit_signals or self.records_rule or self.stop_request):
            raise ValueError(f"signal {self.id!r} has nothing to detect it: give patterns, exit_codes/exit_signals, records_rule or stop_request")
        if (self.failure_class == "none") != (self.none_kind is not None):
            raise ValueError(f"signal {self.id!r}: none_kind is required for class none and only for it")
        if self.check is not None and self.failure_class != "environment":
            raise ValueError(f"signal {self.id!r}: only environment signals name a preflight check")
        return self


class RecordRules(Strict):
    loss_patterns: list[str] = Field(min_length=1, description="regexes whose group 1 is a logged training loss")
    grad_norm_patterns: list[str] = Field(min_length=1)
    spike_factor: float = Field(gt=1)
    spike_min_history: int = Field(ge=1)
    spike_window: int = Field(ge=1)
    flat_identical_run: int = Field(ge=2)
    flat_repeat_window: int = Field(ge=2)
    grad_norm_max: float = Field(gt=0)

    @_field_validator("loss_patterns", "grad_norm_patterns")
    @classmethod
    def _valid(cls, v):
        return _compiles(v)


@table("dgx-spark-ops", "failure-signals")
class FailureSignalsTable(Strict):
    signals: list[FailureSignal] = Field(min_length=1)
    records: RecordRules
    unrecognised_markers: list[str]

    @_field_validator("unrecognised_markers")
    @classmethod
    def _valid(cls, v):
        return _compiles(v)

    @_model_validator(mode="after")
    def _unique(self):
        seen: set[str] = set()
        for s in self.signals:
            if s.id in seen:
                raise ValueError(f"signal id {s.id!r} appears twice")
            seen.add(s.id)
        rules = [s.records_rule for s in self.signals if s.records_rule]
        if len(rules) != len(set(rules)):
            raise ValueError("each records_rule may belong to one signal only")
        return self


LADDER_RUNGS = ("flush", "reduce-batch-or-seq", "downgrade-method")
LADDER_ESCALATION = ("smaller-model", "multi-node")


class LadderStep(Strict):
    id: str
    action: str
    how: list[str] = Field(min_length=1)
    why: str
    source: list[str] = Field(min_length=1)


@table("dgx-spark-ops", "oom-ladder")
class OomLadderTable(Strict):
    name: Literal["spark-memory-thermal-ops"]
    rungs: list[LadderStep]
    escalation: list[LadderStep]
    method_downgrade: dict[Literal["full", "bf16-lora", "qlora"], Literal["bf16-lora", "qlora"]]

    @_model_validator(mode="after")
    def _fixed_order(self):
        # The order is the seed's, not a tunable: a table that reorders it (batch first) is refused.
        got = tuple(r.id for r in self.rungs)
        if got != LADDER_RUNGS:
            raise ValueError(f"rungs must be exactly {list(LADDER_RUNGS)} in this order, got {list(got)}")
        got = tuple(r.id for r in self.escalation)
        if got != LADDER_ESCALATION:
            raise ValueError(f"escalation must be exactly {list(LADDER_ESCALATION)} in this order, got {list(got)}")
        return self


# --- lora-qlora-recipes / preference-optimization / grpo-rlvr-training / vision-sft ---


# --- quantized-export ---
