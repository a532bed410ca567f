"""export through the MCP client (training role): the verdict gate against forged, copied, stale and
rejecting verdicts, the Format Map choice, and real exports with their smoke tests — merged 16-bit in
transformers, GGUF in llama.cpp (marker llamacpp), vLLM reported as unable to run without a GPU.

The workspace is test_gate's world (conftest.build_world): runs A and B promoted by the eval role's server, U rejected.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import anyio
import pytest

from conftest import EXP, RUN_A, RUN_B, RUN_U, build_world, clone_run, gate_call, mcp_session, refused
from finetune_mcp import signing
from finetune_mcp.digest import folder_digest
from finetune_mcp.common import task


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    return build_world(tmp_path_factory, tiny_model_dir)


def export_args(run_id: str, fmt: str | None = None, rt: str | None = None) -> dict:
    args = {"run_id": run_id}
    if fmt:
        args["format"] = fmt
    if rt:
        args["target_runtime"] = rt
    return args


def _report(ws, run_id: str) -> str:
    return ws.verdict_path(EXP, run_id).read_text()


def _tree(d: Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_mtime_ns for p in d.rglob("*") if p.is_file()}


def _plant_verdict(ws, run_id: str, text: str) -> None:
    """What a shell can do in single-user mode: write a file at the run's verdict place."""
    p = ws.verdict_path(EXP, run_id)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


# ---------------------------------------------------------------- the verdict gate


def test_export_refuses_every_verdict_but_a_valid_promote(world, monkeypatch):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    world.use(monkeypatch)
    ws = world.ws
    valid = _report(ws, RUN_A)

    # 1. hand-written PROMOTE: the machine block copied from a real one, run id and digest fitted to
    #    the new run, signature left as it was (a careful forger's best without the key)
    hand = f"{EXP}/20260102-0800-hand"
    r = clone_run(ws, RUN_A, hand)
    block = json.loads(valid.split("```json\n", 1)[1].split("\n```", 1)[0])
    block["run_id"] = hand
    _plant_verdict(ws, hand, valid.split(signing.MARKER)[0] + signing.render_block(block))
    # ... and one with no block at all
    bare = f"{EXP}/20260102-0805-bare"
    clone_run(ws, RUN_A, bare)
    _plant_verdict(ws, bare, "# Promotion report\n\n**Verdict: PROMOTE**\n\nLooks great.\n")
    # ... and one properly signed, with a key of the forger's own
    own = f"{EXP}/20260102-0810-ownkey"
    r_own = clone_run(ws, RUN_A, own)
    forged = signing.sign_block(Ed25519PrivateKey.generate(), {k: v for k, v in block.items() if k not in ("signature", "key_id", "schema")} | {"run_id": own})
    _plant_verdict(ws, own, signing.render_block(forged))

    # 2. copied from another run: a genuine PROMOTE of A, in a run directory of the same adapter bytes
    copied = f"{EXP}/20260102-0815-copied"
    clone_run(ws, RUN_A, copied)
    _plant_verdict(ws, copied, valid)
    assert folder_digest(world.run_dir(copied) / "adapter") == folder_digest(world.run_dir(RUN_A) / "adapter")

    # 3. adapter changed after the verdict (B is promoted; its adapter is then retouched, DIGEST refreshed to match)
    rb = world.run_dir(RUN_B)
    cfg = rb / "adapter" / "adapter_config.json"
    data = json.loads(cfg.read_text())
    data["lora_alpha"] = data["lora_alpha"] * 2
    cfg.write_text(json.dumps(data, indent=2))
    (rb / "adapter" / "DIGEST").write_text(folder_digest(rb / "adapter") + "\n")

    # ... and a change that did not even refresh DIGEST
    stale = f"{EXP}/20260102-0820-stale"
    rs = clone_run(ws, RUN_A, stale)
    _plant_verdict(ws, stale, valid)
    with open(rs / "adapter" / "adapter_model.safetensors", "ab") as f:
        f.write(b"\0")

    # 4. no verdict at all
    none = f"{EXP}/20260102-0825-none"
    clone_run(ws, RUN_A, none)
    assert not ws.verdict_path(EXP, none).exists()

    async def main():
        async with mcp_session("training-engineer") as s:
            text = await refused(s, "export", export_args(hand, "merged-16bit"))
            assert "does not verify" in text and "by hand" in text
            text = await refused(s, "export", export_args(bare, "merged-16bit"))
            assert "no signed verdict block" in text
            text = await refused(s, "export", export_args(own, "merged-16bit"))
            assert "not this workspace's eval key" in text
            text = await refused(s, "export", export_args(copied, "merged-16bit"))
            assert "copied from another run" in text and RUN_A in text
            text = await refused(s, "export", export_args(RUN_B, "merged-16bit"))
            assert "adapter changed after the verdict" in text
            text = await refused(s, "export", export_args(stale, "merged-16bit"))
            assert "does not match its DIGEST" in text
            text = await refused(s, "export", export_args(none, "merged-16bit"))
            assert "no verdict" in text
            # REJECT: passed along, nothing exported, no retraining suggested by export itself
            rej = await gate_call(s, "export", export_args(RUN_U, "merged-16bit"))
            assert rej["exported"] is False and rej["verdict"] == "REJECT"
            assert rej["top_remediation"] == "train the adapter: it is still at its initialisation"
            assert "task accuracy 0.0 < 0.8" in rej["evidence"]
            assert rej["artifacts"] == []

    anyio.run(main)
    for run_id in (hand, bare, own, copied, RUN_B, stale, none, RUN_U):
        d = world.run_dir(run_id)
        assert not (d / "export").exists() and not (d / "merged").exists(), run_id


# ---------------------------------------------------------------- real exports


def test_merged_16bit_export_reproduces_the_goldens_in_transformers(world, monkeypatch):
    world.use(monkeypatch)
    ws = world.ws
    # export verifies with the public key alone: the private key may be absent from this machine
    priv = signing.key_dir(ws) / signing.PRIVATE_NAME
    hidden = priv.with_name("moved-away")
    priv.rename(hidden)
    try:
        async def main():
            async with mcp_session("training-engineer") as s:
                return await gate_call(s, "export", export_args(RUN_A))  # format and runtime from the brief

        res = anyio.run(main)
    finally:
        hidden.rename(priv)
    assert res["exported"] is True, res["summary"]
    assert (res["format"], res["target_runtime"]) == ("merged-16bit", "transformers")  # "transformers (merged-16bit)" in the brief
    smoke = res["smoke_test"]
    assert smoke["runtime"] == "transformers" and smoke["ran"] and smoke["passed"]
    assert len(smoke["items"]) == 4 and all(task.score(i["prompt"], i["post_export"]) for i in smoke["items"])
    # A float32 model rounded to bfloat16 is held to the 16-bit criterion, not to identity: the float32 reference
    # scored every token the artifact generated, and none lies more than the Format Map's margin below its own choice.
    margin = load_format_map().format("merged-16bit").max_tie_margin
    assert smoke["criterion"].startswith("every token the artifact generated") and f"within {margin} nats" in smoke["criterion"]
    for i in smoke["items"]:
        assert i["meets_criterion"] and 0.0 <= i["max_logit_gap"] <= margin, i
        assert (i["first_divergence"] is None) == i["identical"] and (i["off_greedy_tokens"] == 0) == i["identical"], i
    assert f"(limit {margin})" in res["summary"] and "nats" in res["summary"]
    merged = world.run_dir(RUN_A) / "merged"
    cfg = json.loads((merged / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and (merged / "model.safetensors").is_file() and (merged / "tokenizer.json").is_file()
    report = (world.run_dir(RUN_A) / "export" / "export-report.md").read_text()
    assert "**DONE**" in report and "| # | prompt | pre-export | post-export | identical | similarity | first divergence | max logit gap (nats) |" in report
    assert f"Criterion (merged-16bit): every token" in report
    assert "quantized-export#smoke-test" in res["citations"] and "quantized-export#format-map" in res["citations"]
    assert not list(world.run_dir(RUN_A).glob("export/.export-*"))


def load_format_map():
    from finetune_mcp.skills import load_skills

    return load_skills().table("quantized-export", "format-map")


def test_16bit_criterion_passes_a_rounded_model_and_refuses_a_wrong_one(world):
    """The criterion the 16-bit formats are held to, measured with real models: the float32 reference (base +
    trained adapter) scores the answers of (a) itself, (b) its merge rounded to bfloat16, (c) the base model
    alone, which is what an export that lost the adapter would ship. (a) and (b) pass, (c) does not."""
    torch = pytest.importorskip("torch")
    from finetune_mcp.jobs import evaluate as E
    from finetune_mcp.jobs.export_model import logit_gaps

    margin = load_format_map().format("merged-16bit").max_tie_margin
    base = str(world.ws.base_models_dir / "finetune-mcp-tiny")
    tok = E.load_tokenizer(base)
    prompts = [i["prompt"] for i in task.eval_suite(40, seed=5)[:8]]
    ids = [E.prompt_ids(tok, p) for p in prompts]
    ref = E.load_adapted(base, str(world.run_dir(RUN_A) / "adapter"))

    def worst(model) -> list[float]:
        out = E.generate_ids(model, tok, ids, 16, len(ids))
        return [max(logit_gaps(ref, tok, p, toks, [end] if end is not None else [])) for p, (_, toks, end) in zip(prompts, out)]

    assert worst(ref) == [0.0] * len(prompts)
    merged = E.load_adapted(base, str(world.run_dir(RUN_A) / "adapter")).merge_and_unload().to(torch.bfloat16)
    rounded = worst(merged)
    assert max(rounded) <= margin, rounded
    lost = worst(E.load_model(base))
    assert max(lost) > margin, lost


def test_format_map_refuses_what_the_runtime_cannot_load(world, monkeypatch):
    world.use(monkeypatch)

    async def main():
        async with mcp_session("training-engineer") as s:
            text = await refused(s, "export", export_args(RUN_A, "gguf-q8_0", "transformers"))
            assert "transformers does not load gguf-q8_0" in text and "merged-16bit" in text
            text = await refused(s, "export", export_args(RUN_A, "lora", "llama.cpp"))
            assert "llama.cpp does not load lora" in text

    anyio.run(main)


def test_vllm_export_is_not_done_without_a_gpu(world, monkeypatch):
    if _has_cuda():
        pytest.skip("this machine has a GPU: the vLLM smoke test would run here")
    world.use(monkeypatch)

    async def main():
        async with mcp_session("training-engineer") as s:
            return await gate_call(s, "export", export_args(RUN_A, "lora", "vllm"))

    res = anyio.run(main)
    assert res["exported"] is False and "NOT done" in res["summary"]
    assert res["smoke_test"]["ran"] is False and "GPU" in res["smoke_test"]["reason"]
    assert (world.run_dir(RUN_A) / "export" / "lora" / "adapter_config.json").is_file()
    assert "**NOT DONE**" in (world.run_dir(RUN_A) / "export" / "export-report.md").read_text()


def _has_cuda() -> bool:
    try:
        import subprocess
        import sys

        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True, text=True, timeout=120)
        return out.stdout.strip() == "True"
    except Exception:
        return False


def _llama_cpp_ready(ws) -> str | None:
    """Why GGUF cannot be tested here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install -e .[export]); GGUF export cannot be smoke-tested"
    from finetune_mcp.context import PhaseContext
    from finetune_mcp.common.errors import FtError
    from finetune_mcp.phases.export import converter_path

    try:
        converter_path(PhaseContext.for_role("training-engineer", ws))
    except FtError as e:
        return f"llama.cpp's converter is not available: {e.message} (set FINETUNE_MCP_LLAMA_CPP_SDIST or FINETUNE_MCP_LLAMA_CPP_CONVERTER)"
    return None


@pytest.mark.llamacpp
def test_gguf_exports_smoke_tested_in_llama_cpp(world, monkeypatch):
    world.use(monkeypatch)
    why = _llama_cpp_ready(world.ws)
    if why:
        pytest.skip(f"LLAMA.CPP UNAVAILABLE — {why}")

    async def main():
        async with mcp_session("training-engineer") as s:
            q8 = await gate_call(s, "export", export_args(RUN_A, "gguf-q8_0", "llama.cpp"))
            ol = await gate_call(s, "export", export_args(RUN_A, None, "ollama"))  # Format Map default for Ollama: q4_k_m
            return q8, ol

    q8, ol = anyio.run(main)
    for res, fmt in ((q8, "gguf-q8_0"), (ol, "gguf-q4_k_m")):
        assert res["exported"] is True, res["summary"]
        assert res["format"] == fmt
        smoke = res["smoke_test"]
        assert smoke["runtime"] == "llama.cpp" and smoke["passed"]
        # llama.cpp tokenizes each golden prompt exactly as the HF tokenizer does (the pre-tokenizer mapping holds)
        assert all(i["tokenizer_match"] for i in smoke["items"])
        assert all(i["similarity"] >= (0.9 if fmt == "gguf-q8_0" else 0.7) for i in smoke["items"])
        gguf = Path(res["artifacts"][0])
        assert gguf.suffix == ".gguf" and gguf.read_bytes()[:4] == b"GGUF"
    mf = (world.run_dir(RUN_A) / "export" / "Modelfile").read_text()
    assert "FROM ./" in mf and "<|im_start|>{{ .Role }}" in mf and 'PARAMETER stop "<|im_end|>"' in mf
    assert ol["smoke_test"]["modelfile_template_match"] is True
    report = (world.run_dir(RUN_A) / "export" / "export-report.md").read_text()
    assert "llama_model_quantize" in report and "convert_hf_to_gguf.py" in report


def test_export_is_refused_when_the_base_model_changed_after_the_verdict(world, monkeypatch, tmp_path):
    """The verdict binds the adapter and, through the signed evaluation it embeds, the base model it was judged on
    (its folder digest). Here the base model under the adapter is rebuilt with another seed after promotion:
    export refuses before any artifact is made (the smoke test, which also holds the export to the signed golden
    outputs, would have failed later)."""
    from finetune_mcp.worker import run_job

    world.use(monkeypatch)
    base = world.ws.base_models_dir / "finetune-mcp-tiny"
    other = Path(run_job("build_tiny_model", {"target_dir": str(tmp_path / "other" / "finetune-mcp-tiny"), "seed": 1}, timeout=600)["path"])
    kept = tmp_path / "kept"
    before = _tree(world.run_dir(RUN_A))
    base.rename(kept)
    shutil.copytree(other, base)
    try:
        async def main():
            async with mcp_session("training-engineer") as s:
                return await refused(s, "export", export_args(RUN_A, "lora", "transformers"))

        text = anyio.run(main)
    finally:
        shutil.rmtree(base)
        kept.rename(base)
    from finetune_mcp.digest import folder_digest as digest_of

    assert "the base model is not the one the verdict judged" in text, text
    assert f"sha256 {digest_of(base)[:12]}…" in text and f"sha256 {digest_of(other)[:12]}…" in text
    assert _tree(world.run_dir(RUN_A)) == before, "nothing exported"
