"""What `finetune-mcp models list` shows of each local model: parameters, dtype, template family and the masking prepare would use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune_mcp.common import masking as M
from finetune_mcp.common.proto import run_main
from finetune_mcp.common.shapes import safetensors_param_count

# Markers that name a template family; the first that occurs wins (ChatML last: others reuse <|im_start|>).
FAMILIES = [("llama3", "<|start_header_id|>"), ("gemma", "<start_of_turn>"), ("phi3", "<|assistant|>\n"), ("zephyr", "<|assistant|>"),
            ("mistral", "[INST]"), ("phi4", "<|im_sep|>"), ("gpt-oss", "<|channel|>"), ("chatml", "<|im_start|>"),
            ("plain-text", "ASSISTANT"), ("plain-text", "### Response")]


def family(template: str | None) -> str | None:
    if not template:
        return None
    for name, marker in FAMILIES:
        if marker in template:
            return name
    return "other"


def inspect_one(path: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    folder = Path(path)
    cfg = json.loads((folder / "config.json").read_text())
    out: dict[str, Any] = {"model_type": cfg.get("model_type"), "dtype": cfg.get("dtype") or cfg.get("torch_dtype")}
    try:
        out["parameters"] = safetensors_param_count(folder)
    except Exception:
        out["parameters"] = None
    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        out.update(template_family=None, masking=None, error=f"tokenizer: {type(e).__name__}: {str(e)[:120]}")
        return out
    tpl = M.template_text(tok)
    out["template_family"] = family(tpl)
    if not tpl:
        out["masking"] = None
        out["masking_note"] = "no chat template: prompt/completion data only"
        return out
    try:
        from trl.chat_template_utils import get_training_chat_template

        trl_tpl = get_training_chat_template(tok)
    except Exception:
        trl_tpl = None
    choice = M.choose(tok, trl_tpl)
    out["masking"] = choice["plan"]["method"] if choice["plan"] else None
    out["masking_note"] = M.describe(choice)
    out["default_system_prompt"] = choice["default_system"]
    return out


def run(P: dict[str, Any]) -> dict[str, Any]:
    return {"models": [{**m, **inspect_one(m["path"])} for m in P["models"]]}


if __name__ == "__main__":
    run_main(run)
