"""Finds the shipped roles/ and skills/ folders: inside an installed wheel, or at the top of a checkout."""

from __future__ import annotations

import os
from pathlib import Path

_PKG = Path(__file__).resolve().parent


def shipped_dir(name: str) -> Path:
    """roles/ or skills/: FINETUNE_MCP_<NAME>_DIR, else the wheel's _data/<name>, else the checkout's <name>/."""
    override = os.environ.get(f"FINETUNE_MCP_{name.upper()}_DIR")
    if override:
        return Path(override)
    for cand in (_PKG / "_data" / name, _PKG.parent.parent / name):
        if cand.is_dir():
            return cand
    raise FileNotFoundError(f"cannot find the shipped {name}/ folder next to {_PKG}")
