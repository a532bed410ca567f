"""Base models from where users have them: `finetune-mcp models add-gguf / pull / list`, and how a brief names them."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import link_model, server_command
from finetune_mcp import models
from finetune_mcp.common.errors import BadInput, NotFound


def _cli(args: list[str], root: Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(server_command() + args, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "DGX_SPARK_ROOT": str(root), **(env or {})})


def _write_gguf(path: Path, arch: str, qtype=None) -> Path:
    """A real GGUF file written with llama.cpp's gguf-py (not a converted model: the refusals read only its header)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_name("probe")
    w.add_context_length(64)
    if qtype is None:
        w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    else:  # raw bytes of a type gguf-py cannot dequantize
        w.add_tensor("token_embd.weight", np.zeros((8, 40), dtype=np.uint8), raw_shape=(8, 40), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------- add-gguf


def test_add_gguf_writes_a_trainable_folder_with_provenance(smollm2_dir):
    """The fixture ran the real CLI; what it left is a transformers folder that loads, with its provenance."""
    prov = json.loads((smollm2_dir / "provenance.json").read_text())
    assert len(prov["source_sha256"]) == 64 and prov["source_file"].endswith(".gguf")
    assert prov["gguf"]["architecture"] == "llama" and prov["gguf"]["tensor_types"].get("Q4_1", 0) > 100
    assert prov["versions"]["transformers"] and prov["versions"]["gguf"] and prov["converted_at"]
    assert prov["check"]["max_logit_diff"] == 0.0 and prov["check"]["tokenizer_ids_equal"]
    assert prov["parameters"] == 134_515_008
    for f in ("config.json", "model.safetensors", "tokenizer.json", "PROVENANCE.md", "chat_template.jinja"):
        assert (smollm2_dir / f).is_file(), f
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    # The exact count from the safetensors headers equals the model's own count.
    from finetune_mcp.common.shapes import safetensors_param_count

    assert safetensors_param_count(smollm2_dir) == prov["parameters"]
    assert "im_start" in (smollm2_dir / "chat_template.jinja").read_text()


def test_add_gguf_refuses_an_architecture_by_name_and_leaves_nothing(tmp_path):
    root = tmp_path / "root"
    f = _write_gguf(tmp_path / "odd.gguf", "rwkv7")
    p = _cli(["models", "add-gguf", str(f), "--name", "odd"], root)
    assert p.returncode == 2
    assert "architecture 'rwkv7' cannot be converted" in p.stderr and "llama" in p.stderr and "models pull" in p.stderr
    assert not (root / "base-models").exists() or not any((root / "base-models").iterdir())


def test_add_gguf_refuses_a_quant_type_by_name(tmp_path):
    from gguf import GGMLQuantizationType

    root = tmp_path / "root"
    f = _write_gguf(tmp_path / "q81.gguf", "llama", GGMLQuantizationType.Q8_1)
    p = _cli(["models", "add-gguf", str(f)], root)
    assert p.returncode == 2
    assert "tensor type Q8_1" in p.stderr and "cannot be dequantized" in p.stderr
    assert not (root / "base-models").exists() or not any((root / "base-models").iterdir())


def test_add_gguf_refuses_to_overwrite_without_force(tmp_path, smollm2_dir):
    root = tmp_path / "root"
    (root / "base-models" / "taken").mkdir(parents=True)
    gguf = json.loads((smollm2_dir / "provenance.json").read_text())["source_file"]
    p = _cli(["models", "add-gguf", gguf, "--name", "taken"], root)
    assert p.returncode == 2 and "already exists" in p.stderr and "--force" in p.stderr
    assert not any((root / "base-models" / "taken").iterdir())


def test_default_name_comes_from_the_metadata():
    from finetune_mcp.jobs.convert_gguf import default_name

    assert default_name({"name": "Smollm2 135M 8k Lc100K Mix1 Ep2"}, Path("x.gguf")) == "Smollm2-135M-8k-Lc100K-Mix1-Ep2"
    assert default_name({"repository": "SmolLM2-135M-Instruct", "name": "whatever"}, Path("x.gguf")) == "SmolLM2-135M-Instruct"
    assert default_name({}, Path("/m/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf")) == "Qwen2.5-0.5B-Instruct"


# ---------------------------------------------------------------- list


def test_models_list_shows_size_template_and_masking(tmp_path, smollm2_dir, tiny_model_dir):
    root = tmp_path / "root"
    link_model(root, smollm2_dir)
    link_model(root, tiny_model_dir)
    p = _cli(["models", "list", "--json"], root, env={"HF_HOME": str(tmp_path / "hf")})
    assert p.returncode == 0, p.stderr
    rows = {r["name"]: r for r in json.loads(p.stdout)}
    smol, tiny = rows["SmolLM2-135M-Instruct"], rows["finetune-mcp-tiny"]
    assert smol["parameters"] == 134_515_008 and smol["template_family"] == "chatml" and smol["masking"] == "derived-spans"
    assert "SmolLM" in smol["default_system_prompt"]
    assert tiny["masking"] == "generation-markers" and tiny["parameters"] < 1_000_000


# ---------------------------------------------------------------- pull


def test_pull_refuses_while_offline_and_says_why(tmp_path):
    p = _cli(["models", "pull", "HuggingFaceTB/SmolLM2-135M-Instruct"], tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert p.returncode == 2 and "HF_HUB_OFFLINE is set" in p.stderr


def test_pull_without_a_hub_fails_clearly(tmp_path):
    """No hub here: an endpoint that refuses connections gives a clear error naming it, not a traceback."""
    env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2"}
    p = _cli(["models", "pull", "org/model"], tmp_path, env=env, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "127.0.0.1:9" in p.stderr


# ---------------------------------------------------------------- resolving a brief's Base Model


def test_missing_model_names_the_pull_command_and_the_offline_state(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(NotFound) as e:
        models.resolve_base_model("some-org/absent", tmp_path / "base-models", tmp_path / "hf")
    assert "finetune-mcp models pull some-org/absent" in str(e.value) and "HF_HUB_OFFLINE, which is set" in str(e.value)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(NotFound) as e:
        models.resolve_base_model("some-org/absent", tmp_path / "base-models", tmp_path / "hf")
    assert "HF_HUB_OFFLINE is not set" in str(e.value) and "add-gguf" in str(e.value)


def test_a_path_must_lie_in_a_data_dir(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    import shutil

    shutil.copytree(tiny_model_dir, data / "models" / "mine")
    ref = models.resolve_base_model(str(data / "models" / "mine"), tmp_path / "base-models", tmp_path / "hf", [data])
    assert ref.path == (data / "models" / "mine").resolve() and ref.exists
    with pytest.raises(BadInput, match="outside base-models/ and the server's data dirs"):
        models.resolve_base_model(str(data / "models" / "mine"), tmp_path / "base-models", tmp_path / "hf", [tmp_path / "other"])
    with pytest.raises(NotFound, match="no config.json"):
        models.resolve_base_model(str(data / "models"), tmp_path / "base-models", tmp_path / "hf", [data])


def test_hub_id_found_in_the_cache(tmp_path, tiny_model_dir):
    """A hub id resolves to its snapshot in the standard cache layout (what `models pull` leaves)."""
    import shutil

    snap = tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    shutil.copytree(tiny_model_dir, snap)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc123")
    ref = models.resolve_base_model("org/tiny", tmp_path / "base-models", tmp_path / "hf")
    assert ref.path == snap and ref.hf_id == "org/tiny"
