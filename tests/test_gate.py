"""The eval gate through the MCP client, both roles: eval tools hidden from the training role, the
eval surface unwritable from it through any argument of any tool, evaluate_checkpoint and the signed
record_verdict.

The runs here carry real adapters: a short real PEFT LoRA training of the embedded tiny model on
the repeat-words task (seconds on a CPU), and an untrained adapter as PEFT initialises it (LoRA B=0,
so it answers like the base model). They sit in the run-directory layout launch_run produces
(config.yaml, training-brief.md, adapter/ + DIGEST); the end-to-end path through launch_run and the
generated train.py is the demo's (tests/test_demo.py). test_export.py reuses the world built here.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import yaml

from conftest import mcp_session
from finetune_mcp.embedded import task
from finetune_mcp.workspace import Workspace, commit, ensure_repo

EXP = "finetune-mcp-tiny-SFT-LoRA-repeat-words"
RUN_A, RUN_B, RUN_U = f"{EXP}/20260101-0900-good", f"{EXP}/20260101-0930-good2", f"{EXP}/20260101-1000-untrained"
EVAL_TOOLS = {"evaluate_checkpoint", "record_verdict", "write_eval_file"}

TRAIN_SCRIPT = r'''
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import LoraConfig, get_peft_model
from finetune_mcp.embedded import task
from finetune_mcp.digest import folder_digest

p = json.loads(sys.argv[1])
torch.set_num_threads(1)
tok = AutoTokenizer.from_pretrained(p["model_dir"])
result = {}
for out, steps in p["adapters"]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(p["model_dir"], dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                             modules_to_save=["embed_tokens", "lm_head"], task_type="CAUSAL_LM"))
    bs = 16
    enc = []
    for row in task.sft_conversations(max(steps, 1) * bs, seed=0):
        prompt = tok.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=False)
        pi = tok(prompt, add_special_tokens=False)["input_ids"]
        ci = tok(row["messages"][1]["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        enc.append((pi + ci, [-100] * len(pi) + ci))
    opt = torch.optim.AdamW([x for x in model.parameters() if x.requires_grad], lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / max(steps, 1))
    model.train()
    loss = None
    for s in range(steps):
        batch = enc[s * bs:(s + 1) * bs]
        n = max(len(a) for a, _ in batch)
        ids = torch.tensor([a + [tok.pad_token_id] * (n - len(a)) for a, _ in batch])
        lab = torch.tensor([b + [-100] * (n - len(b)) for _, b in batch])
        att = torch.tensor([[1] * len(a) + [0] * (n - len(a)) for a, _ in batch])
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        loss.backward(); opt.step(); sched.step(); opt.zero_grad()
    model.save_pretrained(out)
    Path(out, "DIGEST").write_text(folder_digest(Path(out)) + "\n")
    result[out] = float(loss.detach()) if loss is not None else None
print(json.dumps(result))
'''


def train_adapters(model_dir: Path, adapters: list[tuple[Path, int]]) -> dict:
    """Real PEFT LoRA trainings (steps=0: the adapter as PEFT initialises it), in one child process."""
    params = {"model_dir": str(model_dir), "adapters": [(str(o), n) for o, n in adapters]}
    p = subprocess.run([sys.executable, "-c", TRAIN_SCRIPT, json.dumps(params)],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def make_run(ws: Workspace, run_id: str, adapter_src: Path, model_dir: Path) -> Path:
    """A finished run as launch_run + train.py leave it (the parts the gate and export read)."""
    r = ws.output_root / run_id
    r.mkdir(parents=True)
    shutil.copytree(adapter_src, r / "adapter")
    e = ws.experiments_dir / EXP
    ds = ws.datasets_dir / EXP
    (r / "config.yaml").write_text(yaml.safe_dump({
        "experiment": EXP, "method": "sft-lora",
        "model": {"name": "finetune-mcp-tiny", "path": str(model_dir), "embedded": True},
        "data": {"dir": str(ds), "train": "train.jsonl", "eval": "eval.jsonl", "format": "messages"},
        "run": {"run_id": run_id.split("/")[1], "run_dir": str(r), "launcher": "local"},
    }))
    shutil.copyfile(e / "training-brief.md", r / "training-brief.md")
    (r / "exit.json").write_text(json.dumps({"returncode": 0, "signal": None}))
    return r


def clone_run(ws: Workspace, src_id: str, dst_id: str) -> Path:
    """Another run directory with the same files (a verdict copied along with them)."""
    dst = ws.output_root / dst_id
    shutil.copytree(ws.output_root / src_id, dst)
    return dst


def suite_files(n: int = 20) -> dict[str, str]:
    items = task.eval_suite(n, seed=3)
    return {
        "prompts.jsonl": "".join(json.dumps(i) + "\n" for i in items),
        "goldens.jsonl": "".join(json.dumps({"prompt": i["prompt"]}) + "\n" for i in items[:4]),
        "drift.jsonl": "".join(json.dumps({"prompt": p}) + "\n" for p in task.drift_prompts()),
    }


async def call(s, tool: str, args: dict) -> dict:
    r = await s.call_tool(tool, args)
    assert not r.is_error, f"{tool} failed: {r.content[0].text}"
    return r.structured_content


async def refused(s, tool: str, args: dict) -> str:
    r = await s.call_tool(tool, args)
    assert r.is_error, f"{tool} should have been refused: {r.structured_content}"
    return r.content[0].text


class World:
    """One workspace: experiment + brief + prepared eval split, three finished runs, an eval suite,
    and the eval engineer's verdicts: A and B promoted, U (untrained) rejected."""

    def __init__(self, root: Path):
        self.root = root
        self.evals: dict[str, dict] = {}

    @property
    def ws(self) -> Workspace:
        return Workspace.from_env({"DGX_SPARK_ROOT": str(self.root)})

    def use(self, monkeypatch) -> None:
        monkeypatch.setenv("DGX_SPARK_ROOT", str(self.root))
        monkeypatch.delenv("OUTPUT_ROOT", raising=False)

    def run_dir(self, run_id: str) -> Path:
        return self.ws.output_root / run_id


_WORLD: World | None = None


def build_world(tmp_path_factory, model_dir: Path) -> World:
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    base = tmp_path_factory.mktemp("gate-world")
    root = base / "dgx-spark"
    ws = Workspace.from_env({"DGX_SPARK_ROOT": str(root)})
    ws.ensure_dirs()
    ensure_repo(ws.experiments_repo)
    e = ws.experiments_dir / EXP
    e.mkdir(parents=True)
    (e / "training-brief.md").write_text(task.sample_brief("sft-lora"))
    commit(ws.experiments_repo, [e / "training-brief.md"], "brief")
    held = task.eval_suite(40, seed=5)
    task.write_jsonl([{"messages": [{"role": "user", "content": i["prompt"]}, {"role": "assistant", "content": i["expected"]}]} for i in held],
                     ws.datasets_dir / EXP / "eval.jsonl")
    # The world's own copy of the base model, so that a test may swap it (adapters record this path).
    shutil.copytree(model_dir, ws.base_models_dir / "finetune-mcp-tiny")
    model_dir = ws.base_models_dir / "finetune-mcp-tiny"
    trained, untrained = base / "adapters" / "trained", base / "adapters" / "untrained"
    losses = train_adapters(model_dir, [(trained, 300), (untrained, 0)])
    assert losses[str(trained)] < 0.5, losses
    make_run(ws, RUN_A, trained, model_dir)
    make_run(ws, RUN_B, trained, model_dir)
    make_run(ws, RUN_U, untrained, model_dir)

    world = World(root)
    env = {"DGX_SPARK_ROOT": str(root)}

    async def eval_engineer():
        async with mcp_session("eval-engineer", env=env) as s:
            for name, content in suite_files().items():
                await call(s, "write_eval_file", {"experiment": EXP, "relpath": name, "content": content})
            for run_id in (RUN_A, RUN_B, RUN_U):
                world.evals[run_id] = await call(s, "evaluate_checkpoint", {"run_id": run_id})
            for run_id in (RUN_A, RUN_B):
                await call(s, "record_verdict", {"run_id": run_id, "verdict": "PROMOTE",
                                                 "evidence": f"accuracy {world.evals[run_id]['task_accuracy']} vs base {world.evals[run_id]['base_accuracy']}"})
            await call(s, "record_verdict", {"run_id": RUN_U, "verdict": "REJECT",
                                             "evidence": f"task accuracy {world.evals[RUN_U]['task_accuracy']} < 0.8",
                                             "top_remediation": "train the adapter: it is still at its initialisation"})

    anyio.run(eval_engineer)
    _WORLD = world
    return world


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir) -> World:
    return build_world(tmp_path_factory, tiny_model_dir)


# ---------------------------------------------------------------- evaluation and verdicts


def test_evaluation_measures_the_trained_adapter_against_the_base(world):
    a, u = world.evals[RUN_A], world.evals[RUN_U]
    assert a["task_accuracy"] >= 0.8 and a["base_accuracy"] == 0.0
    assert a["passed"] == {"min_accuracy": True}
    assert a["thresholds"]["min_accuracy"] == {"value": 0.8, "source": "brief ## Evaluation"}
    # the untrained adapter is the base model: same answers, nothing drifts
    assert u["task_accuracy"] == u["base_accuracy"] == 0.0 and u["drift"] == 0.0
    assert u["passed"] == {"min_accuracy": False}
    # eval loss on the prepared split: the trained adapter is far better than its initialisation
    assert a["eval_loss"] < 1.0 < u["eval_loss"]
    report = world.run_dir(RUN_A) / "eval-report.md"
    text = report.read_text()
    assert "| task accuracy |" in text and "prepared eval split" in text
    goldens = [d for d in a["details"] if d["kind"] == "golden"]
    assert len(goldens) == 4 and all(task.score(g["prompt"], g["output"]) for g in goldens)


def test_verdict_is_signed_and_bound_to_run_and_adapter(world):
    from finetune_mcp import signing
    from finetune_mcp.digest import verify_folder

    ws = world.ws
    priv = signing.key_dir(ws) / signing.PRIVATE_NAME
    assert stat.S_IMODE(priv.stat().st_mode) == 0o600
    text = (world.run_dir(RUN_A) / "promotion-report.md").read_text()
    block = signing.verify_report(text, signing.load_public_key(ws), "promotion-report.md")
    assert block["run_id"] == RUN_A and block["verdict"] == "PROMOTE"
    assert block["adapter_sha256"] == verify_folder(world.run_dir(RUN_A) / "adapter")[1]
    assert block["evidence_sha256"] == signing.sha256_text(block["evidence"])
    assert len(block["goldens"]) == 4 and block["signed_at"]
    assert "**Verdict: PROMOTE**" in text and "## Evidence" in text
    # one flipped character anywhere in the block breaks it
    tampered = text.replace('"verdict": "PROMOTE"', '"verdict": "PROMOTF"')
    with pytest.raises(signing.BadSignature):
        signing.verify_report(tampered, signing.load_public_key(ws), "x")


def test_eval_role_refusals(world, monkeypatch):
    world.use(monkeypatch)

    async def main():
        async with mcp_session("eval-engineer") as s:
            # PROMOTE on a failed evaluation, REJECT without a remediation
            text = await refused(s, "record_verdict", {"run_id": RUN_U, "verdict": "PROMOTE", "evidence": "looks fine"})
            assert "fails min_accuracy" in text
            text = await refused(s, "record_verdict", {"run_id": RUN_U, "verdict": "REJECT", "evidence": "bad"})
            assert "top remediation" in text
            # bad suite files are refused with their line, and nothing is written
            bad = '{"prompt": "Repeat:\\napple river stone", "expected": "apple river stone"}\n{"prompt": 3}\n'
            text = await refused(s, "write_eval_file", {"experiment": EXP, "relpath": "prompts.jsonl", "content": bad})
            assert "eval/prompts.jsonl:2" in text
            assert "prompt" in (world.ws.experiments_dir / EXP / "eval" / "prompts.jsonl").read_text()[:20]
            text = await refused(s, "write_eval_file", {"experiment": EXP, "relpath": "eval.yaml", "content": "thresholds: {min_acc: 1}\n"})
            assert "thresholds" in text
            # the eval role writes only inside eval/
            for rel in ("../train.py", "/etc/passwd", "../../../outputs/x.md", "sub/../../README.md"):
                await refused(s, "write_eval_file", {"experiment": EXP, "relpath": rel, "content": "x"})
            assert not (world.ws.experiments_dir / EXP / "train.py").exists()

    anyio.run(main)


# ---------------------------------------------------------------- the training role and the eval surface


def test_training_role_does_not_see_eval_tools(ws_root):
    async def main():
        async with mcp_session("training-engineer") as s:
            names = {t.name for t in (await s.list_tools()).tools}
            assert not names & EVAL_TOOLS and "export" in names
            for tool in EVAL_TOOLS:
                r = await s.call_tool(tool, {"run_id": RUN_A, "experiment": EXP, "relpath": "x", "content": "x", "verdict": "PROMOTE", "evidence": "x"})
                assert r.is_error
        async with mcp_session("eval-engineer") as s:
            names = {t.name for t in (await s.list_tools()).tools}
            assert EVAL_TOOLS <= names and "export" not in names and "launch_run" not in names

    anyio.run(main)


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every eval/ file and promotion report under the root, with its bytes."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and ("eval" in rel.parts or p.name == "promotion-report.md"):
            out[str(rel)] = p.read_bytes()
        elif p.is_symlink():
            out[str(rel)] = b"symlink->" + os.readlink(p).encode()
    return out


def test_training_role_cannot_write_eval_or_verdicts_through_any_argument(world, monkeypatch):
    world.use(monkeypatch)
    ws = world.ws
    e = ws.experiments_dir / EXP
    r = world.run_dir(RUN_A)
    # Links planted where the training role may write, pointing at the eval surface.
    inbox = world.root / "inbox"
    inbox.mkdir(exist_ok=True)
    (inbox / "to-eval").symlink_to(e / "eval")
    (inbox / "to-report").symlink_to(r / "promotion-report.md")
    (ws.datasets_dir / "planted").symlink_to(e / "eval")
    before = _snapshot(world.root)
    targets = [
        str(e / "eval" / "prompts.jsonl"), str(e / "eval" / "new.jsonl"), str(e / "eval"), str(r / "promotion-report.md"),
        f"experiments/trainings/{EXP}/eval/prompts.jsonl", f"outputs/trainings/{RUN_A}/promotion-report.md",
        str(inbox / "to-eval" / "prompts.jsonl"), str(inbox / "to-report"), "inbox/to-eval/x.jsonl",
        f"{ws.datasets_dir}/../experiments/trainings/{EXP}/eval/x.jsonl", "planted", "../experiments/trainings/" + EXP + "/eval",
        f"{EXP}/../{EXP}/eval", "eval", f"{RUN_A}/../../{EXP}/eval",
    ]
    defaults = {"experiment": EXP, "run_id": RUN_A, "tag": "no-such-tag", "brief_path": str(e / "training-brief.md"),
                "source": str(inbox / "none.jsonl")}
    calls = 0

    async def main():
        nonlocal calls
        async with mcp_session("training-engineer") as s:
            tools = (await s.list_tools()).tools
            assert tools
            for t in tools:
                props = t.input_schema.get("properties", {})
                strings = [k for k, v in props.items() if _is_free_string(v)]
                for key in strings:
                    for target in targets:
                        args = {k: defaults[k] for k in t.input_schema.get("required", []) if k in defaults}
                        args[key] = target
                        r = await s.call_tool(t.name, args)
                        calls += 1
                        # whatever the tool did with it, the eval surface is untouched (checked below)
                        if not r.is_error and t.name not in ("poll_progress", "triage_failure", "export"):
                            pytest.fail(f"{t.name}({key}={target!r}) was accepted: {r.content[0].text[:300]}")

    anyio.run(main)
    assert calls > 50
    assert _snapshot(world.root) == before
    assert not list(world.root.rglob("*.tmp"))


def _is_free_string(schema: dict) -> bool:
    opts = schema.get("anyOf", [schema])
    return any(o.get("type") == "string" and "enum" not in o and "const" not in o for o in opts)


def test_prepare_dataset_will_not_write_through_a_planted_link_into_eval(world, monkeypatch, tmp_path):
    """The one training tool that takes a name it writes under: the guard follows the link and refuses."""
    world.use(monkeypatch)
    ws = world.ws
    e = ws.experiments_dir / EXP
    link = ws.datasets_dir / "sneaky"
    if not link.exists():
        link.symlink_to(e / "eval")
    (tmp_path / "brief.md").write_text(task.sample_brief("sft-lora"))
    task.write_jsonl(task.sft_conversations(60, seed=1), tmp_path / "d.jsonl")
    before = _snapshot(world.root)

    async def main():
        async with mcp_session("training-engineer", extra_args=["--data-dir", str(tmp_path)]) as s:
            text = await refused(s, "prepare_dataset", {"brief_path": str(tmp_path / "brief.md"), "source": str(tmp_path / "d.jsonl"),
                                                        "dataset_name": "sneaky"})
            assert "eval" in text

    anyio.run(main)
    assert _snapshot(world.root) == before
