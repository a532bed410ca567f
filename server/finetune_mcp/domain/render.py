"""The files generate_config renders: train.py from the templates (method x backend), the masking.py beside it,
train.sh, and run-<tag>.yaml with each value's source inline.

train.py is standalone: the training stack, pyyaml and the standard library, plus, for the SFT family, masking.py
next to it: a verbatim copy of finetune_mcp/common/masking.py, so the trainer masks with the very code that
prepare_dataset checked. Both are committed with the config; launch_run and train.sh copy both into the run.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from finetune_mcp.common import masking
from finetune_mcp.common.errors import BadInput
from finetune_mcp.domain.recipes import BACKENDS, FAMILY, STACK

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
MASKING_FILE = "masking.py"


_DIRECTIVE = re.compile(r"^\s*#>>\s*(if|else|end)\b\s*(.*)$")
_COND = re.compile(r"^(\w+)\s*(==|!=)\s*\"([^\"]*)\"$")
_PLACEHOLDER = re.compile(r"\{\{([A-Z_]+)\}\}")


def _preprocess(text: str, env: dict[str, str], name: str) -> str:
    """Keep the lines whose `#>> if <var> == "<value>"` / `#>> else` / `#>> end` blocks hold for env."""
    out, stack = [], []  # stack of (this block's condition, currently active)
    for n, line in enumerate(text.splitlines(keepends=True), 1):
        m = _DIRECTIVE.match(line)
        if not m:
            if all(active for _, active in stack):
                out.append(line)
            continue
        kind, rest = m.groups()
        if kind == "if":
            c = _COND.match(rest.strip())
            if not c or c.group(1) not in env:
                raise ValueError(f"{name}:{n}: bad template condition {rest.strip()!r}")
            var, op, val = c.groups()
            holds = (env[var] == val) == (op == "==")
            stack.append((holds, holds))
        elif kind == "else":
            if not stack:
                raise ValueError(f"{name}:{n}: #>> else without #>> if")
            holds, _ = stack.pop()
            stack.append((holds, not holds))
        else:
            if not stack:
                raise ValueError(f"{name}:{n}: #>> end without #>> if")
            stack.pop()
    if stack:
        raise ValueError(f"{name}: {len(stack)} unclosed #>> if block(s)")
    return "".join(out)


def substitute(text: str, subs: dict[str, str], name: str) -> str:
    def repl(m):
        if m.group(1) not in subs:
            raise ValueError(f"{name}: unknown placeholder {{{{{m.group(1)}}}}}")
        return subs[m.group(1)]

    return _PLACEHOLDER.sub(repl, text)


def render_train_py(method: str, backend: str, experiment: str, recipe) -> str:
    """The standalone train.py for method x backend: head, model loading, common callbacks, the method family, main."""
    if backend not in BACKENDS:
        raise BadInput(f"unknown backend {backend!r}", where="backend", fix="auto, unsloth or trl")
    family = FAMILY[method]
    env = {"method": method, "backend": backend, "family": family}
    subs = {
        "METHOD": method, "BACKEND": backend, "LABEL": recipe.label, "EXPERIMENT": experiment, "STACK": STACK[backend],
        "TRAINER_MODULE": recipe.trainer.module, "TRAINER_CONFIG": recipe.trainer.config, "TRAINER_CLASS": recipe.trainer.trainer,
    }
    parts = ["head.py", f"model_{backend}.py", "common.py", f"{family}.py", "main.py"]
    text = ""
    for part in parts:
        raw = (TEMPLATES / "train" / part).read_text(encoding="utf-8")
        text += substitute(_preprocess(raw, env, part), subs, part)
    return text


def needs_masking(method: str) -> bool:
    """Whether method's train.py imports masking.py (the SFT family masks conversations itself)."""
    return FAMILY[method] == "sft"


def render_masking_py() -> str:
    """masking.py for beside train.py: common/masking.py byte for byte, the code prepare_dataset checked with."""
    return Path(masking.__file__).read_text(encoding="utf-8")


def render_train_sh(method: str, backend: str, experiment: str, tag: str, label: str) -> str:
    raw = (TEMPLATES / "train.sh").read_text(encoding="utf-8")
    return substitute(raw, {"EXPERIMENT": experiment, "TAG": tag, "LABEL": label, "BACKEND": backend}, "train.sh")


def _yaml_value(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True, width=10_000, allow_unicode=True).strip().removesuffix("\n...").strip()


def run_yaml(header: str, top: dict, hparams: dict, sources: dict, rest: dict) -> str:
    """run-<tag>.yaml: hparams annotated with their sources inline, the rest as plain YAML."""
    lines = [header.rstrip(), yaml.safe_dump(top, sort_keys=False, allow_unicode=True).rstrip(), "hparams:"]
    for k, v in hparams.items():
        lines.append(f"  {k}: {_yaml_value(v)}  # {sources[k]}")
    lines.append(yaml.safe_dump(rest, sort_keys=False, allow_unicode=True, width=120).rstrip())
    text = "\n".join(lines) + "\n"
    parsed = yaml.safe_load(text)
    assert parsed["hparams"] == hparams, "annotated hparams did not round-trip"  # the comments must not change a value
    return text
