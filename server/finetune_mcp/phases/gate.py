"""Phase 5, the eval engineer's gate: the eval/ suite, evaluate_checkpoint, and the signed PROMOTE/REJECT verdict.

Everything here lives where only the eval role writes (helpers/GATE-LAYOUT.md): the suite in
$DGX_SPARK_ROOT/eval/<experiment>/ (its own git repository, never part of the experiments repository, which the
training side reads), the eval report in its reports/<run>.md, the signed evaluation result in its results/<run>.json,
and the signed verdict in $DGX_SPARK_ROOT/verdicts/<experiment>/<run>/promotion-report.md (world-readable: export
verifies it, and the evaluation it embeds, with the public key alone). Nothing is written into the run folder.

Eval suite (files in eval/<experiment>/, written with write_eval_file; skills/eval-gate says how to read the figures):
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
answers side by side) and eval/<experiment>/results/<run tag>.json (the figures, thresholds, checks, adapter, suite and
base model digests, goldens: signed with the eval key). record_verdict recomputes every check from that signed result.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import unicodedata
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from finetune_mcp import schemas as S
from finetune_mcp import scoring
from finetune_mcp.context import PhaseContext
from finetune_mcp.digest import DIGEST_FILE, folder_digest, verify_folder
from finetune_mcp.errors import BadInput, Forbidden, FtError, NotFound, Refused
from finetune_mcp.workspace import Workspace, atomic_write_text, git, parse_run_ref, utc_now

SKILL = "quantized-export"
EVAL_SKILL = "eval-gate"
EVAL_DIR = "eval"
REPORTS_DIR = "reports"
RESULTS_DIR = "results"
_DRIFT_DATA = Path(__file__).resolve().parents[1] / "drift"
GENERAL_TEXT = _DRIFT_DATA / "general-text.txt"
GENERAL_PROMPTS = _DRIFT_DATA / "general-prompts.jsonl"
SUITE_FILES = ("prompts.jsonl", "goldens.jsonl", "drift.jsonl", "eval.yaml")
PROMOTION_REPORT = "promotion-report.md"
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


# ---------------------------------------------------------------- run facts (shared with export)


def run_paths(pc: PhaseContext, run_id: str) -> tuple[str, Path, Path]:
    """(experiment, run dir, experiment dir) for '<experiment>/<run-id>'."""
    experiment, _ = parse_run_ref(run_id)
    r = pc.ws.run_dir(run_id)
    return experiment, r, pc.ws.experiments_dir / experiment


def adapter_digest(r: Path, run_id: str) -> str:
    """The digest of the run's adapter/, refusing when it is missing or does not match its DIGEST."""
    adapter = r / "adapter"
    if not (adapter / "adapter_config.json").is_file():
        raise Refused(
            f"run {run_id} has no adapter yet",
            where=str(adapter),
            fix="wait until poll_progress reports the run succeeded; train.py writes adapter/ with its DIGEST at the end",
        )
    ok, actual, recorded = verify_folder(adapter)
    if not ok:
        why = "has no DIGEST file" if recorded is None else f"does not match its DIGEST (recorded {recorded[:12]}…, now {actual[:12]}…)"
        raise Refused(
            f"adapter/ of run {run_id} {why}: its files changed after training wrote them",
            where=str(adapter / DIGEST_FILE),
            fix="do not edit adapter/; relaunch the run to produce a fresh adapter",
        )
    return actual


def load_run_brief(r: Path, e: Path):
    """The brief as launched (the run's copy), else the experiment's."""
    from finetune_mcp.phases.brief import load_brief

    for p in (r / "training-brief.md", e / "training-brief.md"):
        if p.is_file():
            return load_brief(p)
    raise NotFound("no training-brief.md in the run or its experiment", where=str(r), fix="launch runs through launch_run, which copies the brief into the run")


def read_config(r: Path) -> dict[str, Any]:
    p = r / "config.yaml"
    if not p.is_file():
        return {}
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise BadInput(f"config.yaml of the run is not valid YAML: {e}", where=str(p)) from None
    return data if isinstance(data, dict) else {}


def base_model_of(pc: PhaseContext, r: Path, brief) -> str:
    """The base model the adapter was trained on: PEFT records it in adapter_config.json; the run config names it too."""
    cfg = json.loads((r / "adapter" / "adapter_config.json").read_text(encoding="utf-8"))
    name = cfg.get("base_model_name_or_path") or ""
    if name and Path(name).is_dir():
        return name
    model = read_config(r).get("model")
    if isinstance(model, dict) and isinstance(model.get("path"), str) and Path(model["path"]).is_dir():
        return model["path"]
    for cand in (name, brief.base_model if brief else ""):
        if cand and (pc.ws.base_models_dir / cand).is_dir():
            return str(pc.ws.base_models_dir / cand)
    if name:
        return name  # an HF id; the worker resolves it from the local cache only
    if brief:
        return brief.base_model
    raise NotFound("cannot tell which base model the adapter belongs to", where=str(r / "adapter" / "adapter_config.json"))


def prepared_eval_split(pc: PhaseContext, config: dict[str, Any]) -> Path | None:
    """The prepared eval split named by the run config (any value naming an eval .jsonl or a dataset folder)."""
    data = config.get("data")
    if isinstance(data, dict) and isinstance(data.get("dir"), str) and isinstance(data.get("eval"), str):
        p = Path(data["dir"]) / data["eval"]
        if p.is_file():
            return p
    found: list[Path] = []

    def walk(x: Any, key: str = "") -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, str(k))
        elif isinstance(x, list):
            for v in x:
                walk(v, key)
        elif isinstance(x, str) and x and len(x) < 4096:
            p = Path(x).expanduser()
            if not p.is_absolute():
                p = pc.ws.datasets_dir / x if key in ("dataset", "dataset_name", "name") else pc.ws.root / x
            if p.is_file() and p.name.endswith(".jsonl") and "eval" in p.name:
                found.append(p)
            elif p.is_dir() and (p / "eval.jsonl").is_file():
                found.append(p / "eval.jsonl")

    walk(config)
    return found[0] if found else None


def append_roadbook(pc: PhaseContext, r: Path, line: str) -> None:
    """One line per lifecycle event, under the run's lock; skipped quietly where the role may not write the roadbook."""
    from finetune_mcp import roadbook

    roadbook.append(pc.guard, r, line)


def base_model_identity(pc: PhaseContext, r: Path, brief) -> dict[str, Any]:
    """What the adapter was evaluated on: the name, and for a local folder its path and digest (an HF cache
    snapshot's folder name is its revision). Signed into the result; export requires the same model under it."""
    name = base_model_of(pc, r, brief)
    out: dict[str, Any] = {"name": name}
    p = Path(name)
    if p.is_dir():
        real = p.resolve()
        out["path"] = str(real)
        out["sha256"] = folder_digest(real)
        if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
            out["revision"] = real.name
    return out


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
    from finetune_mcp.workspace import commit

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


# ---------------------------------------------------------------- write_eval_file


def write_eval_file(pc: PhaseContext, experiment: str, relpath: str, content: str) -> S.WriteEvalFileResult:
    eval_dir = suite_dir(pc, experiment)
    if not isinstance(relpath, str) or not relpath.strip():
        raise BadInput("relpath is empty", where="relpath", fix="name a file inside eval/, e.g. prompts.jsonl")
    rel = PurePosixPath(relpath.replace("\\", "/"))
    if rel.is_absolute() or any(p in ("..", ".", "") for p in rel.parts) or "\x00" in relpath:
        raise BadInput(f"relpath {relpath!r} must be a plain relative path inside eval/", where="relpath", fix="e.g. prompts.jsonl or cases/extra.jsonl")
    if rel.parts[0] == EVAL_DIR:
        rel = PurePosixPath(*rel.parts[1:]) if len(rel.parts) > 1 else rel
    if rel.parts[0] in MACHINE_PARTS:
        raise BadInput(f"relpath {relpath!r} is not a suite file: {rel.parts[0]} is written by evaluate_checkpoint (and git) only",
                       where="relpath", fix="write suite files: prompts.jsonl, goldens.jsonl, drift.jsonl, eval.yaml, or a text eval.yaml names")
    if len(content.encode("utf-8")) > MAX_EVAL_FILE:
        raise BadInput(f"content is larger than {MAX_EVAL_FILE // (1024 * 1024)} MiB", where="content")
    target = pc.guard.check_write(eval_dir / rel, "relpath")
    real_eval = Path(os.path.realpath(eval_dir))
    if not target.is_relative_to(real_eval):
        raise Forbidden(f"relpath {relpath!r} resolves outside the experiment's eval/", where=str(target))
    rows = validate_suite_file(rel.name, content) if len(rel.parts) == 1 else None
    if len(rel.parts) == 1 and rel.name in ("prompts.jsonl", "eval.yaml"):
        # The suite default scorer decides what an accepted answer must look like (numbers for numeric):
        # check the pair as it will stand, before anything is written.
        other = eval_dir / ("eval.yaml" if rel.name == "prompts.jsonl" else "prompts.jsonl")
        if other.is_file():
            texts = {rel.name: content, other.name: other.read_text(encoding="utf-8")}
            resolve_scorers(validate_suite_file("prompts.jsonl", texts["prompts.jsonl"]), validate_suite_file("eval.yaml", texts["eval.yaml"]))
    ensure_eval_repo(eval_dir)
    pc.guard.write_text(target, content)
    committed = commit_eval(eval_dir, [target], f"eval: {experiment}/{rel}")
    what = f"{len(rows)} rows" if isinstance(rows, list) else ("validated" if rows is not None else "written")
    return S.WriteEvalFileResult(
        summary=f"wrote {experiment}/{EVAL_DIR}/{rel} ({what}{', committed ' + committed[:10] if committed else ''})",
        path=str(target),
        bytes=len(content.encode("utf-8")),
    )


# ---------------------------------------------------------------- evaluate_checkpoint


def _thresholds(brief, suite: dict[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
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


EVAL_FIX = "ask the eval engineer to run evaluate_checkpoint again: only it writes (and signs) an evaluation result"


def verify_evaluation(doc: Any, public_key, where: str) -> dict[str, Any]:
    """The payload of a signed evaluation result, or BadSignature (a result edited, forged, or signed elsewhere)."""
    from finetune_mcp import signing

    return signing.verify_signed(doc, public_key, signing.EVAL_SCHEMA, where, f"the evaluation result {Path(where).name}", EVAL_FIX)


def load_eval_document(ws: Workspace, run_id: str, public_key=None) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(the signed document as stored, its verified payload) of run_id's evaluation, None when there is none.
    Eval role only: the file is eval-owned."""
    from finetune_mcp import signing

    experiment, _ = parse_run_ref(run_id)
    p = ws.eval_result_path(experiment, run_id)
    if not p.is_file():
        return None
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise signing.BadSignature(f"the evaluation result {p.name} is not valid JSON ({e})", where=str(p), fix=EVAL_FIX) from None
    return doc, verify_evaluation(doc, public_key or signing.load_public_key(ws), str(p))


def read_eval_result(ws: Workspace, run_id: str, public_key=None) -> dict[str, Any] | None:
    """The verified payload of run_id's signed evaluation, None when there is none."""
    got = load_eval_document(ws, run_id, public_key)
    return got[1] if got else None


def measured(m: dict[str, Any]) -> dict[str, Any]:
    """The figure each threshold bounds."""
    d = m.get("drift") if isinstance(m.get("drift"), dict) else {}
    return {"min_accuracy": m.get("task_accuracy"), "max_eval_loss": m.get("eval_loss"), "max_kl": d.get("kl"),
            "max_perplexity_ratio": d.get("perplexity_ratio"), "max_drift": d.get("changed_share")}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def judge(m: dict[str, Any]) -> dict[str, bool]:
    """Every check's pass/fail, from the figures and thresholds alone (a stored pass/fail is never taken as it stands)."""
    figures = measured(m)
    passed: dict[str, bool] = {}
    for k, limit in (m.get("thresholds") or {}).items():
        if k not in THRESHOLD_KEYS:
            raise Refused(f"the evaluation carries an unknown threshold {k!r}", fix=EVAL_FIX)
        v = figures[k]
        passed[k] = _number(v) and _number(limit) and (v >= limit if k.startswith("min_") else v <= limit)
    checked = [g for g in m.get("goldens") or [] if isinstance(g, dict) and g.get("golden") is not None]
    if checked:
        passed["goldens"] = all(scoring.collapse(str(g.get("output"))) == scoring.collapse(str(g["golden"])) for g in checked)
    return passed


def check_text(k: str, m: dict[str, Any]) -> str:
    """One failed check in words: figure, bar and its source."""
    if k == "goldens":
        bad = sum(1 for g in m.get("goldens") or [] if g.get("golden") is not None
                  and scoring.collapse(str(g.get("output"))) != scoring.collapse(str(g["golden"])))
        return f"goldens ({bad} golden output(s) not reproduced)"
    v, limit = measured(m).get(k), (m.get("thresholds") or {}).get(k)
    op = "<" if k.startswith("min_") else ">"
    bar = format(limit, "g") if _number(limit) else repr(limit)
    return f"{k} ({THRESHOLD_KEYS[k]} {_fmt(v)} {op} {bar} from {(m.get('threshold_sources') or {}).get(k, '?')})"


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def _prompt_text(p: Any) -> str:
    if isinstance(p, str):
        return p
    return " | ".join(f"{m['role']}: {m['content']}" for m in p)


def _cell(s: Any, n: int = 80) -> str:
    """One markdown table cell: newlines and pipes kept from breaking the row, control characters shown escaped."""
    s = str(s).replace("\n", "⏎").replace("|", "\\|")
    s = "".join(c if unicodedata.category(c) != "Cc" else f"\\x{ord(c):02x}" for c in s)
    return s if len(s) <= n else s[: n - 1] + "…"


def evaluate_checkpoint(pc: PhaseContext, run_id: str) -> S.EvalResult:
    from finetune_mcp.worker import prewarm, run_job

    from finetune_mcp import signing

    if not pc.policy.may_sign_verdicts:
        raise Forbidden(f"the {pc.role} role may not evaluate", fix="evaluations come from the eval-engineer server")
    experiment, r, e = run_paths(pc, run_id)
    d = suite_dir(pc, experiment)
    digest = adapter_digest(r, run_id)
    prewarm()
    suite = load_suite(d)
    brief = load_run_brief(r, e)
    base = base_model_identity(pc, r, brief)
    thresholds, th_source = _thresholds(brief, suite)
    opts = suite.get("eval.yaml") or {}
    n_gold = int(opts.get("goldens") or MAX_GOLDENS)
    goldens = suite.get("goldens.jsonl") or [{"prompt": p["prompt"]} for p in suite["prompts.jsonl"][:n_gold]]

    config = read_config(r)
    loss_file = None
    loss_rows = None
    loss_source = "eval/prompts.jsonl (prompt -> expected)"
    if opts.get("loss_data", "prepared") == "prepared":
        split = prepared_eval_split(pc, config)
        if split is not None:
            loss_file, loss_source = str(split), f"prepared eval split {split}"
    if loss_file is None:
        loss_rows = [{"prompt": p["prompt"], "expected": p["expected"]} for p in suite["prompts.jsonl"]]

    params = {
        "base_model": base["name"],
        "adapter_dir": str(r / "adapter"),
        "prompts": [{"prompt": row["prompt"], "expected": scoring.accepted(row["expected"]), "scorer": spec.to_json()}
                    for row, spec in zip(suite["prompts.jsonl"], suite["scorers"])],
        "goldens": goldens,
        "drift": [{"prompt": d["prompt"]} for d in suite["drift_prompts"]],
        "general_text": suite["general_text"],
        "perplexity_window": opts.get("perplexity_window"),
        "perplexity_max_tokens": opts.get("perplexity_max_tokens"),
        "loss_file": loss_file,
        "loss_rows": loss_rows,
        "max_loss_rows": opts.get("max_loss_rows"),
        "max_new_tokens": opts.get("max_new_tokens"),
        "drift_max_new_tokens": opts.get("drift_max_new_tokens"),
        "batch_size": opts.get("batch_size"),
        "max_length": brief.max_seq_length if brief else None,
    }
    res = run_job("evaluate", params, progress=pc.progress, timeout=3600)
    # The adapter must be the one that was evaluated, down to the byte.
    if adapter_digest(r, run_id) != digest:
        raise Refused("adapter/ changed while it was being evaluated", where=str(r / "adapter"), fix="call evaluate_checkpoint again")

    ppl = res.get("perplexity") or {}
    drift = {
        "kl": res.get("kl"),
        "perplexity_ratio": ppl.get("ratio"),
        "perplexity_base": ppl.get("base"),
        "perplexity_tuned": ppl.get("tuned"),
        "changed_share": res.get("changed_share"),
        "prompts": len(res.get("drift_items") or []),
        "kl_tokens": res.get("kl_tokens"),
        "perplexity_tokens": ppl.get("tokens"),
        "prompts_source": suite["drift_source"],
        "text_source": suite["general_text_source"],
    }
    unset = [k for k in DRIFT_THRESHOLDS if k not in thresholds and k not in th_source]

    evaluated_at = utc_now()
    scorers: dict[str, int] = {}
    for it in res["items"]:
        scorers[it["scorer_label"]] = scorers.get(it["scorer_label"], 0) + 1
    report_path = pc.ws.eval_report_path(experiment, run_id)
    result_path = pc.ws.eval_result_path(experiment, run_id)
    machine = {
        "run_id": run_id,
        "experiment": experiment,
        "adapter_sha256": digest,
        "base_model": base,
        "suite_sha256": suite["sha256"],
        "suite_files": suite["files"],
        "evaluated_at": evaluated_at,
        "task_accuracy": res.get("task_accuracy"),
        "base_accuracy": res.get("base_accuracy"),
        "scorers": scorers,
        "side_by_side": res.get("side_by_side"),
        "eval_loss": res.get("eval_loss"),
        "base_eval_loss": res.get("base_eval_loss"),
        "drift": drift,
        "golden_match": res.get("golden_match"),
        "thresholds": thresholds,
        "threshold_sources": th_source,
        "drift_thresholds_unset": unset,
        "max_new_tokens": res.get("max_new_tokens"),
        "drift_max_new_tokens": res.get("drift_max_new_tokens"),
        "batch_size": res.get("batch_size"),
        # what export replays (prompt, output) and, where the suite gave one, the output it had to reproduce
        "goldens": [{"prompt": g["prompt"], "output": g["output"], **({"golden": g["golden"]} if "golden" in g else {})} for g in res["goldens"]],
        "loss_source": loss_source,
        "loss_rows": res.get("loss_rows"),
        "report": str(report_path),
        "versions": res.get("versions"),
        # the fine-tuned passes ran on base + adapter merged (the same model, one matmul per layer), or why not
        "adapter_merged": res.get("adapter_merged"),
        **({"unmerged_because": res["unmerged_because"]} if res.get("unmerged_because") else {}),
        "timings_s": res.get("timings"),
    }
    machine["passed"] = passed = judge(machine)
    # Signed as it is written: record_verdict and export trust these figures only with the eval key's signature.
    signed = signing.sign_block(signing.load_or_create_private_key(pc.ws), {**machine, "signed_at": utc_now()}, signing.EVAL_SCHEMA)
    ensure_eval_repo(d)
    pc.guard.write_text(report_path, _eval_report(run_id, machine, res) + "\n" + _side_by_side_report(run_id, machine, res))
    pc.guard.write_text(result_path, json.dumps(signed, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    commit_eval(d, [report_path, result_path], f"eval: {experiment} {run_id.split('/', 1)[1]}")

    failed = [k for k, ok in passed.items() if not ok]
    n = len(res["items"])
    sbs = res.get("side_by_side") or {}
    summary = (
        f"{run_id}: task accuracy {_fmt(res.get('task_accuracy'))} (base {_fmt(res.get('base_accuracy'))}) on {n} prompts "
        f"[{', '.join(f'{k} x{v}' for k, v in scorers.items())}]: {sbs.get('improved', 0)} improved, {sbs.get('regressed', 0)} regressed, "
        f"{sbs.get('unchanged', 0)} unchanged; eval loss {_fmt(res.get('eval_loss'))}; drift KL {_fmt(drift['kl'])} nats/token, "
        f"perplexity ratio {_fmt(drift['perplexity_ratio'])}; "
        + (f"FAILS {', '.join(failed)}" if failed else ("passes every threshold" if passed else "no thresholds set"))
        + (f"; no threshold set for {', '.join(unset)} (a PROMOTE needs one)" if unset else "")
    )
    details: list[dict[str, Any]] = []
    for di in res.get("drift_items") or []:
        if di["changed"] and len(details) < 10:
            details.append({"kind": "drift", "prompt": di["prompt"], "base_output": di["base_output"], "kl": di["kl"],
                            "first_divergence": di["first_divergence"]})
    for g in res["goldens"]:
        details.append({"kind": "golden", "prompt": g["prompt"], "output": g["output"], **({"golden": g["golden"], "match": g["match"]} if "match" in g else {})})
    items = [S.EvalItem(prompt=it["prompt"], expected=it["expected"], scorer=it["scorer_label"], base_output=it["base_output"],
                        output=it["output"], base_correct=it["base_correct"], correct=it["correct"], base_score=it["base_score"],
                        score=it["score"], change=it["change"]) for it in res["items"]]
    return S.EvalResult(
        summary=summary,
        citations=[pc.skills.cite(EVAL_SKILL, "scorers"), pc.skills.cite(EVAL_SKILL, "drift")],
        run_id=run_id,
        task_accuracy=res.get("task_accuracy"),
        base_accuracy=res.get("base_accuracy"),
        eval_loss=res.get("eval_loss"),
        base_eval_loss=res.get("base_eval_loss"),
        drift=S.DriftFigures(**drift),
        side_by_side=S.SideBySide(**sbs),
        scorers=scorers,
        items=items,
        thresholds={k: {"value": v, "source": th_source[k]} for k, v in thresholds.items()},
        passed=passed,
        details=details,
        report=str(report_path),
        side_by_side_report=str(report_path),
        result=str(result_path),
    )


def _threshold_rows(m: dict[str, Any]) -> list[tuple[str, Any, str | None]]:
    d = m.get("drift") or {}
    return [
        ("task accuracy", m.get("task_accuracy"), "min_accuracy"),
        ("base accuracy", m.get("base_accuracy"), None),
        ("eval loss", m.get("eval_loss"), "max_eval_loss"),
        ("base eval loss", m.get("base_eval_loss"), None),
        ("drift: mean KL(base ‖ tuned), nats/token", d.get("kl"), "max_kl"),
        ("drift: perplexity ratio tuned / base", d.get("perplexity_ratio"), "max_perplexity_ratio"),
        ("drift: general prompts whose answer changed", d.get("changed_share"), "max_drift"),
        ("golden match", m.get("golden_match"), "goldens" if "goldens" in m["passed"] else None),
    ]


def _metric_table(m: dict[str, Any]) -> list[str]:
    out = ["| metric | value | threshold | pass |", "|---|---|---|---|"]
    for name, v, key in _threshold_rows(m):
        th = m["thresholds"].get(key) if key else None
        ok = m["passed"].get(key) if key else None
        if th is not None:
            th_s = f"{'≥' if key.startswith('min_') else '≤'} {th:g} ({m['threshold_sources'][key]})"
        elif key == "goldens":
            th_s = "all match"
        elif key in DRIFT_THRESHOLDS:
            th_s = "waived: " + m["threshold_sources"][key] if key in m["threshold_sources"] else "**not set**"
        else:
            th_s = ""
        out.append(f"| {name} | {_fmt(v)} | {th_s} | {'' if ok is None else ('yes' if ok else 'NO')} |")
    return out


def _eval_report(run_id: str, m: dict[str, Any], res: dict[str, Any]) -> str:
    d = m["drift"]
    sbs = m.get("side_by_side") or {}
    base = m.get("base_model") or {}
    out = [f"# Evaluation: {run_id}", "", f"Evaluated {m['evaluated_at']} against adapter sha256 `{m['adapter_sha256']}` on base model "
           f"{base.get('name')}" + (f" (sha256 `{base['sha256'][:16]}…`)" if base.get("sha256") else "")
           + f" with suite {', '.join('eval/' + f for f in m['suite_files'])} (sha256 `{m['suite_sha256'][:16]}…`). "
           f"Eval-only: this report quotes the suite; the signed result is `{m['experiment']}/{RESULTS_DIR}/{Path(m['report']).stem}.json`.", "",
           *_metric_table(m), "",
           f"Scorers: {', '.join(f'{k} ({v} prompts)' for k, v in m['scorers'].items())}. "
           f"Side by side: {sbs.get('improved', 0)} improved, {sbs.get('regressed', 0)} regressed, {sbs.get('unchanged', 0)} unchanged "
           f"(every answer: below).", "",
           f"Eval loss: {m['loss_source']}, {m['loss_rows']} rows. KL: {d['prompts']} prompts from {d['prompts_source']}, "
           f"{d['kl_tokens']} continuation tokens of up to {m['drift_max_new_tokens']}. Perplexity: {d['text_source']}, "
           f"{d['perplexity_tokens']} tokens (base {_fmt(d['perplexity_base'])}, tuned {_fmt(d['perplexity_tuned'])}).", ""]
    if res.get("drift_items"):
        out += ["## Drift prompts (the base model's own continuation, and how far the fine-tuned model follows it)", "",
                "| # | prompt | base continuation | KL | tuned parts at token |", "|---|---|---|---|---|"]
        for i, it in enumerate(res["drift_items"], 1):
            fd = it["first_divergence"]
            out.append(f"| {i} | {_cell(_prompt_text(it['prompt']), 40)} | {_cell(it['base_output'], 60)} | {_fmt(it['kl'])} | "
                       f"{'never' if fd is None else fd} |")
    out += ["", "## Goldens (recorded outputs; export replays them)", "", "| # | prompt | output | golden | match |", "|---|---|---|---|---|"]
    for i, g in enumerate(res["goldens"], 1):
        out.append(f"| {i} | {_cell(_prompt_text(g['prompt']), 50)} | {_cell(g['output'], 50)} | {_cell(g.get('golden', ''), 50)} | "
                   f"{'' if 'match' not in g else ('yes' if g['match'] else 'NO')} |")
    out.append("")
    return "\n".join(out)


def _quote_block(text: str) -> list[str]:
    """Model output shown verbatim in markdown: an indented block keeps newlines and cannot break the page;
    control characters (an untrained model emits them) are shown escaped."""
    text = "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else f"\\x{ord(c):02x}" for c in (text or "(empty)"))
    return ["    " + line for line in text.splitlines()] or ["    (empty)"]


def _side_by_side_report(run_id: str, m: dict[str, Any], res: dict[str, Any]) -> str:
    sbs = m.get("side_by_side") or {}
    out = [f"## Side by side: {run_id}", "",
           f"Base model vs fine-tuned (base + adapter `{m['adapter_sha256'][:12]}…`), greedy, up to {m['max_new_tokens']} new tokens; "
           f"evaluated {m['evaluated_at']}.", "",
           "| | prompts |", "|---|---|",
           f"| improved (base wrong, fine-tuned right) | {sbs.get('improved', 0)} |",
           f"| regressed (base right, fine-tuned wrong) | {sbs.get('regressed', 0)} |",
           f"| unchanged | {sbs.get('unchanged', 0)} |", "",
           f"Accuracy: base {_fmt(m['base_accuracy'])} → fine-tuned {_fmt(m['task_accuracy'])}. "
           f"Scorers: {', '.join(f'{k} ({v})' for k, v in m['scorers'].items())}.", ""]
    order = {"regressed": 0, "improved": 1, "unchanged": 2}
    for i, it in sorted(enumerate(res["items"], 1), key=lambda x: (order[x[1]["change"]], x[0])):
        exp = it["expected"]
        shown = exp[0] if len(exp) == 1 else " | ".join(exp)
        score = "" if it["scorer"]["name"] != "rouge_l" else f" (ROUGE-L {it['base_score']:.2f} → {it['score']:.2f})"
        out += [f"### {i}. {it['change']}: {_cell(_prompt_text(it['prompt']), 70)}", "",
                f"Scorer `{it['scorer_label']}`; accepted: `{_cell(shown, 200)}`{score}", "",
                f"**Base** ({'right' if it['base_correct'] else 'wrong'}):", "", *_quote_block(it["base_output"]), "",
                f"**Fine-tuned** ({'right' if it['correct'] else 'wrong'}):", "", *_quote_block(it["output"]), ""]
    return "\n".join(out)


# ---------------------------------------------------------------- record_verdict


def record_verdict(pc: PhaseContext, run_id: str, verdict: str, evidence: str, top_remediation: str = "",
                   override_reason: str = "") -> S.VerdictResult:
    from finetune_mcp import signing

    if not pc.policy.may_sign_verdicts:
        raise Forbidden(f"the {pc.role} role may not sign verdicts", fix="verdicts come from the eval-engineer server")
    if verdict not in ("PROMOTE", "REJECT"):
        raise BadInput(f"verdict must be PROMOTE or REJECT, got {verdict!r}", where="verdict")
    evidence = (evidence or "").strip()
    top_remediation = (top_remediation or "").strip()
    override_reason = (override_reason or "").strip()
    if not evidence:
        raise BadInput("evidence is empty", where="evidence", fix="state the figures the verdict rests on (accuracy, loss, drift, failures seen)")
    if verdict == "REJECT" and not top_remediation:
        raise BadInput("a REJECT needs a top remediation", where="top_remediation", fix="name the one change to try first, e.g. 'double the examples of the failing pattern'")
    if verdict == "REJECT" and override_reason:
        raise BadInput("override_reason is for a PROMOTE against failed checks; a REJECT overrides nothing", where="override_reason",
                       fix="leave override_reason empty for a REJECT")
    experiment, r, e = run_paths(pc, run_id)
    digest = adapter_digest(r, run_id)
    d = suite_dir(pc, experiment)
    result_path = pc.ws.eval_result_path(experiment, run_id)
    key = signing.load_or_create_private_key(pc.ws)
    # A result that does not verify is refused whatever the verdict: nothing signed may rest on a forged figure.
    got = load_eval_document(pc.ws, run_id, key.public_key())
    evaluation, ev = got if got else (None, None)
    if ev is not None and ev.get("run_id") != run_id:
        raise Refused(f"the evaluation result at {result_path.name} was signed for run {ev.get('run_id')!r}, not {run_id!r}: it was copied "
                      "from another run", where=str(result_path), fix=f"call evaluate_checkpoint on {run_id}")
    if ev is not None and ev.get("adapter_sha256") != digest:
        evaluation = ev = None  # an evaluation of some other adapter says nothing about this one
    override = None
    goldens: list[dict[str, Any]] = []
    if verdict == "PROMOTE":
        if ev is None:
            raise Refused(f"no signed evaluation of run {run_id}'s current adapter", where=str(result_path),
                          fix="call evaluate_checkpoint first; PROMOTE rests on its figures and goldens")
        suite = load_suite(d)
        if suite["sha256"] != ev.get("suite_sha256"):
            raise Refused("the eval suite changed after the last evaluation", where=str(d), fix="call evaluate_checkpoint again, then record the verdict")
        base = base_model_identity(pc, r, load_run_brief(r, e))
        if base != ev.get("base_model"):
            raise Refused(f"the base model under the adapter is not the one evaluated ({_base_words(ev.get('base_model'))}; now {_base_words(base)})",
                          where=str(result_path), fix="call evaluate_checkpoint again on the base model the run names, then record the verdict")
        passed = judge(ev)
        failed = [k for k, ok in passed.items() if not ok]
        if failed and not override_reason:
            raise Refused(
                f"the evaluation fails {', '.join(check_text(k, ev) for k in failed)}, so it cannot be promoted "
                f"(recomputed from the signed figures of {result_path.name})",
                where=str(result_path),
                fix="record REJECT with the top remediation; or, if a threshold is wrong, change it in eval/eval.yaml and evaluate again; "
                    "or PROMOTE anyway with override_reason saying why (the signed verdict records the override)",
            )
        if override_reason and not failed:
            raise BadInput("override_reason given, but the evaluation fails no check: there is nothing to override", where="override_reason",
                           fix="leave override_reason empty")
        if failed:
            override = {"reason": override_reason, "failed_checks": failed, "checks": [check_text(k, ev) for k in failed]}
        unset = [k for k in DRIFT_THRESHOLDS if k not in (ev.get("thresholds") or {}) and k not in (ev.get("threshold_sources") or {})]
        if unset:
            raise Refused(
                f"the evaluation had no threshold for {', '.join(unset)}: a PROMOTE needs a bar for harm to general ability",
                where=str(d / "eval.yaml"),
                fix=f"set thresholds {', '.join(unset)} in eval/eval.yaml (or in the brief's ## Evaluation), or waive one on purpose with "
                    f"null, then evaluate again; {EVAL_SKILL}#drift says how to choose them",
            )
        goldens = [{"prompt": g["prompt"], "output": g["output"]} for g in (ev.get("goldens") or [])[:MAX_GOLDENS]]
        if len(goldens) < MIN_GOLDENS:
            raise Refused(f"the evaluation recorded {len(goldens)} golden outputs; export's smoke test needs {MIN_GOLDENS}-{MAX_GOLDENS}",
                          where=str(d / "goldens.jsonl"), fix="write 3-5 prompts to eval/goldens.jsonl and evaluate again")

    signed_at = utc_now()
    payload = {
        "run_id": run_id,
        "experiment": experiment,
        "verdict": verdict,
        "adapter_sha256": digest,
        "base_model": ev.get("base_model") if ev else None,
        "evidence_sha256": signing.sha256_text(evidence),
        "evidence": evidence,
        "top_remediation": top_remediation,
        "override": override,
        "metrics": {k: ev.get(k) for k in ("task_accuracy", "base_accuracy", "scorers", "side_by_side", "eval_loss", "drift", "thresholds",
                                           "threshold_sources", "evaluated_at", "max_new_tokens")} | {"passed": judge(ev)} if ev else None,
        "goldens": goldens,
        # The signed evaluation itself (its own signature kept): export verifies both with the public key alone.
        "evaluation": evaluation,
        "signed_at": signed_at,
    }
    block = signing.sign_block(key, payload)
    report = pc.ws.verdict_path(experiment, run_id)
    for folder in (pc.ws.verdicts_root, report.parent.parent, report.parent):
        if not folder.exists():
            pc.guard.check_write(folder)
            folder.mkdir(mode=0o755, exist_ok=True)
    pc.guard.write_text(report, _promotion_report(block), mode=0o644)
    return S.VerdictResult(
        summary=f"{verdict} recorded for {run_id}, signed ({block['key_id']}) over adapter {digest[:12]}…"
                + (f"; OVERRIDE of failed check(s) {', '.join(override['failed_checks'])}: {override_reason}" if override else ""),
        citations=[pc.skills.cite("quantized-export", "verdict-gate"), pc.skills.cite(EVAL_SKILL, "drift")],
        run_id=run_id,
        verdict=verdict,
        adapter_sha256=digest,
        report=str(report),
        signed_at=signed_at,
        override=override,
    )


def _base_words(b: Any) -> str:
    if not isinstance(b, dict):
        return "none recorded"
    return f"{b.get('name')}" + (f" sha256 {str(b['sha256'])[:12]}…" if b.get("sha256") else "")


def _quote(text: str) -> list[str]:
    return ["> " + line if line else ">" for line in text.splitlines()] or [">"]


def _promotion_report(b: dict[str, Any]) -> str:
    from finetune_mcp import signing

    out = [f"# Promotion report: {b['run_id']}", "", f"**Verdict: {b['verdict']}**", "",
           f"- adapter sha256: `{b['adapter_sha256']}`", f"- base model: {_base_words(b.get('base_model'))}",
           f"- signed at: {b['signed_at']} by the eval-engineer key `{b['key_id']}`",
           "", "## Evidence", "", *_quote(b["evidence"]), ""]
    if b.get("override"):
        o = b["override"]
        out += ["## OVERRIDE", "", f"Promoted although the evaluation fails {', '.join(o['checks'])}. The eval engineer's reason:", "",
                *_quote(o["reason"]), ""]
    if b["top_remediation"]:
        out += ["## Top remediation", "", *_quote(b["top_remediation"]), ""]
    if b.get("metrics"):
        m = b["metrics"]
        d = m.get("drift") if isinstance(m.get("drift"), dict) else {}
        th, src = m.get("thresholds") or {}, m.get("threshold_sources") or {}

        def bar(key: str) -> str:
            if key in th:
                return f"threshold {'≥' if key.startswith('min_') else '≤'} {th[key]:g} from {src.get(key)}, " + ("passed" if (m.get("passed") or {}).get(key) else "FAILED")
            return "waived in " + src[key].replace(" (cleared)", "") if key in src else "no threshold set"

        sbs = m.get("side_by_side") or {}
        out += ["## Evaluation", "",
                f"- Task accuracy {_fmt(m.get('task_accuracy'))} (base {_fmt(m.get('base_accuracy'))}), scored with "
                f"{', '.join(f'{k} ({v})' for k, v in (m.get('scorers') or {}).items()) or 'n/a'}; {bar('min_accuracy')}. "
                f"Side by side: {sbs.get('improved', 0)} improved, {sbs.get('regressed', 0)} regressed, {sbs.get('unchanged', 0)} unchanged.",
                f"- Drift, mean per-token KL(base ‖ tuned) on the base model's own continuations of {d.get('prompts', 'n/a')} general prompts: "
                f"{_fmt(d.get('kl'))} nats/token; {bar('max_kl')}.",
                f"- Drift, perplexity ratio tuned / base on {d.get('text_source', 'a general text')}: {_fmt(d.get('perplexity_ratio'))} "
                f"({_fmt(d.get('perplexity_base'))} → {_fmt(d.get('perplexity_tuned'))}); {bar('max_perplexity_ratio')}.",
                f"- Eval loss {_fmt(m.get('eval_loss'))}; {bar('max_eval_loss')}. Evaluated {m.get('evaluated_at')}.", ""]
    if b.get("goldens"):
        out += ["## Goldens (export's smoke test must reproduce these)", "", "| # | prompt | output |", "|---|---|---|"]
        for i, g in enumerate(b["goldens"], 1):
            out.append(f"| {i} | {_cell(_prompt_text(g['prompt']), 60)} | {_cell(g['output'], 60)} |")
        out.append("")
    out += ["## Signature", "", "The block below binds run id, adapter and base model digests, verdict, evidence digest, time, and the signed",
            "evaluation it rests on (with that evaluation's own signature); export verifies both with the eval role's public key.",
            "Any edit to it, or a copy into another run, makes it invalid.", "", signing.render_block(b)]
    return "\n".join(out)
