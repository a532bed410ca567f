"""Where a dataset comes from and what it says about itself: a path or an HF id, the local HF caches, the card or
license beside it, its provenance, and the settings the brief decides for preparing it.

Stdlib (and yaml for a card's front matter) only: prepare_dataset and the draft_brief prompt read sources here
before any child starts; the worker job (jobs/prepare_data.py) loads the data itself.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from finetune_mcp.common import records as R
from finetune_mcp.common.errors import BadInput, Forbidden, NotFound
from finetune_mcp.context import PhaseContext
from finetune_mcp.domain.brief import Brief
from finetune_mcp.domain.recipes import effective_max_seq_length

SKILL = "dataset-curation"
# org/name, org/name:split, or org/name:config:split (org/name:config: for a config's default split).
_HF_ID = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(:[A-Za-z0-9_.-]*){0,2}\Z")
_HF_NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*\Z")
_DATA_EXTS = set(R.TEXT_EXTS) | set(R.ARROW_EXTS)
# Above this a source is validated once, in the worker, which reads it anyway: the server then neither
# spends the time twice nor holds a large set in memory.
LIGHT_PASS_MAX_BYTES = 4 << 20
_STRICTNESS = {"curated": 0, "mixed": 1, "synthetic": 2}


def light_pass_fits(path: Path) -> bool:
    """Whether the server reads the source itself: plain-text records up to LIGHT_PASS_MAX_BYTES (JobError if unreadable)."""
    kind, files, _ = R.source_files(path)
    return kind == "text" and sum(f.stat().st_size for f in files) <= LIGHT_PASS_MAX_BYTES


def hf_dataset_cached(hf_id: str) -> dict[str, Path]:
    """Where hf_id sits in the local caches: {"datasets": built cache dir, "snapshot": hub snapshot dir}. Stdlib only."""
    name = hf_id.split(":")[0]
    home = Path(os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface").expanduser()
    ds_cache = Path(os.environ.get("HF_DATASETS_CACHE") or home / "datasets").expanduser()
    hub = Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or home / "hub").expanduser()
    org, _, repo = name.partition("/")
    found: dict[str, Path] = {}
    built = ds_cache / f"{org}___{repo}"
    if built.is_dir() and any(built.iterdir()):
        found["datasets"] = built
    repo_dir = hub / f"datasets--{org}--{repo}"
    snaps = repo_dir / "snapshots"
    if snaps.is_dir():
        try:
            main = (repo_dir / "refs" / "main").read_text().strip()
        except OSError:
            main = ""
        cands = [d for d in snaps.iterdir() if d.is_dir() and any(d.iterdir())]
        pick = snaps / main if main and (snaps / main).is_dir() else (max(cands, key=lambda d: d.stat().st_mtime) if cands else None)
        if pick is not None:
            found["snapshot"] = pick
    return found


def resolve_source(pc: PhaseContext, source: Any) -> dict:
    """{"kind": "path", "path": real} or {"kind": "hf", "id": ..., "config": ..., "split": ...}."""
    if not isinstance(source, str) or not source.strip():
        raise BadInput("source is empty", where="source", fix="pass a data file or folder, a save_to_disk folder, or an HF dataset id")
    s = source.strip()
    hf = None
    if s.startswith(("hf://", "hf:")):
        hf = s.split(":", 1)[1].lstrip("/")
    else:
        try:
            real = pc.guard.check_read(s, "source")
        except Forbidden:
            if _HF_ID.fullmatch(s) and not Path(s).expanduser().exists():
                real = None
            else:
                raise
        if real is not None and real.exists():
            return {"kind": "path", "path": str(real), "given": source}
        if _HF_ID.fullmatch(s) and Path(s).suffix.lower() not in _DATA_EXTS:
            hf = s
        else:
            raise NotFound(f"source {source!r} not found", where=str(real) if real else source,
                           fix="pass an existing file or folder (relative paths are taken from DGX_SPARK_ROOT), or an HF dataset id org/name[:config]:split")
    return _hf_source(hf, source)


def _hf_source(hf: str, source: str) -> dict:
    parts = hf.split(":")
    hf_id = parts[0]
    config, split = (parts[1] or None, parts[2] or None) if len(parts) == 3 else (None, (parts[1] or None) if len(parts) == 2 else None)
    if not _HF_NAME.fullmatch(hf_id) or len(parts) > 3:
        raise BadInput(f"{hf!r} is not an HF dataset id", where="source", fix="write it as org/name, org/name:split or org/name:config:split")
    # Loaded in the worker by datasets.load_dataset: from the local cache, or from the hub when it can be reached.
    # The worker runs offline; it may fetch a missing dataset from the hub unless the user set offline mode here.
    offline = any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on") for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    out = {"kind": "hf", "id": hf_id, "config": config, "split": split, "hub": not offline, "given": source}
    cached = hf_dataset_cached(hf_id)
    if "snapshot" in cached:
        out["snapshot"] = str(cached["snapshot"])
    return out


def data_settings(pc: PhaseContext, brief: Brief, src: dict) -> dict:
    """What the brief (and the data's own card) decide about preparing the records, resolved once for the light
    pass, the worker job and the card: the sequence length, placeholders, the provenance, GRPO's reference column."""
    seq, seq_from, seq_cite = effective_max_seq_length(brief, pc.skills)
    needs_reference = True
    if brief.method == "grpo":
        rewards = pc.skills.table("grpo-rlvr-training", "rewards").rewards
        needs_reference = any(rewards[r].needs for r in brief.reward if r in rewards)
    return {"max_seq_length": seq, "max_seq_length_from": seq_from, "max_seq_length_cite": seq_cite,
            "fill": brief.fill, "keep_placeholders": brief.keep_placeholders, "needs_reference": needs_reference,
            "provenance": provenance_of(brief, src)}


def provenance_of(brief: Brief, src: dict) -> dict:
    """{"value", "from", "conflict"}: the brief's provenance line and the data's own card; on disagreement the stricter."""
    said = [(brief.provenance, "the brief's ## Dataset Expectation")] if brief.provenance else []
    d, where = _card_provenance(src)
    if d:
        said.append((d, where))
    if not said:
        return {"value": None, "from": None, "conflict": None}
    value, frm = max(said, key=lambda x: _STRICTNESS[x[0]])
    conflict = None
    if len({v for v, _ in said}) > 1:
        conflict = " and ".join(f"{w} says {v}" for v, w in said) + f": the stricter, {value}, applies"
    return {"value": value, "from": frm, "conflict": conflict}


def _card_cands(src: dict) -> list[Path]:
    """Files beside the source that may carry its card or license: README.md, LICENSE and the like."""
    if src["kind"] == "hf":
        cached = hf_dataset_cached(src["id"])
        return [p for d in cached.values() for p in sorted(d.rglob("README.md"))[:3]]
    p = Path(src["path"])
    base = p if p.is_dir() else p.parent
    return [base / n for n in ("README.md", "LICENSE", "LICENSE.md", "LICENSE.txt", "DATASET_LICENSE")]


def _card_provenance(src: dict) -> tuple[str | None, str | None]:
    """A dataset card's own word on provenance: a `provenance:` key in its YAML front matter, or a `synthetic` tag
    (the tag the HF hub gives generated sets)."""
    for c in _card_cands(src):
        if c.name != "README.md":
            continue
        try:
            text = c.read_text(encoding="utf-8", errors="replace")[:20000]
        except OSError:
            continue
        m = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", text, re.S)
        if not m:
            continue
        try:
            meta = yaml.safe_load(m.group(1)) or {}
        except yaml.YAMLError:
            continue
        if not isinstance(meta, dict):
            continue
        value = str(meta.get("provenance") or "").strip().lower()
        if value in _STRICTNESS:
            return value, f"the dataset card {c}"
        tags = meta.get("tags") or []
        if isinstance(tags, list) and "synthetic" in [str(t).strip().lower() for t in tags]:
            return "synthetic", f"the dataset card {c} (tag synthetic)"
    return None, None


def license_of(src: dict) -> tuple[str | None, str | None]:
    """The license named by a dataset card or LICENSE file beside the source, if any."""
    for c in _card_cands(src):
        try:
            text = c.read_text(encoding="utf-8", errors="replace")[:20000]
        except OSError:
            continue
        m = re.search(r"^license:\s*(.+)$", text, re.M | re.I)
        if m:
            return m.group(1).strip().strip("'\""), c.name
        if c.name.upper().startswith("LICENSE") or c.name == "DATASET_LICENSE":
            first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
            return (first[:80] or "see file"), c.name
    return None, None
