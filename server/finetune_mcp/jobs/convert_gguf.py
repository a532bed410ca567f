"""Turns a local GGUF file into a trainable transformers folder (dequantized safetensors, tokenizer, chat template, PROVENANCE).

Run as a worker job (params {"gguf", "target_dir", "dtype", "force", "inspect_only"}). transformers
reads GGUF itself (`from_pretrained(dir, gguf_file=...)`, which needs the `gguf` package) and
dequantizes every tensor, but the config it builds keeps a GGUF `quantization_config` that
`save_pretrained` refuses. So the model is rebuilt from that config without it, the dequantized state
dict is loaded into it, and that is saved. Before anything is loaded, the file's architecture and
tensor types are checked, so an unconvertible file is refused by name without a long load. The result
is written to a temporary sibling folder, checked (the saved folder's logits must equal the GGUF
model's on a probe), and renamed into place: a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from finetune_mcp.common.proto import JobError, emit_progress, run_main

PROVENANCE_JSON = "provenance.json"
PROVENANCE_MD = "PROVENANCE.md"
STEPS = 6


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_name(meta: dict[str, Any], path: Path) -> str:
    """A folder name from the GGUF's general.name (else the file name), safe for base-models/."""
    raw = meta.get("repository") or meta.get("name") or path.stem
    # "SmolLM2 135M Instruct" -> "SmolLM2-135M-Instruct"; a quant suffix in a file stem is dropped.
    raw = re.sub(r"[.\-_](Q\d\w*|IQ\d\w*|F16|F32|BF16)$", "", str(raw), flags=re.I)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", raw).strip("-.")
    return name or "gguf-model"


def read_metadata(path: Path) -> dict[str, Any]:
    """Architecture, name, tensor types and template presence: metadata only, no tensor is dequantized."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:
        raise JobError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}", kind="BadInput", where=str(path),
                       fix="give a .gguf file written by llama.cpp's converter or quantizer") from None

    def field(key: str):
        f = reader.fields.get(key)
        if f is None or not f.data:
            return None
        part = f.parts[f.data[0]]
        try:
            return bytes(part).decode("utf-8") if part.dtype.kind == "u" and part.dtype.itemsize == 1 else part.tolist()[0]
        except Exception:
            return None

    types: dict[str, int] = {}
    smallest: dict[str, Any] = {}
    for t in reader.tensors:
        name = t.tensor_type.name
        types[name] = types.get(name, 0) + 1
        if name not in smallest or t.n_elements < smallest[name].n_elements:
            smallest[name] = t
    arch = field("general.architecture")
    return {
        "architecture": arch,
        "name": field("general.name"),
        # Where llama.cpp's converter recorded the hub repo it converted (newer files only).
        "repository": (field("general.source.huggingface.repository") or "").rsplit("/", 1)[-1] or None,
        "size_label": field("general.size_label"),
        "tensor_types": types,
        "n_tensors": len(reader.tensors),
        "has_chat_template": "tokenizer.chat_template" in reader.fields,
        "context_length": field(f"{arch}.context_length") if arch else None,
        "_smallest": smallest,
    }


def check_convertible(meta: dict[str, Any], path: Path) -> None:
    """Refuse, by name, an architecture transformers cannot map or a tensor type gguf cannot dequantize."""
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    arch = meta["architecture"]
    supported = sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
    # llama.cpp writes "qwen2moe"/"qwen3moe"/"gpt-oss"; transformers maps those spellings itself.
    spelled = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}.get(arch, arch)
    if arch is None or spelled not in GGUF_SUPPORTED_ARCHITECTURES:
        raise JobError(
            f"{path.name}: architecture {arch!r} cannot be converted: transformers reads GGUF for {', '.join(supported)} only",
            kind="Refused", where=f"{path}: general.architecture",
            fix="download the model's original safetensors from the hub (`finetune-mcp models pull ORG/NAME`) instead",
        )
    for tname, tensor in meta["_smallest"].items():
        try:
            dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise JobError(
                f"{path.name}: tensor type {tname} ({meta['tensor_types'][tname]} tensors) cannot be dequantized by gguf "
                f"{_version('gguf')}", kind="Refused", where=f"{path}: {tensor.name}",
                fix="convert a GGUF with another quant type (Q8_0, Q4_K_M, F16 ...), or pull the original weights",
            ) from None


def _version(pkg: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def public_meta(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if not k.startswith("_")}


def load_rebuilt(src: Path, meta: dict[str, Any], dtype):
    """The GGUF's tokenizer and model as transformers loads them, and the same weights in a model rebuilt from the
    config without the GGUF quantization config (what save_pretrained then writes as plain safetensors), and that config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    emit_progress(2, STEPS, f"loading and dequantizing {sum(meta['tensor_types'].values())} tensors")
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=dtype)
    cfg = loaded.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    config = AutoConfig.for_model(**cfg)
    config.torch_dtype = dtype  # what save_pretrained records, so from_pretrained loads it back the same
    emit_progress(3, STEPS, "rebuilding the model without the GGUF quantization config")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    # Tied embeddings show up as a "missing" lm_head; anything else means the mapping lost a tensor.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise JobError(f"{src.name}: the dequantized tensors do not fit the {config.model_type} model "
                       f"(missing {missing[:5]}, unexpected {unexpected[:5]})", kind="Refused", where=str(src))
    model.tie_weights()
    model.generation_config = loaded.generation_config
    return tok, loaded, model, config


def _place(tmp: Path, target: Path) -> None:
    """Put the written folder at target; a folder already there (--force) is replaced whole."""
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)


def convert(P: dict[str, Any]) -> dict[str, Any]:
    import torch

    src = Path(P["gguf"]).expanduser().resolve()
    if not src.is_file():
        raise JobError(f"no GGUF file at {src}", kind="NotFound", where=str(src), fix="give the path of a .gguf file")
    emit_progress(0, STEPS, "reading metadata")
    meta = read_metadata(src)
    check_convertible(meta, src)
    if P.get("inspect_only"):
        return {"gguf": str(src), "metadata": public_meta(meta), "default_name": default_name(meta, src)}
    target = Path(P["target_dir"]) if P.get("target_dir") else Path(P["base_models_dir"]) / (P.get("name") or default_name(meta, src))
    target = target.expanduser()
    if target.exists() and not P.get("force"):
        raise JobError(f"{target} already exists", kind="Conflict", where=str(target),
                       fix="pick another --name, or pass --force to replace it")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[P.get("dtype") or "float32"]

    emit_progress(1, STEPS, "hashing the source file")
    digest = sha256_file(src)
    tok, loaded, model, config = load_rebuilt(src, meta, dtype)

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.convert-", dir=target.parent))
    try:
        emit_progress(4, STEPS, "writing safetensors and the tokenizer")
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        emit_progress(5, STEPS, "checking the written folder against the GGUF model")
        check = _check_roundtrip(loaded, tok, tmp, dtype)
        n_params = sum(p.numel() for p in model.parameters())
        prov = {
            "source_file": str(src),
            "source_sha256": digest,
            "source_bytes": src.stat().st_size,
            "gguf": public_meta(meta),
            "converted_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "dtype": str(dtype).removeprefix("torch."),
            "parameters": n_params,
            "model_type": config.model_type,
            "chat_template": bool(tok.chat_template),
            "check": check,
            "versions": {p: _version(p) for p in ("torch", "transformers", "gguf", "tokenizers", "finetune-mcp")},
            "how": "transformers from_pretrained(gguf_file=...) dequantized every tensor; the model was rebuilt from its "
                   "config without the GGUF quantization_config and saved with save_pretrained",
        }
        (tmp / PROVENANCE_JSON).write_text(json.dumps(prov, indent=2) + "\n")
        (tmp / PROVENANCE_MD).write_text(_provenance_md(prov))
        _usual_modes(tmp)
        _place(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    emit_progress(6, STEPS, "done")
    return {"target_dir": str(target), "name": target.name, "parameters": n_params, "dtype": prov["dtype"],
            "model_type": config.model_type, "chat_template": prov["chat_template"], "source_sha256": digest,
            "metadata": public_meta(meta), "check": check}


def _usual_modes(folder: Path) -> None:
    """mkdtemp makes a 0700 folder (and safetensors may write 0600): give the result the umask's usual modes."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(folder, 0o777 & ~mask)
    for p in folder.rglob("*"):
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def _check_roundtrip(loaded, tok, folder: Path, dtype) -> dict[str, Any]:
    """The saved folder must load back to the same logits and the same tokens as the GGUF model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    probe = "The capital of France is Paris. 1 + 1 = 2, and def f(x): return x"
    back_tok = AutoTokenizer.from_pretrained(str(folder))
    ids_a = tok(probe)["input_ids"]
    ids_b = back_tok(probe)["input_ids"]
    if ids_a != ids_b:
        raise JobError("the saved tokenizer gives other token ids than the GGUF's", kind="JobFailed", where=str(folder))
    back = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    x = torch.tensor([ids_a])
    with torch.no_grad():
        a, b = loaded(x).logits, back(x).logits
    diff = float((a - b).abs().max())
    if diff > 0:
        raise JobError(f"the saved model's logits differ from the GGUF model's by {diff:g}", kind="JobFailed", where=str(folder))
    return {"probe_tokens": len(ids_a), "max_logit_diff": diff, "tokenizer_ids_equal": True}


def _provenance_md(p: dict[str, Any]) -> str:
    g = p["gguf"]
    types = ", ".join(f"{k}×{v}" for k, v in sorted(g["tensor_types"].items()))
    return (
        f"# Provenance\n\n"
        f"Converted from a GGUF file by `finetune-mcp models add-gguf` on {p['converted_at']}.\n\n"
        f"| | |\n|---|---|\n"
        f"| source file | `{p['source_file']}` ({p['source_bytes']} bytes) |\n"
        f"| source sha256 | `{p['source_sha256']}` |\n"
        f"| GGUF name / architecture | {g.get('name')} / {g.get('architecture')} |\n"
        f"| GGUF tensor types | {types} |\n"
        f"| written as | {p['model_type']}, {p['parameters']:,} parameters, {p['dtype']} safetensors |\n"
        f"| chat template | {'kept from the GGUF' if p['chat_template'] else 'none in the GGUF'} |\n"
        f"| round-trip check | logits equal (max diff {p['check']['max_logit_diff']}), token ids equal |\n"
        f"| versions | {', '.join(f'{k} {v}' for k, v in p['versions'].items())} |\n\n"
        "The weights are the GGUF's dequantized values: a quantized GGUF gives a model with the quantization's\n"
        "error baked in, not the original full-precision checkpoint.\n"
    )


def _job(params: dict[str, Any]) -> dict[str, Any]:
    return convert(params)


if __name__ == "__main__":
    run_main(_job)
