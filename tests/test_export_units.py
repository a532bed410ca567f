"""Export's choices without a model: the Format Map applied to briefs, and where llama.cpp's converter is found."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from finetune_mcp.context import PhaseContext
from finetune_mcp.common import task
from finetune_mcp.common.errors import BadInput, Refused
from finetune_mcp.domain.brief import parse_brief
from finetune_mcp.phases.export import choose, converter_path


def brief_with(target: str):
    text = task.sample_brief("sft-lora").replace("transformers (merged-16bit)", target)
    return parse_brief(text, "training-brief.md")


@pytest.mark.parametrize("target, fmt, rt, want", [
    ("transformers (merged-16bit)", None, None, ("transformers", "merged-16bit")),
    ("llama.cpp gguf-q4_k_m", None, None, ("llama.cpp", "gguf-q4_k_m")),
    ("llama.cpp", None, None, ("llama.cpp", "gguf-q8_0")),          # the runtime's default
    ("ollama", None, None, ("ollama", "gguf-q4_k_m")),
    ("vllm", None, None, ("vllm", "merged-16bit")),
    ("transformers (lora adapter)", None, None, ("transformers", "lora")),
    ("transformers (merged-16bit)", "gguf-q8_0", None, ("llama.cpp", "gguf-q8_0")),   # a GGUF ask moves the runtime
    ("ollama", "gguf-f16", None, ("ollama", "gguf-f16")),
    ("ollama", None, "transformers", ("transformers", "merged-16bit")),  # the brief's format is for another runtime
])
def test_format_map_choice(ws_root, target, fmt, rt, want):
    pc = PhaseContext.for_role("training-engineer")
    runtime, form, why = choose(pc, brief_with(target), fmt, rt)
    assert (runtime.id, form.id) == want
    assert why and all(isinstance(w, str) for w in why)


def test_format_map_refusals(ws_root):
    pc = PhaseContext.for_role("training-engineer")
    with pytest.raises(BadInput, match="transformers does not load gguf-q4_k_m"):
        choose(pc, brief_with("transformers"), "gguf-q4_k_m", "transformers")
    # a brief asking for a format export does not make (merged-4bit) is named as the brief's problem
    with pytest.raises(BadInput, match="deployment format 'merged-4bit'"):
        choose(pc, brief_with("transformers (merged-4bit)"), None, None)


def _sdist(path: Path, version: str, with_converter: bool = True) -> Path:
    top = f"llama_cpp_python-{version}/vendor/llama.cpp"
    files = {f"{top}/gguf-py/gguf/__init__.py": b"", f"{top}/conversion/__init__.py": b"", f"{top}/README.md": b"x",
             f"{top}/ggml/src/ggml.c": b"int x;"}
    if with_converter:
        files[f"{top}/convert_hf_to_gguf.py"] = b"print('converter')\n"
    out = path / f"llama_cpp_python-{version}.tar.gz"
    with tarfile.open(out, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return out


def test_converter_lookup_order(ws_root, tmp_path, monkeypatch):
    pc = PhaseContext.for_role("training-engineer")
    monkeypatch.delenv("FINETUNE_MCP_LLAMA_CPP_CONVERTER", raising=False)
    monkeypatch.delenv("FINETUNE_MCP_LLAMA_CPP_SDIST", raising=False)
    with pytest.raises(Refused, match="converter .* was not found") as e:
        converter_path(pc)
    assert "pip download --no-deps --no-binary :all: llama-cpp-python" in e.value.fix

    # an sdist in $DGX_SPARK_ROOT/tools is unpacked once: the converter, gguf-py/ and conversion/ only
    tools = ws_root / "tools"
    tools.mkdir()
    _sdist(tools, "0.3.1")
    _sdist(tools, "0.3.20")
    conv = converter_path(pc)
    assert conv.read_text() == "print('converter')\n"
    assert conv.parent.name == "llama_cpp_python-0.3.20"  # the newest, unless one matches the installed version
    assert (conv.parent / "gguf-py" / "gguf" / "__init__.py").is_file() and (conv.parent / "conversion").is_dir()
    assert not (conv.parent / "ggml").exists() and not (conv.parent / "README.md").exists()
    assert converter_path(pc) == conv

    # FINETUNE_MCP_LLAMA_CPP_SDIST wins over tools/, and an sdist without the converter is refused
    elsewhere = tmp_path / "sdists"
    elsewhere.mkdir()
    _sdist(elsewhere, "0.2.0", with_converter=False)
    monkeypatch.setenv("FINETUNE_MCP_LLAMA_CPP_SDIST", str(elsewhere))
    with pytest.raises(Refused, match="holds no vendor/llama.cpp/convert_hf_to_gguf.py"):
        converter_path(pc)

    # FINETUNE_MCP_LLAMA_CPP_CONVERTER wins over both, and must name a file
    monkeypatch.setenv("FINETUNE_MCP_LLAMA_CPP_CONVERTER", str(tmp_path / "missing.py"))
    with pytest.raises(BadInput, match="not a file"):
        converter_path(pc)
    (tmp_path / "convert_hf_to_gguf.py").write_text("#")
    monkeypatch.setenv("FINETUNE_MCP_LLAMA_CPP_CONVERTER", str(tmp_path / "convert_hf_to_gguf.py"))
    assert converter_path(pc) == tmp_path / "convert_hf_to_gguf.py"


def test_sdist_with_hostile_paths_is_not_unpacked_outside(ws_root, monkeypatch):
    pc = PhaseContext.for_role("training-engineer")
    monkeypatch.delenv("FINETUNE_MCP_LLAMA_CPP_CONVERTER", raising=False)
    monkeypatch.delenv("FINETUNE_MCP_LLAMA_CPP_SDIST", raising=False)
    tools = ws_root / "tools"
    tools.mkdir()
    out = tools / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(out, "w:gz") as tf:
        for name, data in {"x/vendor/llama.cpp/convert_hf_to_gguf.py": b"#",
                           "x/vendor/llama.cpp/conversion/../../../../../escaped.py": b"#"}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("x/vendor/llama.cpp/gguf-py/evil")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc"
        tf.addfile(link)
    with pytest.raises(Refused, match="cannot unpack"):
        converter_path(pc)
    assert not list(tools.glob("llama-cpp-converter/*")), "nothing partial left"
    assert not list(ws_root.parent.rglob("escaped.py"))
    assert not any(p.is_symlink() for p in tools.rglob("*"))


def test_format_map_names_one_smoke_criterion_per_format():
    """Identity only where the runtime computes what evaluation computed; 16-bit downcasts by the near-tie margin;
    quantized GGUF by a similarity floor. A row naming two criteria, or none, is refused."""
    from pydantic import ValidationError

    from finetune_mcp.skills import load_skills
    from finetune_mcp.skilltables import ExportFormat

    fm = load_skills().table("quantized-export", "format-map")
    crit = {f.id: ("identical" if f.lossless else ("margin", f.max_tie_margin) if f.max_tie_margin is not None else ("similarity", f.min_similarity))
            for f in fm.formats}
    assert crit == {"lora": "identical", "merged-16bit": ("margin", 0.5), "gguf-f16": ("margin", 0.5),
                    "gguf-q8_0": ("similarity", 0.9), "gguf-q4_k_m": ("similarity", 0.7)}
    row = {"id": "merged-16bit", "posture": "merged", "container": "safetensors", "trade_off": "t", "cite": "format-merged-16bit"}
    for bad in ({"lossless": True, "max_tie_margin": 0.5}, {"lossless": False}, {"lossless": False, "max_tie_margin": 0.5, "min_similarity": 0.9}):
        with pytest.raises(ValidationError, match="exactly one smoke criterion"):
            ExportFormat(**row, **bad)
    assert ExportFormat(**row, lossless=False, max_tie_margin=0.5).max_tie_margin == 0.5
