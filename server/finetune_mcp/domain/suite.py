"""The eval suite of one experiment: where it lives, its own git repository, and its files read and checked.

The suite lives in $DGX_SPARK_ROOT/eval/<experiment>/, where only the eval role writes (helpers/GATE-LAYOUT.md),
as its own git repository, never part of the experiments repository (which the training side reads).
Files (written with write_eval_file; skills/eval-gate says how to read the figures):
  prompts.jsonl  required  {"prompt": text or [{role, content}...], "expected": text or [accepted answers],
                           "scorer": name or {"name", options} (optional; else the suite default)}   task accuracy
  goldens.jsonl  optional  {"prompt": ..., "output": text (optional)}   golden prompts; the outputs of the
                           adapter on them are recorded at evaluation, signed into the verdict, and
                           replayed by export's smoke test. With "output", the adapter must reproduce it.
                           Without goldens.jsonl the first prompts of prompts.jsonl serve.
  drift.jsonl    optional  {"prompt": ...}   general prompts for KL(base || tuned); else the shipped set
  eval.yaml      optional  thresholds (override the brief's ## Evaluation), scorer (suite default), max_new_tokens,
                           drift_max_new_tokens, batch_size, loss_data (prepared | prompts), max_loss_rows, goldens,
                           perplexity_text / perplexity_window / perplexity_max_tokens
Each evaluation writes eval/<experiment>/reports/<run tag>.md (the figures, and every prompt's base and fine-tuned
answers side by side) and eval/<experiment>/results/<run tag>.json (signed: domain/verdicts.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
from pathlib import Path
from typing import Any

import yaml

from finetune_mcp.common import scoring
from finetune_mcp.common.errors import BadInput, FtError, Refused
from finetune_mcp.context import PhaseContext
from finetune_mcp.workspace import Workspace, atomic_write_text, commit, git

EVAL_SKILL = "eval-gate"
EVAL_DIR = "eval"
REPORTS_DIR = "reports"
RESULTS_DIR = "results"
_DRIFT_DATA = Path(__file__).resolve().parents[1] / "drift"
GENERAL_TEXT = _DRIFT_DATA / "general-text.txt"
GENERAL_PROMPTS = _DRIFT_DATA / "general-prompts.jsonl"
SUITE_FILES = ("prompts.jsonl", "goldens.jsonl", "drift.jsonl", "eval.yaml")
# Written by evaluate_checkpoint, never by write_eval_file (nor a .git of the suite's repository).
MACHINE_PARTS = (REPORTS_DIR, RESULTS_DIR, ".git", ".gitignore")
MAX_EVAL_FILE = 5 * 1024 * 1024
THRESHOLD_KEYS = {
    "min_accuracy": "task accuracy",
    "max_eval_loss": "eval loss",
    "max_kl": "mean per-token KL(base || tuned) on general prompts",
    "max_perplexity_ratio": "perplexity ratio (tuned / base) on a general text",
    "max_drift": "share of general prompts whose greedy answer changed",
}
# A PROMOTE needs a bar for harm: each of these set, or waived on purpose (null in eval/eval.yaml).
DRIFT_THRESHOLDS = ("max_kl", "max_perplexity_ratio")
EVAL_YAML_KEYS = {"thresholds", "scorer", "match", "max_new_tokens", "drift_max_new_tokens", "batch_size", "loss_data", "max_loss_rows",
                  "goldens", "perplexity_text", "perplexity_window", "perplexity_max_tokens"}
MIN_GOLDENS, MAX_GOLDENS = 3, 5


# ---------------------------------------------------------------- where the suite lives


def refuse_legacy_eval(ws: Workspace, experiment: str) -> None:
    """A suite still inside the experiment (made before the suite moved out) sits where the training side reads
    and rewrites it, and in the experiments repository's history: refused, with the move that fixes it."""
    old = ws.legacy_eval_dir(experiment)
    if not os.path.lexists(old):
        return
    new = ws.eval_dir(experiment)
    rel = old.relative_to(ws.experiments_repo).as_posix()
    q = shlex.quote
    raise Refused(
        f"experiment {experiment} keeps its eval suite inside the experiment folder ({old}), where the training side can read "
        f"and replace it; the suite now lives in {new}",
        where=str(old),
        fix=f"move it (the eval role's place, its own git repository) and drop it from the experiments repository: "
            f"`mkdir -p {q(str(new.parent))} && mv {q(str(old))} {q(str(new))}` (if {new} exists, move the files into it one by one), "
            f"then `git -C {q(str(ws.experiments_repo))} rm -r -q --cached --ignore-unmatch {q(rel)}` and commit; delete the old "
            f"<run>/eval-report.md files too (they quote the suite). As root, `finetune-mcp setup-roles` makes the move.",
    )


def suite_dir(pc: PhaseContext, experiment: str) -> Path:
    """eval/<experiment>/ of an existing experiment, once no legacy suite is left inside the experiment."""
    pc.ws.experiment_dir(experiment)
    refuse_legacy_eval(pc.ws, experiment)
    return pc.ws.eval_dir(experiment)


def ensure_eval_repo(d: Path) -> Path:
    """The suite's own git repository: its history holds the expected answers, so it never joins the experiments
    repository. eval/ is 0711 and each suite 0700 when made here (setup-roles gives them to the eval user)."""
    root = d.parent
    if not root.exists():
        root.mkdir(mode=0o711, parents=True, exist_ok=True)
    d.mkdir(mode=0o700, exist_ok=True)
    if not (d / ".git").exists():
        git(d, "init", "-q", "-b", "main")
        atomic_write_text(d / ".gitignore", "# the eval suite of one experiment: the eval role's own repository\n.*.tmp\n")
        git(d, "add", ".gitignore")
        git(d, "commit", "-q", "-m", f"Initialise the eval suite of {d.name}")
    return d


def commit_eval(d: Path, paths: list[Path], message: str) -> str | None:
    """Commit into the suite's repository; None where git cannot (the files stand uncommitted, the next commit takes them)."""
    try:
        ensure_eval_repo(d)
        return commit(d, paths, message)
    except (FtError, ValueError, OSError):
        return None


# ---------------------------------------------------------------- suite files


class Rows(list):
    """The rows of a suite file, with the line each came from (for messages that name it)."""

    def __init__(self, rows=(), lines=()):
        super().__init__(rows)
        self.lines = list(lines)


def _jsonl(text: str, name: str, required: tuple[str, ...], optional: tuple[str, ...]) -> Rows:
    rows = Rows()
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"eval/{name}:{i}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadInput(f"eval/{name} line {i} is not JSON: {e.msg}", where=where, fix="one JSON object per line") from None
        if not isinstance(row, dict):
            raise BadInput(f"eval/{name} line {i} is not a JSON object", where=where)
        for k in required:
            if k not in row:
                raise BadInput(f"eval/{name} line {i} lacks field {k!r}", where=f"{where}: {k}",
                               fix=f"each line of {name} is {{{', '.join(repr(x) for x in required + optional)}}}")
        extra = set(row) - set(required) - set(optional) - {"id", "note"}
        if extra:
            raise BadInput(f"eval/{name} line {i} has unknown field(s) {sorted(extra)}", where=where,
                           fix=f"allowed: {', '.join(required + optional)}, id, note")
        p = row.get("prompt")
        if not (isinstance(p, str) and p.strip()) and not (
            isinstance(p, list) and p and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in p)
        ):
            raise BadInput(f"eval/{name} line {i}: prompt must be non-empty text or a list of {{role, content}} messages",
                           where=f"{where}: prompt")
        if "output" in row and row["output"] is not None and not isinstance(row["output"], str):
            raise BadInput(f"eval/{name} line {i}: output must be text", where=f"{where}: output")
        if "expected" in row:
            e = row["expected"]
            if not (isinstance(e, str) or (isinstance(e, list) and e and all(isinstance(x, str) and x.strip() for x in e))):
                raise BadInput(f"eval/{name} line {i}: expected must be text or a non-empty list of accepted answers (texts)",
                               where=f"{where}: expected", fix='e.g. "expected": "Paris" or "expected": ["Paris", "paris, France"]')
        if "scorer" in row:
            # Options it leaves out may come from the suite default (eval.yaml): resolve_scorers completes it.
            row_spec = scoring.parse_spec(row["scorer"], f"{where}: scorer", complete=False)
            scoring.check_expected(row_spec, scoring.accepted(row["expected"]), f"{where}: expected")
        rows.append(row)
        rows.lines.append(i)
    return rows


def _eval_yaml(text: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        raise BadInput(f"eval/eval.yaml is not valid YAML: {e}", where="eval/eval.yaml" + (f":{line + 1}" if line is not None else "")) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise BadInput("eval/eval.yaml must be a mapping", where="eval/eval.yaml")
    unknown = set(data) - EVAL_YAML_KEYS
    if unknown:
        k = sorted(unknown)[0]
        raise BadInput(f"eval/eval.yaml has unknown key(s) {sorted(unknown)}{scoring.did_you_mean(k, EVAL_YAML_KEYS) if len(unknown) == 1 else ''}",
                       where="eval/eval.yaml", fix=f"allowed: {', '.join(sorted(EVAL_YAML_KEYS))}")
    th = data.get("thresholds") or {}
    if not isinstance(th, dict):
        raise BadInput("eval/eval.yaml thresholds must be a mapping", where="eval/eval.yaml: thresholds")
    for k, v in th.items():
        if k not in THRESHOLD_KEYS:
            raise BadInput(f"eval/eval.yaml thresholds.{k} is not a threshold{scoring.did_you_mean(k, THRESHOLD_KEYS)}",
                           where=f"eval/eval.yaml: thresholds.{k}", fix=f"thresholds: {', '.join(THRESHOLD_KEYS)}")
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)):
            raise BadInput(f"eval/eval.yaml thresholds.{k} must be a number (or null to waive it)", where=f"eval/eval.yaml: thresholds.{k}")
    if "match" in data and "scorer" in data:
        raise BadInput("eval/eval.yaml sets both match and scorer", where="eval/eval.yaml: match", fix="keep scorer (match is its older name)")
    if "match" in data and data["match"] not in ("exact", "first_line"):
        raise BadInput("eval/eval.yaml match must be exact or first_line", where="eval/eval.yaml: match",
                       fix=f"for other scorers use scorer: one of {', '.join(scoring.SCORERS)}")
    data["scorer_spec"] = scoring.parse_spec(data.get("scorer", data.get("match", scoring.DEFAULT_SCORER)), "eval/eval.yaml: scorer")
    if data.get("loss_data", "prepared") not in ("prepared", "prompts"):
        raise BadInput("eval/eval.yaml loss_data must be prepared or prompts", where="eval/eval.yaml: loss_data")
    for k, lo, hi in (("max_new_tokens", 1, 4096), ("drift_max_new_tokens", 1, 4096), ("max_loss_rows", 1, 100000),
                      ("goldens", MIN_GOLDENS, MAX_GOLDENS), ("batch_size", 1, 1024), ("perplexity_window", 16, 32768),
                      ("perplexity_max_tokens", 16, 1_000_000)):
        v = data.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi):
            raise BadInput(f"eval/eval.yaml {k} must be an integer from {lo} to {hi}", where=f"eval/eval.yaml: {k}")
    pt = data.get("perplexity_text")
    if pt is not None and (not isinstance(pt, str) or not pt or "/" in pt or "\\" in pt or pt.startswith(".") or pt in SUITE_FILES):
        raise BadInput("eval/eval.yaml perplexity_text must name a text file directly inside eval/ (or be left out for the shipped text)",
                       where="eval/eval.yaml: perplexity_text", fix="e.g. perplexity_text: general.txt, written with write_eval_file")
    return data


def validate_suite_file(name: str, text: str) -> Any:
    if name == "prompts.jsonl":
        return _jsonl(text, name, ("prompt", "expected"), ("scorer",))
    if name == "goldens.jsonl":
        return _jsonl(text, name, ("prompt",), ("output",))
    if name == "drift.jsonl":
        return _jsonl(text, name, ("prompt",), ())
    if name == "eval.yaml":
        return _eval_yaml(text)
    return None


def resolve_scorers(prompts: Rows, opts: dict[str, Any]) -> list[scoring.ScorerSpec]:
    """Each prompt's scorer: its own (options it leaves out come from the suite default when it names the same
    scorer), else the suite default; accepted answers checked against the scorer that will use them."""
    default = opts.get("scorer_spec") or scoring.parse_spec(scoring.DEFAULT_SCORER, "eval/eval.yaml: scorer")
    specs = []
    for row, line in zip(prompts, prompts.lines or [None] * len(prompts)):
        where = f"eval/prompts.jsonl:{line}" if line else "eval/prompts.jsonl"
        spec = scoring.parse_spec(row["scorer"], f"{where}: scorer", inherit=default) if "scorer" in row else default
        scoring.check_expected(spec, scoring.accepted(row["expected"]), f"{where}: expected")
        specs.append(spec)
    return specs


def load_suite(d: Path) -> dict[str, Any]:
    """The suite in d (eval/<experiment>/): only its suite files are read, never reports/ or results/."""
    if not (d / "prompts.jsonl").is_file():
        raise Refused(
            f"experiment {d.name} has no eval suite (eval/prompts.jsonl is missing)",
            where=str(d),
            fix="write it with write_eval_file: prompts.jsonl lines {\"prompt\", \"expected\"}; optionally goldens.jsonl, drift.jsonl, eval.yaml",
        )
    texts = {n: (d / n).read_text(encoding="utf-8") for n in SUITE_FILES if (d / n).is_file()}
    suite = {n: validate_suite_file(n, t) for n, t in texts.items()}
    if not suite["prompts.jsonl"]:
        raise Refused("eval/prompts.jsonl has no rows", where=str(d / "prompts.jsonl"), fix="add at least one {\"prompt\", \"expected\"} line")
    opts = suite.get("eval.yaml") or {}
    suite["scorers"] = resolve_scorers(suite["prompts.jsonl"], opts)
    pt = opts.get("perplexity_text")
    if pt:
        if not (d / pt).is_file():
            raise Refused(f"eval/eval.yaml names perplexity_text {pt!r}, which is not in eval/", where=str(d / pt),
                          fix="write it with write_eval_file, or drop perplexity_text to use the shipped public-domain text")
        texts[pt] = (d / pt).read_text(encoding="utf-8")
        suite["general_text"], suite["general_text_source"] = texts[pt], f"eval/{pt}"
    else:
        suite["general_text"], suite["general_text_source"] = GENERAL_TEXT.read_text(encoding="utf-8"), f"shipped {GENERAL_TEXT.name} (public domain)"
    if suite.get("drift.jsonl"):
        suite["drift_prompts"], suite["drift_source"] = suite["drift.jsonl"], "eval/drift.jsonl"
    else:
        suite["drift_prompts"] = validate_suite_file("drift.jsonl", GENERAL_PROMPTS.read_text(encoding="utf-8"))
        suite["drift_source"] = f"shipped {GENERAL_PROMPTS.name}"
    h = hashlib.sha256()
    for n in sorted(texts):
        h.update(n.encode() + b"\0" + hashlib.sha256(texts[n].encode()).hexdigest().encode() + b"\n")
    suite["sha256"] = h.hexdigest()
    suite["files"] = sorted(texts)
    return suite


def suite_thresholds(brief, suite: dict[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """The thresholds an evaluation is judged against and where each came from: the brief's ## Evaluation, then
    eval/eval.yaml (which overrides it, or clears a bar with null)."""
    values: dict[str, float] = {}
    source: dict[str, str] = {}
    for k in THRESHOLD_KEYS:
        v = (brief.evaluation or {}).get(k) if brief else None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            values[k], source[k] = float(v), "brief ## Evaluation"
    for k, v in ((suite.get("eval.yaml") or {}).get("thresholds") or {}).items():
        if v is None:
            values.pop(k, None)
            source[k] = "eval/eval.yaml (cleared)"
        else:
            values[k], source[k] = float(v), "eval/eval.yaml"
    return values, source
