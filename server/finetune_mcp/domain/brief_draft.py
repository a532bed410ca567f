"""The draft_brief MCP prompt: a draft training brief for a one-line goal, a base model and a data file, the method
following from the data's shape (read with the same light pass prepare_dataset uses)."""

from __future__ import annotations

from finetune_mcp.common import convert as C
from finetune_mcp.common import records as R
from finetune_mcp.common.errors import NotFound
from finetune_mcp.common.proto import JobError
from finetune_mcp.context import PhaseContext
from finetune_mcp.domain.brief import example_brief, slugify
from finetune_mcp.domain.sources import LIGHT_PASS_MAX_BYTES

SKILL = "dataset-curation"


_SHAPE_METHOD = {
    "preference": "DPO", "implicit-prompt-preference": "DPO", "alpaca-preference": "DPO", "sharegpt-preference": "DPO",
    "messages-preference": "DPO", "openai-preference": "DPO", "paired-messages": "DPO",
    "kto": "KTO", "messages-label": "KTO", "sharegpt-kto": "KTO", "alpaca-kto": "KTO",
    "grpo": "GRPO", "prompt-only": "GRPO", "vision": "VLM-SFT",
}


def draft_brief(pc: PhaseContext, goal: str, base_model: str, data_file: str) -> str:
    """A prompt that hands the agent a draft brief for a one-line goal, a base model and a data file: the method
    follows from the data's shape (read with the same light pass prepare_dataset uses), the rest from the example
    brief, and every value the draft had to assume is marked ASK for the agent to confirm with the user."""
    real = pc.guard.check_read(data_file, "data_file")
    if not real.exists():
        raise NotFound(f"data file {data_file!r} not found", where=str(real), fix="pass an existing data file or folder")
    shape, rows, holes = "unknown", None, []
    try:
        kind, files, _ = R.source_files(real)
        if kind == "text" and sum(f.stat().st_size for f in files) <= LIGHT_PASS_MAX_BYTES:
            raw, _ = R.read_text_source(real)
            rows = len(raw.rows)
            shape = R.detect_shape(raw.rows, pc.skills.table(SKILL, "formats").reference_fields)
            holes = sorted({n for r in raw.rows[:2000] for _, names in C.find_placeholders(r) for n in names})
    except JobError:
        pass
    method = _SHAPE_METHOD.get(shape, "SFT-LoRA")
    slug = slugify(" ".join(goal.split()[:5])) or "task"
    lines = [f"# Training brief: {goal.strip()}", "", "## Task", f"{slug} — {goal.strip()}", "", "## Base Model", base_model.strip(), "",
             "## Chosen Method", method,
             f"<!-- from the data's shape ({shape}); ASK whether the user meant another method -->", "",
             "## Dataset Expectation", f"Records from {real.name}.", ""]
    if rows is not None:
        lines.append(f"examples: ~{rows}")
    lines += ["<!-- ASK: provenance: synthetic | curated | mixed (curated sets get collapse warnings, not a refusal) -->"]
    if holes:
        lines.append(f"<!-- ASK: the records hold {', '.join('{{' + h + '}}' for h in holes)}: add "
                     f"fill: {', '.join(h + '=...' for h in holes)} -->")
    lines += ["<!-- max_seq_length left out: prepare_dataset takes the recipe default and reports the data's p99 to state here -->", "",
              "## Memory Budget", "24 GB", "<!-- ASK: the memory of the machine that trains -->", "",
              "## Deployment Target", "transformers (lora)", "<!-- ASK: transformers, vllm, llama.cpp or ollama, and a format -->", "",
              "## Evaluation", "min_accuracy: 0.8", "<!-- ASK: the bar the tuned model must clear -->"]
    if method == "GRPO":
        lines += ["", "## Reward", "format" if shape == "prompt-only" else "exact_match, format"]
    draft = "\n".join(lines) + "\n"
    return (
        f"Draft a training brief for this goal: {goal.strip()}\n\nBase model: {base_model.strip()}. Data: {real} "
        f"({shape} shape" + (f", {rows} records" if rows is not None else "") + ").\n\n"
        "Below is a draft. Confirm every line marked ASK with the user, save it as training-brief.md, then call "
        f"prepare_dataset(brief_path=..., source={str(real)!r}). Every section and accepted value is in the example brief "
        "(resource brief://example), shown after the draft.\n\n"
        f"````markdown\n{draft}````\n\nThe example brief:\n\n````markdown\n{example_brief()}````\n"
    )


