"""generate_config: one recipe per method, values with their sources, backend choice, overrides, budget rules,
renders of every method x backend, the committed files, and the run config launch_run snapshots.

Experiments here are prepared from the real pieces: the embedded model, rows from the synthetic task's
generators, the sample brief, and an env-report.json written by the real preflight phase replaying a
recorded observation (tests/fixtures/observations). Nothing here imports the training stack.
"""

from __future__ import annotations

import py_compile
import re
import shutil
import sys
from pathlib import Path

import pytest

from conftest import call_tool, prepare_experiment
import yaml

from finetune_mcp.context import PhaseContext
from finetune_mcp.common import task
from finetune_mcp.common.errors import BadInput, Refused
from finetune_mcp.domain import machine as P
from finetune_mcp.domain import recipes as C
from finetune_mcp.domain import render
from finetune_mcp.domain.brief import METHODS
from finetune_mcp.workspace import file_state, git

FIX = Path(__file__).parent / "fixtures"
OBS = FIX / "observations"

@pytest.fixture
def prepared(ws_root, tiny_model_dir, monkeypatch):
    def make(method="sft-lora", **kw):
        return prepare_experiment(ws_root, tiny_model_dir, method, monkeypatch=monkeypatch, **kw)

    return make


def _run_yaml(pc, experiment, tag):
    return yaml.safe_load((pc.ws.experiments_dir / experiment / "configs" / f"run-{tag}.yaml").read_text())


# ---------------------------------------------------------------- refusals


def test_no_env_report_no_script(prepared):
    pc, exp = prepared()
    (pc.ws.experiments_dir / exp / "env-report.json").unlink()
    with pytest.raises(Refused) as e:
        call_tool("generate_config", pc, exp, "r1")
    assert "preflight" in e.value.fix and "env-report.json" in e.value.message
    assert not (pc.ws.experiments_dir / exp / "train.py").exists()


def test_blended_override_is_refused_naming_its_method(prepared):
    pc, exp = prepared("sft-lora")
    with pytest.raises(BadInput) as e:
        call_tool("generate_config", pc, exp, "r1", overrides={"beta": 0.1, "learning_rate": 1e-4})
    msg = str(e.value)
    assert "'beta' belongs to DPO, ORPO, KTO, SimPO, GRPO, not to SFT-LoRA" in msg
    assert "overrides" in msg and not (pc.ws.experiments_dir / exp / "configs").exists(), "a refused call writes nothing"


def test_grpo_key_in_dpo_is_refused_naming_grpo(prepared):
    pc, exp = prepared("dpo")
    with pytest.raises(BadInput) as e:
        call_tool("generate_config", pc, exp, "r1", overrides={"num_generations": 4})
    assert "belongs to GRPO, not to DPO" in str(e.value)


def test_unknown_and_mistyped_overrides_are_all_reported(prepared):
    pc, exp = prepared("sft-lora")
    with pytest.raises(BadInput) as e:
        call_tool("generate_config", pc, exp, "r1", overrides={"lora_rank": 32, "learning_rate": "fast", "precision": "int3"})
    msg = str(e.value)
    assert "did you mean 'lora_r'" in msg
    assert "learning_rate: 'fast' is not a float" in msg
    assert "'int3' is not one of ['bf16', 'fp16', 'fp32']" in msg
    assert "3 override(s) refused" in msg


def test_bad_backend_and_tag(prepared):
    pc, exp = prepared()
    with pytest.raises(BadInput):
        call_tool("generate_config", pc, exp, "r1", backend="axolotl")
    with pytest.raises(BadInput):
        call_tool("generate_config", pc, exp, "../r1")


# ---------------------------------------------------------------- resolution and sources


def test_sft_on_cpu_resolves_every_value_with_its_source(prepared):
    pc, exp = prepared("sft-lora")
    r = call_tool("generate_config", pc, exp, "r8", overrides={"max_steps": 30})
    v = {k: x.value for k, x in r.resolved.items()}
    src = {k: x.source for k, x in r.resolved.items()}
    assert r.method == "sft-lora" and r.backend == "trl"
    assert "unsloth does not import" in r.backend_reason
    # recipe, brief, platform rule, model rule, override: each recorded
    assert src["lora_dropout"] == "recipe lora-qlora-recipes#rank-alpha-dropout" and v["lora_dropout"] == 0.0
    assert v["max_seq_length"] == 64 and src["max_seq_length"].startswith("brief")
    assert v["packing"] is True and src["packing"].startswith("brief")
    assert v["precision"] == "fp32" and "cpu-full-precision" in src["precision"]
    assert v["gradient_checkpointing"] is False
    assert v["modules_to_save"] == ["embed_tokens", "lm_head"] and "embedded-model-adapter" in src["modules_to_save"]
    assert v["learning_rate"] == 3e-3 and "embedded-model-rate" in src["learning_rate"]
    assert v["max_steps"] == 30 and src["max_steps"] == "override"
    assert v["calls.trainer.use_cpu"] is True
    # no key of another method leaks in
    assert not {"beta", "num_generations", "loss_type", "rewards"} & set(v)
    for c in ("lora-qlora-recipes#sft-lora", "lora-qlora-recipes#embedded-model", "lora-qlora-recipes#precision-rules",
              "lora-qlora-recipes#backend-choice", "lora-qlora-recipes#escape-hatch"):
        assert c in r.citations
    # The run file says the same, and the escape-hatch table shaped the calls.
    run = _run_yaml(pc, exp, "r8")
    assert run["hparams"]["learning_rate"] == 3e-3 and run["sources"]["max_steps"] == "override"
    calls = run["calls"]
    assert calls["trainer"]["max_length"] == 64 and "max_seq_length" not in calls["trainer"]
    assert calls["trainer"]["bf16"] is False and calls["trainer"]["fp16"] is False and calls["load"]["dtype"] == "float32"
    assert calls["peft"]["r"] == 8 and calls["quantization"] == {}
    assert "eval_at_end" in calls["script"] and "eval_at_end" not in calls["trainer"]


def test_files_are_written_and_committed(prepared):
    pc, exp = prepared("sft-lora")
    r = call_tool("generate_config", pc, exp, "r8")
    d = pc.ws.experiments_dir / exp
    for rel in ("configs/base.yaml", "configs/run-r8.yaml", "train.py", "train.sh"):
        assert str(d / rel) in r.files
        assert file_state(pc.ws.experiments_repo, d / rel) == "clean", rel
    assert git(pc.ws.experiments_repo, "rev-parse", "HEAD").strip() == r.commit
    assert "generate_config" in git(pc.ws.experiments_repo, "log", "-1", "--format=%s")
    assert (d / "train.sh").stat().st_mode & 0o111
    sh = (d / "train.sh").read_text()
    assert 'DGX_SPARK_ROOT="${DGX_SPARK_ROOT:-${HOME}/dgx-spark}"' in sh
    assert 'OUTPUT_ROOT="${OUTPUT_ROOT:-${DGX_SPARK_ROOT}/outputs/trainings}"' in sh
    assert "RUN_TAG:?" in sh and "$(date +%Y%m%d-%H%M)-${RUN_TAG}" in sh
    # The same call again changes nothing, so it commits nothing new.
    again = call_tool("generate_config", pc, exp, "r8")
    assert again.commit == r.commit


def test_override_outside_the_settled_range_is_kept_with_a_warning(prepared):
    pc, exp = prepared("sft-lora")
    r = call_tool("generate_config", pc, exp, "hot", overrides={"lora_dropout": 0.3})
    assert r.resolved["lora_dropout"].value == 0.3
    assert any("lora_dropout = 0.3 is outside the settled range [0, 0.1]" in w for w in r.warnings)


def test_each_method_gets_only_its_recipe(prepared):
    expected = {"dpo": {"beta": 0.1, "loss_type": "sigmoid"}, "orpo": {"beta": 0.1}, "kto": {"beta": 0.1, "desirable_weight": 1.0},
                "simpo": {"beta": 2.0, "simpo_gamma": 1.0, "cpo_alpha": 0.0}, "grpo": {"num_generations": 8, "max_completion_length": 8}}
    for method, want in expected.items():
        pc, exp = prepared(method)
        r = call_tool("generate_config", pc, exp, "t")
        v = {k: x.value for k, x in r.resolved.items()}
        for k, x in want.items():
            assert v[k] == x, (method, k)
        assert "packing" not in v and "assistant_only_loss" not in v, method
        run = _run_yaml(pc, exp, "t")
        if method == "simpo":
            assert run["calls"]["trainer"]["loss_type"] == "simpo"
        if method == "grpo":
            assert v["rewards"] == ["exact_match", "format"] and run["calls"]["script"]["rewards"] == ["exact_match", "format"]
            assert "max_length" not in run["calls"]["trainer"], "GRPOConfig has no max_length"
            base = yaml.safe_load((pc.ws.experiments_dir / exp / "configs" / "base.yaml").read_text())
            assert base["data"]["reference_field"] == "answer" and base["signal"] == {"metric": "reward", "direction": "rises"}
        skill = {"grpo": "grpo-rlvr-training"}.get(method, "preference-optimization")
        assert f"{skill}#{method}" in r.citations


# ---------------------------------------------------------------- backend choice


def test_unsloth_first_where_it_imports_and_supports_the_method(prepared):
    pc, exp = prepared("sft-lora", observation="h100.json")
    r = call_tool("generate_config", pc, exp, "gpu")
    assert r.backend == "unsloth" and "supports SFT-LoRA on generic-nvidia" in r.backend_reason
    run = _run_yaml(pc, exp, "gpu")
    calls = run["calls"]
    # Unsloth's spellings from the escape-hatch table
    assert calls["load"]["max_seq_length"] == 64 and calls["peft"]["random_state"] == 3407
    assert run["hparams"]["precision"] == "bf16" and calls["load"]["dtype"] == "bfloat16" and calls["trainer"]["bf16"] is True
    assert calls["peft"]["use_gradient_checkpointing"] == "unsloth" and run["hparams"]["optim"] == "adamw_8bit"
    train_py = (pc.ws.experiments_dir / exp / "train.py").read_text()
    assert "from unsloth import FastLanguageModel" in train_py
    assert train_py.index("from unsloth import") < train_py.index("from trl import"), "unsloth must be imported before TRL"
    # The same experiment forced onto the escape hatch: same values, TRL's spellings.
    t = call_tool("generate_config", pc, exp, "gpu-trl", backend="trl")
    assert t.backend == "trl" and "forced" in t.backend_reason
    tcalls = _run_yaml(pc, exp, "gpu-trl")["calls"]
    assert "max_seq_length" not in tcalls["load"] and "random_state" not in tcalls["peft"]
    assert tcalls["trainer"]["gradient_checkpointing"] is True and tcalls["trainer"]["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert "unsloth" not in (pc.ws.experiments_dir / exp / "train.py").read_text().split('"""', 2)[2].split("# --- progress")[0]


def test_methods_unsloth_lacks_on_cpu_take_the_escape_hatch(prepared):
    pc, exp = prepared("dpo")
    r = call_tool("generate_config", pc, exp, "t")
    assert r.backend == "trl"
    forced = call_tool("generate_config", pc, exp, "u", backend="unsloth")
    assert forced.backend == "unsloth"
    assert any("does not train DPO on cpu" in w for w in forced.warnings)
    assert any("no importable unsloth" in w for w in forced.warnings)


def test_t4_without_bf16_gets_fp16(prepared):
    pc, exp = prepared("sft-lora", observation="t4.json")
    r = call_tool("generate_config", pc, exp, "t4")
    assert r.resolved["precision"].value == "fp16" and "fp16-without-bf16" in r.resolved["precision"].source
    calls = _run_yaml(pc, exp, "t4")["calls"]
    assert calls["trainer"]["fp16"] is True and calls["trainer"]["bf16"] is False


# ---------------------------------------------------------------- memory budget


def _big_model_brief(budget: str, extra: str = "") -> str:
    text = task.sample_brief("sft-lora").replace("finetune-mcp-tiny", "llama-3.1-8b")
    text = re.sub(r"## Memory Budget\n4 GB", f"## Memory Budget\n{budget}{extra}", text)
    return text.replace("max_seq_length: 64", "max_seq_length: 2048")


def test_budget_rules_checkpoint_then_halve_batch_and_qlora_only_when_allowed(ws_root, monkeypatch):
    big = FIX / "models" / "llama-3.1-8b"
    pc, exp = prepare_experiment(ws_root, big, "sft-lora", monkeypatch=monkeypatch, observation="h100.json",
                                 brief_text=_big_model_brief("20 GB"))
    r = call_tool("generate_config", pc, exp, "b1")
    v, src = {k: x.value for k, x in r.resolved.items()}, {k: x.source for k, x in r.resolved.items()}
    assert v["per_device_train_batch_size"] == 1 and src["per_device_train_batch_size"].startswith("budget rule")
    assert v["gradient_accumulation_steps"] == 8, "halving the batch keeps the effective batch"
    assert v["load_in_4bit"] is False, "the brief did not allow QLoRA"
    assert any("does not allow it" in w for w in r.warnings)
    assert r.memory_estimate["fits"] is False and "lora-qlora-recipes#memory-budget" in r.citations

    pc, exp = prepare_experiment(ws_root, big, "sft-lora", monkeypatch=monkeypatch, observation="h100.json",
                                 brief_text=_big_model_brief("20 GB", " (QLoRA allowed)"))
    r = call_tool("generate_config", pc, exp, "b2")
    assert r.resolved["load_in_4bit"].value is True and "allows QLoRA" in r.resolved["load_in_4bit"].source
    assert r.memory_estimate["fits"] is True
    calls = _run_yaml(pc, exp, "b2")["calls"]
    assert calls["load"]["load_in_4bit"] is True  # Unsloth on the H100
    t = call_tool("generate_config", pc, exp, "b2-trl", backend="trl")
    q = _run_yaml(pc, exp, "b2-trl")["calls"]["quantization"]
    assert q == {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"}
    assert t.resolved["load_in_4bit"].value is True


def test_an_override_beats_the_budget_and_says_so(ws_root, monkeypatch):
    big = FIX / "models" / "llama-3.1-8b"
    pc, exp = prepare_experiment(ws_root, big, "sft-lora", monkeypatch=monkeypatch, observation="h100.json",
                                 brief_text=_big_model_brief("20 GB"))
    r = call_tool("generate_config", pc, exp, "b3", overrides={"per_device_train_batch_size": 4})
    assert r.resolved["per_device_train_batch_size"].value == 4
    assert any("replaces a budget rule's value" in w for w in r.warnings)


# ---------------------------------------------------------------- renders


@pytest.mark.parametrize("backend", C.BACKENDS)
@pytest.mark.parametrize("method", METHODS)
def test_every_method_and_backend_renders_and_byte_compiles(method, backend, tmp_path):
    from finetune_mcp.skills import load_skills

    skill, recipe = C.all_recipes(load_skills())[method]
    text = render.render_train_py(method, backend, "demo-experiment", recipe)
    path = tmp_path / "train.py"
    path.write_text(text)
    py_compile.compile(str(path), doraise=True)
    assert "#>>" not in text and "{{" not in text
    assert f'METHOD = "{method}"' in text and f'BACKEND = "{backend}"' in text
    assert f"from {recipe.trainer.module} import {recipe.trainer.config}, {recipe.trainer.trainer}" in text
    assert ("import unsloth" in text or "from unsloth import" in text) == (backend == "unsloth")
    # standalone: only the training stack, pyyaml and the standard library
    imported = set(re.findall(r"^\s*(?:from|import)\s+([A-Za-z_][\w]*)", text, re.M))
    stack = {"torch", "transformers", "trl", "peft", "datasets", "yaml", "unsloth", "PIL", "psutil", "pynvml", "tensorboard", "matplotlib"}
    stdlib = set(sys.stdlib_module_names)
    # and, for the SFT family, masking.py: the declared byte-for-byte copy of common/masking.py written beside it
    beside = {"masking"} if render.needs_masking(method) else set()
    assert imported <= stack | stdlib | beside, imported - stack - stdlib - beside
    assert "import finetune_mcp" not in text and "from finetune_mcp" not in text
    sh = render.render_train_sh(method, backend, "demo-experiment", "t1", recipe.label)
    assert "{{" not in sh


def test_train_py_digest_is_the_servers_algorithm(tmp_path):
    """The copy of the digest inside train.py gives the same answer as finetune_mcp.digest."""
    from finetune_mcp import digest
    from finetune_mcp.skills import load_skills

    _, recipe = C.all_recipes(load_skills())["sft-lora"]
    text = render.render_train_py("sft-lora", "trl", "x", recipe)
    head = text[: text.index("# --- config and data")]
    head = head.replace('signal.signal(signal.SIGTERM, _on_stop_signal)\nsignal.signal(signal.SIGINT, _on_stop_signal)\n', "")
    ns: dict = {}
    exec(compile(head, "train.py", "exec"), ns)
    folder = tmp_path / "a"
    (folder / "sub").mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"\x00weights")
    (folder / "sub" / "x.json").write_text("{}")
    assert ns["folder_digest"](folder) == digest.folder_digest(folder)
    ckpt = tmp_path / "checkpoint-3"
    shutil.copytree(folder, ckpt)
    (ckpt / "optimizer.pt").write_bytes(b"state")
    (ckpt / "rng_state.pth").write_bytes(b"rng")
    got = ns["copy_adapter"](ckpt, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "DIGEST").read_text().strip() == got
    assert digest.verify_folder(tmp_path / "adapter")[0]
    assert not (tmp_path / "adapter" / "optimizer.pt").exists()


def test_the_escape_hatch_table_and_its_prose_agree():
    from finetune_mcp.skills import load_skills

    sk = load_skills()
    table = sk.table("lora-qlora-recipes", "unsloth-trl-mapping")
    md = (sk.get("lora-qlora-recipes").path / "references" / "unsloth-trl-mapping.md").read_text()
    for row in table.rows:
        assert f"| `{row.key}` |" in md, f"references/unsloth-trl-mapping.md lacks a row for {row.key}"
    # every param a row maps is a key of some recipe
    keys = {k for m in C.all_recipes(sk) for k in C.recipe_params(sk, m)}
    for row in table.rows:
        if not row.key.startswith("@"):
            assert row.key in keys, row.key
    # every Unsloth entry point the templates call has a row
    rendered = "".join(render.render_train_py(m, "unsloth", "x", C.all_recipes(sk)[m][1]) for m in ("sft-lora", "dpo", "vlm-sft"))
    for api, key in (("FastLanguageModel.from_pretrained", "@model_name"), ("get_peft_model", "@get_peft_model"),
                     ("PatchDPOTrainer", "@patch_trainer"), ("FastVisionModel", "@vision_model"),
                     ("UnslothVisionDataCollator", "@vision_collator")):
        assert api in rendered
        assert any(r.key == key for r in table.rows), key


# ---------------------------------------------------------------- the run config


def test_resolve_run_config_merges_base_run_and_meta(prepared):
    pc, exp = prepared("sft-lora")
    call_tool("generate_config", pc, exp, "r8", overrides={"max_steps": 12})
    d = pc.ws.experiments_dir / exp
    meta = {"run_id": f"{exp}/20260101-0000-r8", "run_dir": "/x", "experiment_commit": "abc", "launcher": "local", "created_at": "t"}
    cfg = C.resolve_run_config(d, "r8", meta)
    base = yaml.safe_load((d / "configs" / "base.yaml").read_text())
    run = yaml.safe_load((d / "configs" / "run-r8.yaml").read_text())
    assert cfg["run"] == meta
    assert cfg["model"] == base["model"] and cfg["data"] == base["data"]
    assert cfg["hparams"]["max_steps"] == 12 and cfg["calls"] == run["calls"]
    assert cfg["method"] == "sft-lora" and cfg["backend"] == "trl" and cfg["signal"] == {"metric": "loss", "direction": "falls"}
    with pytest.raises(Exception) as e:
        C.resolve_run_config(d, "nope", meta)
    assert "generate_config" in str(getattr(e.value, "fix", "")) or "generate_config" in str(e.value)


def test_generate_config_through_mcp(prepared):
    import anyio

    from conftest import mcp_session

    pc, exp = prepared("sft-lora")

    async def main():
        async with mcp_session("training-engineer") as s:
            res = await s.call_tool("generate_config", {"experiment": exp, "tag": "mcp1", "overrides": {"max_steps": 5}})
            assert not res.is_error, res.content
            data = res.structured_content
            assert data["backend"] == "trl" and data["resolved"]["max_steps"] == {"value": 5, "source": "override"}
            bad = await s.call_tool("generate_config", {"experiment": exp, "tag": "mcp2", "overrides": {"num_generations": 4}})
            assert bad.is_error and "belongs to GRPO" in bad.content[0].text

    anyio.run(main)


def test_prompt_completion_rows_train_on_the_completion_not_the_assistant_mask(ws_root, tiny_model_dir, monkeypatch):
    text = task.sample_brief("sft-lora").replace("format: messages", "format: prompt-completion")
    pc, exp = prepare_experiment(ws_root, tiny_model_dir, "sft-lora", monkeypatch=monkeypatch, brief_text=text)
    task.write_jsonl(task.sft_prompt_completion(64, 0), pc.ws.datasets_dir / exp / "train.jsonl")
    r = call_tool("generate_config", pc, exp, "pc")
    assert r.resolved["assistant_only_loss"].value is False
    assert "prompt-completion-loss" in r.resolved["assistant_only_loss"].source


def test_finds_what_the_real_prepare_dataset_wrote_under_another_name(ws_root, tiny_model_dir, monkeypatch):
    """prepare_dataset (the real phase, its worker job included) with a dataset_name of its own, then preflight and
    generate_config: the config names that dataset and takes its format and template facts from its meta.json."""

    pc = PhaseContext.for_role("training-engineer")
    pc.ws.ensure_dirs()
    shutil.copytree(tiny_model_dir, pc.ws.base_models_dir / tiny_model_dir.name)
    brief = ws_root / "brief.md"
    brief.write_text(task.sample_brief("sft-lora"))
    src = ws_root / "rows.jsonl"
    task.write_jsonl(task.sft_conversations(300, 0), src)
    prep = call_tool("prepare_dataset", pc, str(brief), str(src), dataset_name="my-words")
    assert prep.complete, prep.summary
    monkeypatch.setenv(P.REPLAY_ENV, str(OBS / "cpu-this-machine.json"))
    call_tool("preflight", pc, prep.experiment)
    call_tool("generate_config", pc, prep.experiment, "t")
    base = yaml.safe_load((pc.ws.experiments_dir / prep.experiment / "configs" / "base.yaml").read_text())
    assert base["data"]["dir"] == str(pc.ws.datasets_dir / "my-words") and base["data"]["format"] == "messages"
    meta = yaml.safe_load((pc.ws.datasets_dir / "my-words" / "meta.json").read_text())
    assert meta["chat_template"]["generation_markers"] is True
    assert _run_yaml(pc, prep.experiment, "t")["hparams"]["assistant_only_loss"] is True
