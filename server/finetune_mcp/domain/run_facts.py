"""What the gate and export read off a run: its folders, the adapter's digest, the brief and config it was launched
with, the base model under the adapter (name and identity), the prepared eval split, and its roadbook."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from finetune_mcp import roadbook
from finetune_mcp.common.errors import BadInput, NotFound, Refused
from finetune_mcp.context import PhaseContext
from finetune_mcp.digest import DIGEST_FILE, folder_digest, verify_folder
from finetune_mcp.domain.brief import load_brief
from finetune_mcp.workspace import parse_run_ref



def run_paths(pc: PhaseContext, run_id: str) -> tuple[str, Path, Path]:
    """(experiment, run dir, experiment dir) for '<experiment>/<run-id>'."""
    experiment, _ = parse_run_ref(run_id)
    r = pc.ws.run_dir(run_id)
    return experiment, r, pc.ws.experiments_dir / experiment


def adapter_digest(r: Path, run_id: str) -> str:
    """The digest of the run's adapter/, refusing when it is missing or does not match its DIGEST."""
    adapter = r / "adapter"
    if not (adapter / "adapter_config.json").is_file():
        raise Refused(
            f"run {run_id} has no adapter yet",
            where=str(adapter),
            fix="wait until poll_progress reports the run succeeded; train.py writes adapter/ with its DIGEST at the end",
        )
    ok, actual, recorded = verify_folder(adapter)
    if not ok:
        why = "has no DIGEST file" if recorded is None else f"does not match its DIGEST (recorded {recorded[:12]}…, now {actual[:12]}…)"
        raise Refused(
            f"adapter/ of run {run_id} {why}: its files changed after training wrote them",
            where=str(adapter / DIGEST_FILE),
            fix="do not edit adapter/; relaunch the run to produce a fresh adapter",
        )
    return actual


def load_run_brief(r: Path, e: Path):
    """The brief as launched (the run's copy), else the experiment's."""
    for p in (r / "training-brief.md", e / "training-brief.md"):
        if p.is_file():
            return load_brief(p)
    raise NotFound("no training-brief.md in the run or its experiment", where=str(r), fix="launch runs through launch_run, which copies the brief into the run")


def read_config(r: Path) -> dict[str, Any]:
    p = r / "config.yaml"
    if not p.is_file():
        return {}
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise BadInput(f"config.yaml of the run is not valid YAML: {e}", where=str(p)) from None
    return data if isinstance(data, dict) else {}


def base_model_of(pc: PhaseContext, r: Path, brief) -> str:
    """The base model the adapter was trained on: PEFT records it in adapter_config.json; the run config names it too."""
    cfg = json.loads((r / "adapter" / "adapter_config.json").read_text(encoding="utf-8"))
    name = cfg.get("base_model_name_or_path") or ""
    if name and Path(name).is_dir():
        return name
    model = read_config(r).get("model")
    if isinstance(model, dict) and isinstance(model.get("path"), str) and Path(model["path"]).is_dir():
        return model["path"]
    for cand in (name, brief.base_model if brief else ""):
        if cand and (pc.ws.base_models_dir / cand).is_dir():
            return str(pc.ws.base_models_dir / cand)
    if name:
        return name  # an HF id; the worker resolves it from the local cache only
    if brief:
        return brief.base_model
    raise NotFound("cannot tell which base model the adapter belongs to", where=str(r / "adapter" / "adapter_config.json"))


def prepared_eval_split(pc: PhaseContext, config: dict[str, Any]) -> Path | None:
    """The prepared eval split named by the run config (any value naming an eval .jsonl or a dataset folder)."""
    data = config.get("data")
    if isinstance(data, dict) and isinstance(data.get("dir"), str) and isinstance(data.get("eval"), str):
        p = Path(data["dir"]) / data["eval"]
        if p.is_file():
            return p
    found: list[Path] = []

    def walk(x: Any, key: str = "") -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, str(k))
        elif isinstance(x, list):
            for v in x:
                walk(v, key)
        elif isinstance(x, str) and x and len(x) < 4096:
            p = Path(x).expanduser()
            if not p.is_absolute():
                p = pc.ws.datasets_dir / x if key in ("dataset", "dataset_name", "name") else pc.ws.root / x
            if p.is_file() and p.name.endswith(".jsonl") and "eval" in p.name:
                found.append(p)
            elif p.is_dir() and (p / "eval.jsonl").is_file():
                found.append(p / "eval.jsonl")

    walk(config)
    return found[0] if found else None


def append_roadbook(pc: PhaseContext, r: Path, line: str) -> None:
    """One line per lifecycle event, under the run's lock; skipped quietly where the role may not write the roadbook."""
    roadbook.append(pc.guard, r, line)


def base_model_identity(pc: PhaseContext, r: Path, brief) -> dict[str, Any]:
    """What the adapter was evaluated on: the name, and for a local folder its path and digest (an HF cache
    snapshot's folder name is its revision). Signed into the result; export requires the same model under it."""
    name = base_model_of(pc, r, brief)
    out: dict[str, Any] = {"name": name}
    p = Path(name)
    if p.is_dir():
        real = p.resolve()
        out["path"] = str(real)
        out["sha256"] = folder_digest(real)
        if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
            out["revision"] = real.name
    return out


def base_words(b: Any) -> str:
    """A base model identity in words (name and digest), for messages and reports."""
    if not isinstance(b, dict):
        return "none recorded"
    return f"{b.get('name')}" + (f" sha256 {str(b['sha256'])[:12]}…" if b.get("sha256") else "")
