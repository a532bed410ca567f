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


# --- lora-qlora-recipes / preference-optimization / grpo-rlvr-training / vision-sft ---


# --- quantized-export ---
