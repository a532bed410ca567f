"""The eval gate through the MCP client, both roles: eval tools hidden from the training role, the
eval surface unwritable from it through any argument of any tool, evaluate_checkpoint and the signed
record_verdict; and the hostile cases of issue 30, as a training agent with a shell would try them: a
forged evaluation result, the suite read through the eval report, git objects or a hard link, a verdict
copied from another run.

The runs here carry real adapters: a short real PEFT LoRA training of the embedded tiny model on
the repeat-words task (seconds on a CPU), and an untrained adapter as PEFT initialises it (LoRA B=0,
so it answers like the base model). They sit in the run-directory layout launch_run produces
(config.yaml, training-brief.md, adapter/ + DIGEST); the end-to-end path through launch_run and the
generated train.py is the demo's (tests/test_demo.py). conftest.build_world builds this world;
test_export.py reuses it.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import anyio
import pytest

from conftest import EVAL_YAML, EXP, RUN_A, RUN_U, World, build_world, clone_run, gate_call, mcp_session, refused
from finetune_mcp.common import task
from finetune_mcp.domain.verdicts import read_eval_result
from finetune_mcp.workspace import Workspace

# The tools only the eval role has (conftest.EVAL_TOOLS is the eval role's whole list, shared ones included).
EVAL_TOOLS = {"evaluate_checkpoint", "record_verdict", "write_eval_file"}


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir) -> World:
    return build_world(tmp_path_factory, tiny_model_dir)


# ---------------------------------------------------------------- evaluation and verdicts


def test_evaluation_measures_the_trained_adapter_against_the_base(world):
    a, u = world.evals[RUN_A], world.evals[RUN_U]
    assert a["task_accuracy"] == 0.9 and a["base_accuracy"] == 0.0  # 2 of 20 prompts ask for what the task never gives
    assert a["passed"] == {"min_accuracy": True, "max_kl": True, "max_perplexity_ratio": True}
    assert a["thresholds"]["min_accuracy"] == {"value": 0.8, "source": "brief ## Evaluation"}
    assert a["thresholds"]["max_kl"] == {"value": 4.0, "source": "eval/eval.yaml"}
    # The untrained adapter is the base model: same answers, and both drift measures read "no change" (the KL up to
    # float rounding: the base distributions come from the cached generation, the tuned ones from one full pass).
    assert u["task_accuracy"] == u["base_accuracy"] == 0.0
    assert u["drift"]["kl"] < 1e-6 and u["drift"]["perplexity_ratio"] == 1.0 and u["drift"]["changed_share"] == 0.0
    assert u["passed"] == {"min_accuracy": False, "max_kl": True, "max_perplexity_ratio": True}
    # training moved the model away from the base on general prompts and text
    assert a["drift"]["kl"] > 0.1 and a["drift"]["perplexity_ratio"] != 1.0
    assert a["drift"]["prompts"] == len(task.drift_prompts()) and a["drift"]["kl_tokens"] > 0 and a["drift"]["perplexity_tokens"] > 500
    assert a["drift"]["text_source"].startswith("shipped general-text.txt")
    # the fine-tuned passes ran with the adapter merged into the weights (every base pass before them)
    assert read_eval_result(world.ws, RUN_A)["adapter_merged"] is True
    # eval loss on the prepared split: the trained adapter is far better than its initialisation
    assert a["eval_loss"] < 1.0 < u["eval_loss"]
    report = Path(a["report"])
    assert report == world.ws.eval_report_path(EXP, RUN_A) and Path(a["result"]) == world.ws.eval_result_path(EXP, RUN_A)
    text = report.read_text()
    assert "| task accuracy |" in text and "prepared eval split" in text and "perplexity ratio" in text
    # nothing eval-owned is written into the run folder, which the training side owns
    assert not (world.run_dir(RUN_A) / "eval-report.md").exists() and not (world.run_dir(RUN_A) / "promotion-report.md").exists()
    goldens = [d for d in a["details"] if d["kind"] == "golden"]
    assert len(goldens) == 4 and all(task.score(g["prompt"], g["output"]) for g in goldens)


def test_every_prompt_is_listed_with_its_scorer_and_both_answers(world):
    a, u = world.evals[RUN_A], world.evals[RUN_U]
    items = a["items"]
    assert len(items) == 20
    labels = ["contains", "normalized", "regex(pattern='^\\s*(\\w+)')", "first_line", "rouge_l(threshold=0.75)", "contains", "rouge_l(threshold=0.9)"]
    assert [it["scorer"] for it in items[12:19]] == labels
    assert all(it["scorer"] == "exact" for it in items[:12] + items[19:])
    assert a["scorers"] == {"exact": 13, "contains": 2, "normalized": 1, labels[2]: 1, "first_line": 1, labels[4]: 1, labels[6]: 1}
    # The scorers judged the tiny model's real answers. The trained adapter repeats the three words (checked
    # first); each scorer accepts that in its own way, except where the suite asks for something else:
    # the words reversed (17) and a ROUGE-L bar above what two of three words reach (18).
    assert all(it["output"] == task.reference_answer(it["prompt"]) for it in items), [it["output"] for it in items]
    assert [it["correct"] for it in items] == [i not in (17, 18) for i in range(20)]
    assert items[16]["score"] == items[18]["score"] and abs(items[16]["score"] - 0.8) < 1e-9
    # the base model's answers are noise: every scorer rejects them
    assert all(not it["base_correct"] and it["base_output"] != it["output"] for it in items)
    # side by side: the counts agree with the items, and the untrained adapter changes nothing
    sbs = a["side_by_side"]
    assert sbs["improved"] == sum(it["correct"] for it in items) and sbs["regressed"] == 0
    assert sbs["improved"] + sbs["unchanged"] == 20
    assert u["side_by_side"] == {"improved": 0, "regressed": 0, "unchanged": 20}
    assert all(it["output"] == it["base_output"] for it in u["items"])


def test_side_by_side_report_under_eval_is_written_and_committed(world):
    a = world.evals[RUN_A]
    path = Path(a["side_by_side_report"])
    e = world.ws.eval_dir(EXP)
    assert path.parent == e / "reports" and path.name == RUN_A.split("/")[1] + ".md"
    text = path.read_text()
    sbs = a["side_by_side"]
    assert f"| improved (base wrong, fine-tuned right) | {sbs['improved']} |" in text
    assert f"| regressed (base right, fine-tuned wrong) | {sbs['regressed']} |" in text
    assert f"| unchanged | {sbs['unchanged']} |" in text
    # every prompt, with both answers (the base model's noise has control characters, shown escaped)
    assert text.count("**Base** (") == text.count("**Fine-tuned** (") == 20
    for it in a["items"]:
        assert "    " + it["output"] + "\n" in text
    assert "\x07" not in text and "\\x07" in text
    # committed in the suite's own repository, never in the experiments one
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", str(path)], cwd=e, capture_output=True, text=True)
    assert tracked.returncode == 0, tracked.stderr
    # the report is not part of the suite: evaluating wrote it without changing what the verdict is bound to
    from finetune_mcp.domain.suite import load_suite

    assert "reports" not in " ".join(load_suite(e)["files"])


def test_drift_bars_gate_the_promotion(world, monkeypatch):
    """A bar below the trained adapter's KL fails it; without bars for harm no PROMOTE is signed; a waiver is stated."""
    world.use(monkeypatch)
    run_id = f"{EXP}/20260101-1100-bars"
    clone_run(world.ws, RUN_A, run_id)
    bars = {"tight": "thresholds: {max_kl: 0.05, max_perplexity_ratio: 3.0}\n", "unset": "thresholds: {}\n",
            "waived": "thresholds: {max_kl: null, max_perplexity_ratio: 3.0}\n"}
    seen = {}

    async def main():
        async with mcp_session("eval-engineer") as s:
            try:
                for name, text in bars.items():
                    await gate_call(s, "write_eval_file", {"experiment": EXP, "relpath": "eval.yaml", "content": text})
                    ev = await gate_call(s, "evaluate_checkpoint", {"run_id": run_id})
                    r = await s.call_tool("record_verdict", {"run_id": run_id, "verdict": "PROMOTE", "evidence": f"kl {ev['drift']['kl']}"})
                    report = world.ws.verdict_path(EXP, run_id)
                    seen[name] = (ev, r.is_error, r.content[0].text, report.read_text() if report.is_file() else "")
            finally:  # the world's suite as it was (same bytes, same digest) for the tests after this one
                await gate_call(s, "write_eval_file", {"experiment": EXP, "relpath": "eval.yaml", "content": EVAL_YAML})

    anyio.run(main)
    ev, refused_, text, _ = seen["tight"]
    assert ev["passed"]["max_kl"] is False and ev["drift"]["kl"] > 0.05 and refused_ and "fails max_kl" in text
    ev, refused_, text, _ = seen["unset"]
    assert "max_kl" not in ev["passed"] and "a PROMOTE needs one" in ev["summary"]
    assert refused_ and "no threshold for max_kl, max_perplexity_ratio" in text
    ev, refused_, text, report = seen["waived"]
    assert not refused_, text
    # the PROMOTE signed under the waiver states it, and cites the perplexity figure against its bar
    assert "nats/token; waived in eval/eval.yaml." in report and "≤ 3 from eval/eval.yaml, passed" in report


def test_verdict_is_signed_and_bound_to_run_and_adapter(world):
    from finetune_mcp import signing
    from finetune_mcp.digest import verify_folder

    ws = world.ws
    priv = signing.key_dir(ws) / signing.PRIVATE_NAME
    assert stat.S_IMODE(priv.stat().st_mode) == 0o600
    path = ws.verdict_path(EXP, RUN_A)
    assert path == ws.root / "verdicts" / EXP / RUN_A.split("/")[1] / "promotion-report.md"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 and stat.S_IMODE(path.parent.stat().st_mode) == 0o755  # world-readable
    text = path.read_text()
    block = signing.verify_report(text, signing.load_public_key(ws), "promotion-report.md")
    assert block["run_id"] == RUN_A and block["verdict"] == "PROMOTE" and block["override"] is None
    # it embeds the signed evaluation, byte for byte the result file, which verifies on its own
    assert block["evaluation"] == json.loads(ws.eval_result_path(EXP, RUN_A).read_text())
    from finetune_mcp.domain.verdicts import verify_evaluation

    ev = verify_evaluation(block["evaluation"], signing.load_public_key(ws), "evaluation")
    assert ev["run_id"] == RUN_A and ev["adapter_sha256"] == block["adapter_sha256"] and ev["task_accuracy"] == 0.9
    base = ws.base_models_dir / "finetune-mcp-tiny"
    assert block["base_model"] == ev["base_model"] == {"name": str(base), "path": str(base.resolve()), "sha256": verify_folder(base)[1]}
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
            assert "fails min_accuracy (task accuracy 0.0000 < 0.8 from brief ## Evaluation)" in text and "override_reason" in text
            text = await refused(s, "record_verdict", {"run_id": RUN_U, "verdict": "REJECT", "evidence": "bad"})
            assert "top remediation" in text
            # bad suite files are refused with their line, and nothing is written
            bad = '{"prompt": "Repeat:\\napple river stone", "expected": "apple river stone"}\n{"prompt": 3}\n'
            text = await refused(s, "write_eval_file", {"experiment": EXP, "relpath": "prompts.jsonl", "content": bad})
            assert "eval/prompts.jsonl:2" in text
            assert "prompt" in (world.ws.eval_dir(EXP) / "prompts.jsonl").read_text()[:20]
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
    """Every eval-owned file (suites, reports, results, verdicts, keys) under the root, with its bytes."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and ("eval" in rel.parts or p.name == "promotion-report.md" or rel.parts[0] in ("verdicts", ".finetune-mcp-keys")):
            out[str(rel)] = p.read_bytes()
        elif p.is_symlink():
            out[str(rel)] = b"symlink->" + os.readlink(p).encode()
    return out


def test_training_role_cannot_write_eval_or_verdicts_through_any_argument(world, monkeypatch):
    world.use(monkeypatch)
    ws = world.ws
    e = ws.experiments_dir / EXP
    r = world.run_dir(RUN_A)
    suite, verdict = ws.eval_dir(EXP), ws.verdict_path(EXP, RUN_A)
    # Links planted where the training role may write, pointing at the eval surface.
    inbox = world.root / "inbox"
    inbox.mkdir(exist_ok=True)
    (inbox / "to-eval").symlink_to(suite)
    (inbox / "to-report").symlink_to(verdict)
    (ws.datasets_dir / "planted").symlink_to(suite)
    before = _snapshot(world.root)
    targets = [
        str(suite / "prompts.jsonl"), str(suite / "new.jsonl"), str(suite), str(verdict), str(ws.eval_result_path(EXP, RUN_A)),
        f"eval/{EXP}/prompts.jsonl", f"verdicts/{EXP}/{RUN_A.split('/')[1]}/promotion-report.md", f"eval/{EXP}/results/x.json",
        str(e / "eval" / "prompts.jsonl"), str(r / "promotion-report.md"), f"outputs/trainings/{RUN_A}/promotion-report.md",
        str(inbox / "to-eval" / "prompts.jsonl"), str(inbox / "to-report"), "inbox/to-eval/x.jsonl",
        f"{ws.datasets_dir}/../eval/{EXP}/x.jsonl", "planted", "../eval/" + EXP, f"{EXP}/../../eval/{EXP}", "eval",
        f"{RUN_A}/../../../eval/{EXP}", str(suite / ".git" / "config"), "experiments/.git/config",
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
    link = ws.datasets_dir / "sneaky"
    if not link.exists():
        link.symlink_to(ws.eval_dir(EXP))
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


# ---------------------------------------------------------------- issue 30: the training agent with a shell


def _rewrite_result(ws: Workspace, run_id: str, change) -> bytes:
    """Edit the run's signed result file as a shell could (single-user mode); returns the original bytes."""
    path = ws.eval_result_path(EXP, run_id)
    before = path.read_bytes()
    doc = json.loads(before)
    change(doc)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return before


def test_forged_evaluation_result_gets_no_promote(world, monkeypatch):
    """The issue's attack: task_accuracy set to 0.10 and every check marked passed in the result file, then PROMOTE.
    The signature no longer verifies. A result re-signed with the key (its pass/fail disagreeing with its figures)
    is caught too: every check is recomputed from the signed figures and thresholds."""
    from finetune_mcp import signing

    world.use(monkeypatch)
    ws = world.ws
    path, verdict = ws.eval_result_path(EXP, RUN_U), ws.verdict_path(EXP, RUN_U)
    signed_verdict = verdict.read_bytes()

    def forge(doc):
        doc["task_accuracy"] = 0.10
        doc["passed"] = {k: True for k in doc["passed"]}

    original = _rewrite_result(ws, RUN_U, forge)
    seen = {}
    try:
        async def main():
            async with mcp_session("eval-engineer") as s:
                seen["forged"] = await refused(s, "record_verdict", {"run_id": RUN_U, "verdict": "PROMOTE", "evidence": "accuracy 0.10, all passed"})
                seen["forged_reject"] = await refused(s, "record_verdict", {"run_id": RUN_U, "verdict": "REJECT", "evidence": "x",
                                                                             "top_remediation": "y"})
                # the same lie, signed with the eval key: the figures say 0.0, so min_accuracy fails whatever "passed" says
                doc = json.loads(original)
                doc = signing.sign_block(signing.load_or_create_private_key(ws), {k: v for k, v in doc.items() if k not in ("signature",)}
                                         | {"passed": {k: True for k in doc["passed"]}}, signing.EVAL_SCHEMA)
                path.write_text(json.dumps(doc))
                seen["resigned"] = await refused(s, "record_verdict", {"run_id": RUN_U, "verdict": "PROMOTE", "evidence": "all passed"})

        anyio.run(main)
    finally:
        path.write_bytes(original)
    print("\nFORGED-EVALUATION REFUSAL:\n" + seen["forged"] + "\nRE-SIGNED REFUSAL:\n" + seen["resigned"])
    assert "the signature of the evaluation result " + path.name + " does not verify" in seen["forged"]
    assert str(path) in seen["forged"] and "evaluate_checkpoint again" in seen["forged"]
    assert "does not verify" in seen["forged_reject"]
    assert "fails min_accuracy (task accuracy 0.0000 < 0.8 from brief ## Evaluation)" in seen["resigned"]
    assert "recomputed from the signed figures" in seen["resigned"]
    assert verdict.read_bytes() == signed_verdict  # the REJECT signed at the start stands


def test_promote_against_a_failed_check_needs_an_override_the_verdict_records(world, monkeypatch):
    from finetune_mcp import signing

    world.use(monkeypatch)
    ws = world.ws
    verdict = ws.verdict_path(EXP, RUN_U)
    signed_reject = verdict.read_bytes()
    reason = "accepted for a latency test only: accuracy is not what this build is judged on"
    try:
        async def main():
            async with mcp_session("eval-engineer") as s:
                text = await refused(s, "record_verdict", {"run_id": RUN_A, "verdict": "PROMOTE", "evidence": "x", "override_reason": "why not"})
                assert "fails no check: there is nothing to override" in text
                text = await refused(s, "record_verdict", {"run_id": RUN_U, "verdict": "REJECT", "evidence": "x", "top_remediation": "y",
                                                           "override_reason": "z"})
                assert "a REJECT overrides nothing" in text
                return await gate_call(s, "record_verdict", {"run_id": RUN_U, "verdict": "PROMOTE", "evidence": "accuracy 0.0, promoted anyway",
                                                             "override_reason": reason})

        res = anyio.run(main)
        text = verdict.read_text()
    finally:
        verdict.write_bytes(signed_reject)  # the world's REJECT, as signed, for the tests after this one
    assert res["verdict"] == "PROMOTE" and "OVERRIDE of failed check(s) min_accuracy" in res["summary"]
    assert res["override"] == {"reason": reason, "failed_checks": ["min_accuracy"],
                               "checks": ["min_accuracy (task accuracy 0.0000 < 0.8 from brief ## Evaluation)"]}
    block = signing.verify_report(text, signing.load_public_key(ws), "promotion-report.md")
    assert block["verdict"] == "PROMOTE" and block["override"] == res["override"]
    assert block["metrics"]["passed"]["min_accuracy"] is False  # the verdict shows the check as failed, not as passed
    assert "## OVERRIDE" in text and reason in text and "FAILED" in text


def test_training_role_cannot_read_the_suite_by_any_way_round(world, monkeypatch, tmp_path):
    """The eval report, the signed result, git objects of either repository, and a hard link to the suite planted
    in a data folder: triage_failure and prepare_dataset refuse each, saying why."""
    world.use(monkeypatch)
    ws = world.ws
    suite = ws.eval_dir(EXP)
    # the experiments repository holds no eval file at all; the suite's history is in its own repository
    names = subprocess.run(["git", "-C", str(ws.experiments_repo), "log", "--all", "--name-only", "--format="],
                           capture_output=True, text=True, check=True).stdout.split()
    assert names and not [n for n in names if "eval/" in n or n.endswith("prompts.jsonl")], names
    exp_objects = sorted(p for p in (ws.experiments_repo / ".git" / "objects").rglob("*") if p.is_file())
    suite_objects = sorted(p for p in (suite / ".git" / "objects").rglob("*") if p.is_file())
    assert exp_objects and suite_objects
    data = tmp_path / "data"
    data.mkdir()
    link = data / "train.jsonl"
    os.link(suite / "prompts.jsonl", link)
    (tmp_path / "brief.md").write_text(task.sample_brief("sft-lora"))
    before = _snapshot(world.root)
    out = {}

    async def main():
        async with mcp_session("training-engineer", extra_args=["--data-dir", str(tmp_path)]) as s:
            for name, p in (("report", ws.eval_report_path(EXP, RUN_A)), ("result", ws.eval_result_path(EXP, RUN_A)),
                            ("exp_git", exp_objects[0]), ("suite_git", suite_objects[0]), ("exp_git_head", ws.experiments_repo / ".git" / "HEAD"),
                            ("link", link)):
                out["triage_" + name] = await refused(s, "triage_failure", {"log_path": str(p)})
            for name, p in (("link", link), ("folder", data), ("exp_git", exp_objects[0])):
                out["prepare_" + name] = await refused(s, "prepare_dataset", {"brief_path": str(tmp_path / "brief.md"), "source": str(p),
                                                                              "dataset_name": "leak"})

    anyio.run(main)
    for k in ("triage_report", "triage_result", "triage_suite_git"):
        assert "training-engineer role may not access" in out[k] and "policy: eval/**" in out[k], out[k]
    for k in ("triage_exp_git", "triage_exp_git_head", "prepare_exp_git"):
        assert "training-engineer role may not access" in out[k] and "policy: **/.git" in out[k], out[k]
    for k in ("triage_link", "prepare_link"):
        assert "is a hard link: the file has 2 names (st_nlink 2)" in out[k] and "refused by every tool" in out[k], out[k]
    assert "holds a hard link" in out["prepare_folder"] and "train.jsonl has 2 names" in out["prepare_folder"]
    assert not (ws.datasets_dir / "leak").exists()
    assert _snapshot(world.root) == before


def test_export_refuses_a_verdict_copied_from_another_run(world, monkeypatch):
    """A genuine signed PROMOTE of A, copied by a shell into the verdict place of a clone of A (same adapter bytes)."""
    world.use(monkeypatch)
    ws = world.ws
    copied = f"{EXP}/20260103-0800-copied"
    clone_run(ws, RUN_A, copied)
    dst = ws.verdict_path(EXP, copied)
    dst.parent.mkdir(parents=True)
    shutil.copyfile(ws.verdict_path(EXP, RUN_A), dst)

    async def main():
        async with mcp_session("training-engineer") as s:
            return await refused(s, "export", {"run_id": copied, "format": "merged-16bit"})

    text = anyio.run(main)
    assert "was signed for run " + repr(RUN_A) in text and "copied from another run" in text
    assert not (world.run_dir(copied) / "export").exists() and not (world.run_dir(copied) / "merged").exists()


def test_both_roles_compare_with_the_signed_accuracy(world, monkeypatch):
    """The training role sees the summary figures through the signed verdict, the eval role through its own result."""
    world.use(monkeypatch)
    seen = {}

    async def main():
        for role in ("training-engineer", "eval-engineer"):
            async with mcp_session(role) as s:
                res = await gate_call(s, "compare_runs", {"experiment": EXP, "runs": [RUN_A, RUN_U], "plot": False})
                seen[role] = {row["run_id"]: row["eval_accuracy"] for row in res["runs"]}

    anyio.run(main)
    assert seen["training-engineer"] == seen["eval-engineer"] == {RUN_A: 0.9, RUN_U: 0.0}
