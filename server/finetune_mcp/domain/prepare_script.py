"""The experiment's data/prepare.py: a script that rebuilds the prepared dataset byte for byte from its source, with
the parameters prepare_dataset's job ran with (templates/prepare.py, filled by the same substitution as train.py)."""

from __future__ import annotations

import json

from finetune_mcp.domain.render import TEMPLATES, substitute


def render_prepare_py(name: str, params: dict, now: str) -> str:
    p = {k: v for k, v in params.items() if k not in ("out_dir",)}
    raw = (TEMPLATES / "prepare.py").read_text(encoding="utf-8")
    return substitute(raw, {"NAME_REPR": repr(name), "NAME": name, "NOW": now, "PARAMS_JSON": json.dumps(p, indent=2, ensure_ascii=False)}, "prepare.py")
