"""Resolves a brief's base model name: the embedded model, a folder under base-models/, a path in a data dir, or an HF id in the local cache.

Stdlib only. Nothing here downloads: `finetune-mcp models pull` (a job in the training Python) puts hub
models into the standard HF cache, and `models add-gguf` turns a local GGUF into a base-models/ folder.
The cache is read by its directory layout so that the server never imports huggingface_hub.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from finetune_mcp.common.errors import BadInput, NotFound


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    job: str  # the worker job that builds it
    description: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "finetune-mcp-tiny": EmbeddedModel(
        name="finetune-mcp-tiny",
        job="build_tiny_model",
        description="a 0.2M-parameter Llama with a 640-token byte-level BPE and a ChatML template, "
        "built locally from a seed; it learns the repeat-words task in well under a minute on a CPU",
    ),
}

# Written by jobs/build_tiny_model.py next to the weights; a folder without it is not a finished build.
BUILD_STAMP = "finetune-mcp-build.json"

_HF_ID_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?\Z")


@dataclass(frozen=True)
class ModelRef:
    """Where a base model lives. path is what from_pretrained should be given when it exists."""

    name: str
    path: Path | None
    hf_id: str | None
    embedded: bool
    exists: bool

    @property
    def load_path(self) -> str:
        """The argument for from_pretrained: the local folder, else the HF id."""
        return str(self.path) if self.path is not None else str(self.hf_id)


def hf_hub_cache(hf_home: Path | None = None) -> Path:
    """The hub cache folder, as huggingface_hub computes it: HF_HUB_CACHE, else $HF_HOME/hub."""
    if hf_home is not None:
        return Path(hf_home).expanduser() / "hub"
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def find_in_hf_cache(hf_id: str, hf_home: Path | None = None) -> Path | None:
    """The snapshot folder of hf_id in the local cache (one with a config.json), or None.

    Layout: hub/models--<org>--<name>/snapshots/<revision>/, with refs/main naming the revision
    the hub's main branch had at download time; that one wins, else the newest snapshot.
    """
    repo = hf_hub_cache(hf_home) / ("models--" + hf_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    try:
        main = (repo / "refs" / "main").read_text().strip()
    except OSError:
        main = ""
    if main and (snapshots / main / "config.json").is_file():
        return snapshots / main
    candidates = [d for d in snapshots.iterdir() if (d / "config.json").is_file()]
    if not candidates:
        return None
    return max(candidates, key=lambda d: ((d / "config.json").stat().st_mtime, d.name))


def embedded_is_built(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / BUILD_STAMP).is_file()


def resolve_base_model(name: str, base_models_dir: Path, hf_home: Path | None = None, data_dirs: list[Path] | None = None) -> ModelRef:
    """Resolve the brief's "## Base Model" value.

    Order: an embedded model (exists=False until its job has built it), a folder under
    base_models_dir, an absolute path inside one of data_dirs (the server's --data-dir folders), then
    an HF id looked up in the local cache only. Raises NotFound when a model is in none of those
    places (the error names `finetune-mcp models pull` and whether HF_HUB_OFFLINE is set), BadInput
    when the name cannot be a model name at all or a path lies outside the data dirs.
    """
    raw = name
    name = (name or "").strip().strip("`").strip()
    if not name:
        raise BadInput("the base model name is empty", where="brief ## Base Model",
                       fix="write 'finetune-mcp-tiny', a folder name under base-models/, or an HF id such as 'Qwen/Qwen2.5-0.5B-Instruct'")
    base_models_dir = Path(base_models_dir).expanduser()
    if name.startswith(("/", "~")):
        return _resolve_path(name, base_models_dir, data_dirs or [])

    embedded = EMBEDDED_MODELS.get(name.lower())
    if embedded is not None:
        path = base_models_dir / embedded.name
        return ModelRef(name=embedded.name, path=path, hf_id=None, embedded=True, exists=embedded_is_built(path))

    if not _HF_ID_RE.fullmatch(name) or ".." in name:
        raise BadInput(
            f"base model {raw!r} is neither an embedded model, a folder name under {base_models_dir}, nor an HF id",
            where="brief ## Base Model",
            fix="use 'finetune-mcp-tiny', the name of a folder in base-models/, or an HF id of the form org/name",
        )

    if "/" not in name:
        local = base_models_dir / name
        if (local / "config.json").is_file():
            return ModelRef(name=name, path=local, hf_id=None, embedded=False, exists=True)

    snapshot = find_in_hf_cache(name, hf_home)
    if snapshot is not None:
        return ModelRef(name=name, path=snapshot, hf_id=name, embedded=False, exists=True)

    cache = hf_hub_cache(hf_home)
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    raise NotFound(
        f"base model {name!r} is not in the local HF cache ({cache}) nor under {base_models_dir}; "
        "the server never downloads during a tool call",
        where="brief ## Base Model",
        fix=(
            f"run `finetune-mcp models pull {name}` (downloads into {cache}, resumable)"
            + (" after unsetting HF_HUB_OFFLINE, which is set here" if offline else "; HF_HUB_OFFLINE is not set")
            + f"; or `finetune-mcp models add-gguf FILE.gguf --name {name.rsplit('/', 1)[-1]}` for a local GGUF; "
            "`finetune-mcp models list` shows what is usable"
        ),
    )


def _resolve_path(name: str, base_models_dir: Path, data_dirs: list[Path]) -> ModelRef:
    """An absolute path: a model folder (config.json) that must lie inside base-models/ or a data dir."""
    p = Path(name).expanduser()
    try:
        real = p.resolve(strict=False)
    except OSError:
        real = p
    roots = [Path(d).expanduser().resolve() for d in [base_models_dir, *data_dirs]]
    if not any(real == r or real.is_relative_to(r) for r in roots):
        raise BadInput(f"base model path {name!r} is outside base-models/ and the server's data dirs",
                       where="brief ## Base Model",
                       fix="start the server with --data-dir on the folder that holds the model (or FINETUNE_MCP_DATA_DIRS), "
                           "or put the model under base-models/")
    if not (real / "config.json").is_file():
        raise NotFound(f"no model folder at {name!r} (no config.json)", where="brief ## Base Model",
                       fix="name a folder written by save_pretrained (config.json, *.safetensors, tokenizer files)")
    return ModelRef(name=real.name, path=real, hf_id=None, embedded=False, exists=True)


def list_local_models(base_models_dir: Path, hf_home: Path | None = None, data_dirs: list[Path] | None = None) -> list[dict]:
    """Every usable model folder: base-models/*, HF cache snapshots, and model folders at the top of data dirs."""
    out = []
    base_models_dir = Path(base_models_dir).expanduser()
    if base_models_dir.is_dir():
        for d in sorted(base_models_dir.iterdir()):
            if not d.name.startswith(".") and (d / "config.json").is_file():
                out.append({"name": d.name, "where": "base-models", "path": str(d)})
    hub = hf_hub_cache(hf_home)
    if hub.is_dir():
        for repo in sorted(hub.glob("models--*")):
            hf_id = repo.name[len("models--"):].replace("--", "/", 1)
            snap = find_in_hf_cache(hf_id, hf_home)
            if snap is not None:
                out.append({"name": hf_id, "where": "hf-cache", "path": str(snap)})
    for dd in data_dirs or []:
        dd = Path(dd).expanduser()
        for d in sorted([dd, *dd.iterdir()] if dd.is_dir() else []):
            if d.is_dir() and (d / "config.json").is_file():
                out.append({"name": str(d), "where": "data-dir", "path": str(d)})
    return out
