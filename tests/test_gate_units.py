"""The gate's pieces without a model: the verdict key pair, the signed block, eval suite validation."""

from __future__ import annotations

import json
import os
import stat
import threading

import pytest

from conftest import call_tool

from finetune_mcp import signing
from finetune_mcp.context import PhaseContext
from finetune_mcp.common.errors import BadInput, Forbidden, Refused
from finetune_mcp.domain import suite as eval_suite, verdicts
from finetune_mcp.workspace import Workspace


def test_key_pair_made_once_private_0600(ws_root):
    ws = Workspace.from_env()
    keys: list = []
    threads = [threading.Thread(target=lambda: keys.append(signing.load_or_create_private_key(ws))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = {signing.key_id(k.public_key()) for k in keys}
    assert len(keys) == 6 and len(ids) == 1, "concurrent first use must agree on one key"
    d = signing.key_dir(ws)
    assert stat.S_IMODE((d / signing.PRIVATE_NAME).stat().st_mode) == 0o600
    assert stat.S_IMODE(d.stat().st_mode) == 0o711  # the training user reaches the public half by name, lists nothing
    assert stat.S_IMODE((d / signing.PUBLIC_NAME).stat().st_mode) == 0o644
    assert signing.key_id(signing.load_public_key(ws)) in ids
    assert sorted(p.name for p in d.iterdir()) == [signing.PRIVATE_NAME, signing.PUBLIC_NAME]


def test_private_key_readable_by_others_is_refused(ws_root):
    ws = Workspace.from_env()
    signing.load_or_create_private_key(ws)
    os.chmod(signing.key_dir(ws) / signing.PRIVATE_NAME, 0o644)
    with pytest.raises(Refused, match="readable by others"):
        signing.load_or_create_private_key(ws)


def test_block_round_trip_and_its_failures(ws_root):
    ws = Workspace.from_env()
    key = signing.load_or_create_private_key(ws)
    pub = signing.load_public_key(ws)
    block = signing.sign_block(key, {"run_id": "e/20260101-0000-a", "verdict": "PROMOTE", "adapter_sha256": "ab" * 32,
                                     "evidence": "ünïcode ✓", "evidence_sha256": signing.sha256_text("ünïcode ✓"), "signed_at": "t"})
    text = "# Report\n\nprose\n\n" + signing.render_block(block)
    assert signing.verify_report(text, pub, "r")["evidence"] == "ünïcode ✓"
    with pytest.raises(signing.BadSignature, match="more than one"):
        signing.verify_report(text + "\n" + signing.render_block(block), pub, "r")
    with pytest.raises(signing.BadSignature, match="malformed"):
        signing.verify_report(text.replace('"signature": "', '"signature": "!!'), pub, "r")
    with pytest.raises(signing.BadSignature, match="does not verify"):
        signing.verify_report(text.replace('"verdict": "PROMOTE"', '"verdict": "REJECT"'), pub, "r")
    # re-serialised with other spacing and key order, the canonical form still verifies
    reordered = json.dumps(dict(reversed(list(block.items()))))
    assert signing.verify_report(signing.MARKER + "\n```json\n" + reordered + "\n```\n", pub, "r")["verdict"] == "PROMOTE"


def test_no_key_means_no_verdict_was_ever_signed(ws_root):
    with pytest.raises(signing.BadSignature, match="no verdict key exists"):
        signing.load_public_key(Workspace.from_env())


def test_training_role_may_not_sign(ws_root):
    pc = PhaseContext.for_role("training-engineer")
    with pytest.raises(Forbidden, match="may not sign"):
        call_tool("record_verdict", pc, "e/20260101-0000-a", "PROMOTE", "x")


@pytest.mark.parametrize("name, content, where", [
    ("prompts.jsonl", '{"prompt": "a", "expected": "b"}\nnot json\n', "eval/prompts.jsonl:2"),
    ("prompts.jsonl", '{"prompt": "a"}\n', "eval/prompts.jsonl:1: expected"),
    ("prompts.jsonl", '{"prompt": "a", "expected": "b", "answer": "c"}\n', "eval/prompts.jsonl:1"),
    ("goldens.jsonl", '{"prompt": [{"role": "user"}]}\n', "eval/goldens.jsonl:1: prompt"),
    ("drift.jsonl", '["a"]\n', "eval/drift.jsonl:1"),
    ("eval.yaml", "thresholds:\n  min_accuracy: high\n", "eval/eval.yaml: thresholds.min_accuracy"),
    ("eval.yaml", "goldens: 9\n", "eval/eval.yaml: goldens"),
    ("eval.yaml", "loss: prompts\n", "eval/eval.yaml"),
    ("prompts.jsonl", '{"prompt": "a", "expected": "b"}\n\n{"prompt": "a", "expected": "b", "scorer": "contain"}\n', "eval/prompts.jsonl:3: scorer"),
    ("prompts.jsonl", '{"prompt": "a", "expected": "b", "scorer": {"name": "regex", "pattern": "(a"}}\n', "eval/prompts.jsonl:1: scorer.pattern"),
    ("prompts.jsonl", '{"prompt": "a", "expected": "b", "scorer": {"name": "numeric", "tolerance": 0.5}}\n', "eval/prompts.jsonl:1: expected"),
    ("prompts.jsonl", '{"prompt": "a", "expected": ["1", "x"], "scorer": "numeric"}\n', "eval/prompts.jsonl:1: expected[1]"),
    ("prompts.jsonl", '{"prompt": "a", "expected": []}\n', "eval/prompts.jsonl:1: expected"),
    ("eval.yaml", "scorer: {name: rouge_l, threshold: 0}\n", "eval/eval.yaml: scorer.threshold"),
    ("eval.yaml", "scorer: includes\n", "eval/eval.yaml: scorer"),
    ("eval.yaml", "match: contains\n", "eval/eval.yaml: match"),
    ("eval.yaml", "thresholds: {max_kld: 0.1}\n", "eval/eval.yaml: thresholds.max_kld"),
    ("eval.yaml", "perplexity_text: ../x.txt\n", "eval/eval.yaml: perplexity_text"),
    ("eval.yaml", "batch_size: 0\n", "eval/eval.yaml: batch_size"),
])
def test_suite_files_are_validated_with_their_place(name, content, where):
    with pytest.raises(BadInput) as e:
        eval_suite.validate_suite_file(name, content)
    assert e.value.where == where


def test_suite_formats_accepted():
    rows = eval_suite.validate_suite_file("prompts.jsonl", '{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "expected": "x", "id": 1}\n\n')
    assert len(rows) == 1
    assert eval_suite.validate_suite_file("goldens.jsonl", '{"prompt": "p", "output": "o"}\n{"prompt": "q"}\n')[1] == {"prompt": "q"}
    cfg = eval_suite.validate_suite_file("eval.yaml", "thresholds: {min_accuracy: 0.9, max_drift: null}\nmatch: first_line\ngoldens: 3\n")
    assert cfg["match"] == "first_line" and cfg["scorer_spec"].name == "first_line"  # match: the scorer's older name
    rows = eval_suite.validate_suite_file("prompts.jsonl", '{"prompt": "p", "expected": ["a", "b"], "scorer": {"name": "regex", "pattern": "is (\\\\w+)"}}\n')
    assert rows[0]["expected"] == ["a", "b"] and rows.lines == [1]
    assert eval_suite.validate_suite_file("notes.md", "anything") is None


def test_suite_default_scorer_is_checked_against_the_prompts_it_will_judge(ws_root):
    """A numeric suite default over a non-number answer is refused on whichever file is written second."""
    ws = Workspace.from_env()
    (ws.experiments_dir / "exp").mkdir(parents=True)
    pc = PhaseContext.for_role("eval-engineer")
    call_tool("write_eval_file", pc, "exp", "prompts.jsonl", '{"prompt": "2+2?", "expected": "4"}\n{"prompt": "Capital?", "expected": "Paris"}\n')
    with pytest.raises(BadInput) as e:
        call_tool("write_eval_file", pc, "exp", "eval.yaml", "scorer: numeric\n")
    assert e.value.where == "eval/prompts.jsonl:2: expected"
    assert not (ws.eval_dir("exp") / "eval.yaml").exists()
    # the same row naming its own scorer is fine, and rows inherit the default's options
    call_tool("write_eval_file", pc, "exp", "prompts.jsonl", '{"prompt": "2+2?", "expected": "4"}\n{"prompt": "Capital?", "expected": "Paris", "scorer": "contains"}\n')
    call_tool("write_eval_file", pc, "exp", "eval.yaml", "scorer: {name: numeric, tolerance: 0.5}\nthresholds: {max_kl: 0.2, max_perplexity_ratio: 1.1}\n")
    suite = eval_suite.load_suite(ws.eval_dir("exp"))
    assert [s.label() for s in suite["scorers"]] == ["numeric(tolerance=0.5)", "contains"]
    # a line naming the default's scorer without its required option takes the default's; with no such default it is refused
    call_tool("write_eval_file", pc, "exp", "eval.yaml", "scorer: {name: regex, pattern: 'is (\\w+)'}\n")
    call_tool("write_eval_file", pc, "exp", "prompts.jsonl", '{"prompt": "Capital?", "expected": "Paris", "scorer": {"name": "regex", "ignore_case": false}}\n')
    assert eval_suite.load_suite(ws.eval_dir("exp"))["scorers"][0].options == {"pattern": "is (\\w+)", "ignore_case": False}
    with pytest.raises(BadInput) as e:
        call_tool("write_eval_file", pc, "exp", "eval.yaml", "scorer: contains\n")
    assert e.value.where == "eval/prompts.jsonl:1: scorer.pattern"
    # without drift.jsonl the shipped general prompts serve; the shipped text has its licence beside it
    assert suite["drift_source"] == "shipped general-prompts.jsonl" and len(suite["drift_prompts"]) == 12
    licence = (eval_suite.GENERAL_TEXT.parent / "general-text.LICENSE.md").read_text()
    assert licence.startswith("# general-text.txt: source and licence") and "**Licence: public domain.**" in licence


def test_write_eval_file_stays_in_eval_and_leaves_nothing_on_bad_input(ws_root):
    ws = Workspace.from_env()
    (ws.experiments_dir / "exp").mkdir(parents=True)
    pc = PhaseContext.for_role("eval-engineer")
    res = call_tool("write_eval_file", pc, "exp", "eval/prompts.jsonl", '{"prompt": "a", "expected": "b"}\n')
    assert res.path == str((ws.root / "eval" / "exp" / "prompts.jsonl").resolve()) and "1 rows" in res.summary
    with pytest.raises(BadInput):
        call_tool("write_eval_file", pc, "exp", "drift.jsonl", "{oops\n")
    assert not (ws.eval_dir("exp") / "drift.jsonl").exists()
    assert not list(ws.eval_dir("exp").glob(".*tmp"))
    # reports/, results/ and git's own files are evaluate_checkpoint's and git's, never write_eval_file's
    for rel in ("results/20260101-0000-a.json", "reports/x.md", ".git/config", ".gitignore"):
        with pytest.raises(BadInput, match="is not a suite file"):
            call_tool("write_eval_file", pc, "exp", rel, "{}")
    (ws.eval_dir("exp") / "out").symlink_to(ws.experiments_dir / "exp")
    with pytest.raises(Forbidden):
        call_tool("write_eval_file", pc, "exp", "out/train.py", "x")
    assert not (ws.experiments_dir / "exp" / "train.py").exists()


def test_suite_is_its_own_repository_outside_the_experiments_one(ws_root):
    """The suite's history never enters the experiments repository, whose objects the training side could read."""
    import subprocess

    from finetune_mcp.workspace import ensure_repo

    ws = Workspace.from_env()
    ensure_repo(ws.experiments_repo)
    (ws.experiments_dir / "exp").mkdir(parents=True)
    pc = PhaseContext.for_role("eval-engineer")
    res = call_tool("write_eval_file", pc, "exp", "prompts.jsonl", '{"prompt": "a", "expected": "b"}\n')
    d = ws.eval_dir("exp")
    assert "committed" in res.summary and (d / ".git").is_dir()
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and stat.S_IMODE(ws.eval_root.stat().st_mode) == 0o711

    def git(repo, *args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout

    assert git(d, "log", "--format=%s") .splitlines()[0] == "eval: exp/prompts.jsonl"
    assert "prompts.jsonl" in git(d, "ls-files")
    everything = git(ws.experiments_repo, "log", "--all", "--name-only", "--format=")
    assert "prompts.jsonl" not in everything and "eval" not in everything.split("/")
    assert "eval/" in (ws.experiments_repo / ".gitignore").read_text().splitlines()


def test_legacy_suite_inside_the_experiment_is_refused_with_the_move(ws_root):
    ws = Workspace.from_env()
    old = ws.experiments_dir / "exp" / "eval"
    old.mkdir(parents=True)
    (old / "prompts.jsonl").write_text('{"prompt": "a", "expected": "b"}\n')
    pc = PhaseContext.for_role("eval-engineer")
    with pytest.raises(Refused) as e:
        call_tool("write_eval_file", pc, "exp", "prompts.jsonl", '{"prompt": "a", "expected": "c"}\n')
    assert e.value.where == str(old) and "keeps its eval suite inside the experiment folder" in str(e.value)
    new = ws.eval_dir("exp")
    assert f"mkdir -p {new.parent} && mv {old} {new}" in e.value.fix
    assert f"git -C {ws.experiments_repo} rm -r -q --cached --ignore-unmatch trainings/exp/eval" in e.value.fix
    assert (old / "prompts.jsonl").read_text() == '{"prompt": "a", "expected": "b"}\n' and not new.exists()
    (ws.output_root / "exp" / "20260101-0000-a").mkdir(parents=True)
    with pytest.raises(Refused, match="keeps its eval suite inside"):
        call_tool("evaluate_checkpoint", pc, "exp/20260101-0000-a")
    # the move it names is the fix
    new.parent.mkdir(parents=True, exist_ok=True)
    old.rename(new)
    assert "1 rows" in call_tool("write_eval_file", pc, "exp", "prompts.jsonl", '{"prompt": "a", "expected": "c"}\n').summary


def _result(**over):
    m = {"task_accuracy": 0.9, "eval_loss": 0.5, "drift": {"kl": 0.2, "perplexity_ratio": 1.1, "changed_share": 0.5},
         "thresholds": {"min_accuracy": 0.8, "max_kl": 0.3, "max_perplexity_ratio": 1.2},
         "threshold_sources": {"min_accuracy": "brief ## Evaluation", "max_kl": "eval/eval.yaml", "max_perplexity_ratio": "eval/eval.yaml"},
         "goldens": [{"prompt": "p", "output": "a b", "golden": "a  b"}, {"prompt": "q", "output": "c"}]}
    m.update(over)
    return m


def test_checks_are_recomputed_from_figures_and_thresholds():
    assert verdicts.judge(_result()) == {"min_accuracy": True, "max_kl": True, "max_perplexity_ratio": True, "goldens": True}
    # a stored "passed" says nothing: only the figures count
    forged = _result(task_accuracy=0.1, passed={"min_accuracy": True, "max_kl": True, "max_perplexity_ratio": True})
    assert verdicts.judge(forged)["min_accuracy"] is False
    assert verdicts.check_text("min_accuracy", forged) == "min_accuracy (task accuracy 0.1000 < 0.8 from brief ## Evaluation)"
    assert verdicts.judge(_result(drift={"kl": 0.31, "perplexity_ratio": float("nan")}))["max_kl"] is False
    assert verdicts.judge(_result(drift={"kl": 0.1, "perplexity_ratio": float("nan")}))["max_perplexity_ratio"] is False  # NaN never passes
    assert verdicts.judge(_result(eval_loss=None, thresholds={"max_eval_loss": 1.0}))["max_eval_loss"] is False  # no figure, no pass
    assert verdicts.judge(_result(goldens=[{"prompt": "p", "output": "x", "golden": "y"}]))["goldens"] is False
    with pytest.raises(Refused, match="unknown threshold 'min_acc'"):
        verdicts.judge(_result(thresholds={"min_acc": 0.5}))


def test_signed_eval_result_verifies_only_untouched_and_with_this_key(ws_root):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    ws = Workspace.from_env()
    key = signing.load_or_create_private_key(ws)
    doc = signing.sign_block(key, {"run_id": "e/20260101-0000-a", **_result()}, signing.EVAL_SCHEMA)
    pub = signing.load_public_key(ws)
    assert verdicts.verify_evaluation(json.loads(json.dumps(doc)), pub, "r.json")["task_accuracy"] == 0.9
    with pytest.raises(signing.BadSignature, match="does not verify: it was written or edited after the eval role signed it"):
        verdicts.verify_evaluation({**doc, "task_accuracy": 0.95}, pub, "r.json")
    with pytest.raises(signing.BadSignature, match="not this workspace's eval key"):
        verdicts.verify_evaluation(signing.sign_block(Ed25519PrivateKey.generate(), {"x": 1}, signing.EVAL_SCHEMA), pub, "r.json")
    # a verdict block is not an evaluation, and the reverse
    with pytest.raises(signing.BadSignature, match="schema 'finetune-mcp/verdict/v1'"):
        verdicts.verify_evaluation(signing.sign_block(key, {"x": 1}), pub, "r.json")
    with pytest.raises(signing.BadSignature, match="malformed"):
        verdicts.verify_evaluation({k: v for k, v in doc.items() if k != "signature"}, pub, "r.json")
