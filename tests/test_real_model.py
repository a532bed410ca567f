"""A shortened lifecycle on a real pretrained model, through both MCP servers: SmolLM2-135M-Instruct (from its GGUF).

prepare_dataset on chat data finds a masking way for SmolLM2's template (which has no {% generation %}
markers and no TRL training copy), preflight times real steps, generate_config and launch_run train a
short real run whose loss falls; the eval engineer evaluates base against tuned with free-text scorers
and drift, signs a verdict, and the merged 16-bit export is smoke-tested. Kept short for CI: a handful of
steps at sequence length 256 (`finetune-mcp demo --model smollm2` is the full run).
"""

from __future__ import annotations

import json
import time

import anyio
import pytest

from conftest import link_model, mcp_session
from finetune_mcp.embedded import identity

STEPS = 8


@pytest.fixture
def smol_root(ws_root, smollm2_dir):
    link_model(ws_root, smollm2_dir)
    inbox = ws_root / "inbox"
    inbox.mkdir()
    (inbox / "training-brief.md").write_text(identity.sample_brief("SmolLM2-135M-Instruct", 256))
    identity.write_jsonl(identity.rows(), inbox / "identity.jsonl")
    return ws_root


async def _call(s, tool, args):
    r = await s.call_tool(tool, args)
    assert not r.is_error, r.content[0].text
    return r.structured_content


def test_smollm2_prepare_preflight_train(smol_root):
    inbox = smol_root / "inbox"

    async def go():
        async with mcp_session() as s:
            prep = await _call(s, "prepare_dataset", {"brief_path": str(inbox / "training-brief.md"),
                                                      "source": str(inbox / "identity.jsonl")})
            pf = await _call(s, "preflight", {"experiment": prep["experiment"]})
            cfg = await _call(s, "generate_config", {"experiment": prep["experiment"], "tag": "short", "overrides": {
                "max_steps": STEPS, "logging_steps": 1, "learning_rate": 1e-3, "warmup_steps": 0}})
            run = await _call(s, "launch_run", {"experiment": prep["experiment"], "tag": "short"})
            records, cursor, t0 = [], 0, time.monotonic()
            while time.monotonic() - t0 < 600:
                p = await _call(s, "poll_progress", {"run_id": run["run_id"], "cursor": cursor})
                records += p["records"]
                cursor = p["next_cursor"]
                if p["status"] in ("succeeded", "failed", "stopped"):
                    break
                await anyio.sleep(2)
            ev, verdict, export = await gate_and_export(run["run_id"], prep["experiment"])
            return prep, pf, cfg, run, p, records, ev, verdict, export

    async def gate_and_export(run_id, exp):
        async with mcp_session("eval-engineer") as s:
            held_out = identity.eval_prompts()[:4]
            files = {"prompts.jsonl": "".join(json.dumps(r) + "\n" for r in held_out),
                     "goldens.jsonl": "".join(json.dumps({"prompt": p}) + "\n" for p in identity.GENERAL_PROMPTS),
                     "drift.jsonl": "".join(json.dumps({"prompt": p}) + "\n" for p in identity.GENERAL_PROMPTS),
                     "eval.yaml": "max_new_tokens: 24\ndrift_max_new_tokens: 16\nperplexity_max_tokens: 256\n"
                                  "thresholds:\n  max_kl: null\n  max_perplexity_ratio: null\n"}
            for name, content in files.items():
                await _call(s, "write_eval_file", {"experiment": exp, "relpath": name, "content": content})
            ev = await _call(s, "evaluate_checkpoint", {"run_id": run_id})
            verdict = await _call(s, "record_verdict", {"run_id": run_id, "verdict": "PROMOTE",
                                                        "evidence": f"eval loss {ev['eval_loss']}, KL {ev['drift']['kl']}"})
        async with mcp_session() as s:
            export = await _call(s, "export", {"run_id": run_id, "format": "merged-16bit", "target_runtime": "transformers"})
        return ev, verdict, export

    prep, pf, cfg, run, final, records, ev, verdict, export = anyio.run(go)

    # Masking: SmolLM2's template gets the derived spans; every decoded sample trains exactly the reply + <|im_end|>.
    assert prep["complete"], prep["summary"]
    assert prep["masking"]["method"] == "derived-spans" and prep["masking"]["plan"]["eot"] == ["<|im_end|>"]
    assert "SmolLM" in prep["masking"]["default_system_prompt"]
    rows = {m["messages"][0]["content"]: m["messages"][1]["content"] for m in identity.rows()}
    for sample in prep["decoded_samples"]:
        user = sample.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        trained = sample.split("⟦", 1)[1].split("⟧", 1)[0]
        assert sample.count("⟦") == 1 and trained.removesuffix("<|im_end|>") in rows.values() and user in rows
    card = (smol_root / "experiments" / "trainings" / prep["experiment"] / "data" / "dataset-card.md").read_text()
    assert "derived-spans" in card and "own system prompt" in card

    # Preflight timed real steps and estimated at the shape the config then used.
    assert pf["time_estimate"]["measured"] and pf["time_estimate"]["s_per_micro_step"] > 0
    # ...the time at the average padded length (a batch pads to its own longest row), timed as a second shape,
    # and generate_config restated it for the run that starts (max_steps overridden after preflight).
    report = json.loads((smol_root / "experiments" / "trainings" / prep["experiment"] / "env-report.json").read_text())
    probe, t = report["observed"]["step_probe"], pf["time_estimate"]
    assert t["tokens_per_sequence"] < pf["memory_estimate"]["tokens_per_sequence"] == probe["batch_shape"][1]
    # These chats are of even length (longest 54 tokens, average padded ~51): within a tenth of the longest the probe
    # times one shape and the estimate scales it (the demo's long chats take the second, timed shape).
    assert probe["expected"] is None and "scaled by tokens" in t["how"]
    assert abs(t["s_per_micro_step"] - probe["s_per_micro_step"] * t["tokens_per_sequence"] / probe["batch_shape"][1]) < 1e-3
    assert cfg["time_estimate"]["measured"] and cfg["time_estimate"]["steps"] == STEPS
    assert pf["memory_estimate"]["micro_batch_size"] == 2 and pf["memory_estimate"]["tokens_per_sequence"] < 256
    assert cfg["masking"] == "derived-spans"

    # The run trained: every record has exactly the five keys, and the loss fell.
    assert final["status"] == "succeeded", final
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(set(r) == {"step", "loss", "lr", "mem_gb", "temp_c"} for r in records)
    first, last = sum(r["loss"] for r in records[:2]) / 2, sum(r["loss"] for r in records[-2:]) / 2
    assert last < first * 0.8, [r["loss"] for r in records]
    config = json.loads(json.dumps(__import__("yaml").safe_load(
        (smol_root / "outputs" / "trainings" / run["run_id"] / "config.yaml").read_text())))
    assert config["data"]["masking"]["method"] == "derived-spans"

    # Evaluation: every prompt side by side with the scorer it used; eval loss fell from the base's; drift measured.
    assert len(ev["items"]) == 4 and all(i["scorer"].startswith("contains") and i["base_output"] for i in ev["items"])
    assert ev["eval_loss"] < ev["base_eval_loss"], (ev["eval_loss"], ev["base_eval_loss"])
    assert ev["drift"]["kl"] > 0 and ev["drift"]["perplexity_ratio"] > 0
    assert verdict["verdict"] == "PROMOTE"
    # Export: the float32 model merged and rounded to bfloat16 is held to the 16-bit criterion (not to identical answers,
    # which rounding may break at a near-tie): every token it generated is one the float32 base + adapter ranked within
    # 0.5 nats of its own greedy choice, measured per golden.
    items = export["smoke_test"]["items"]
    assert export["exported"] and export["smoke_test"]["passed"] and len(items) == 3, export["summary"]
    assert "within 0.5 nats" in export["smoke_test"]["criterion"]
    assert all(i["meets_criterion"] and 0.0 <= i["max_logit_gap"] <= 0.5 and (i["first_divergence"] is None) == i["identical"]
               for i in items), items
