"""Phase 2, prepare_dataset: opens the experiment from a brief, prepares and inspects its dataset, writes card and report.

Light on purpose: JSONL/JSON/CSV records are read and validated here with the stdlib (jobs/_records.py),
so bad input is refused before any child starts; everything that needs the training stack (Parquet,
save_to_disk, the HF cache, the tokenizer, TRL packing) runs in one worker job, jobs/prepare_data.py,
which reads the source again with the same code. The job writes into a hidden staging folder under
datasets/; it is renamed into place only when every check passed, so a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from finetune_mcp import schemas as S
from finetune_mcp.context import PhaseContext
from finetune_mcp.errors import BadInput, Forbidden, FtError, NotFound, from_dict
from finetune_mcp.jobs import _convert as C, _records as R
from finetune_mcp.jobs._proto import JobError
from finetune_mcp.phases.brief import BRIEF_FILE, Brief, load_brief
from finetune_mcp.workspace import commit, utc_now

SKILL = "dataset-curation"
# org/name, org/name:split, or org/name:config:split (org/name:config: for a config's default split).
_HF_ID = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(:[A-Za-z0-9_.-]*){0,2}\Z")
_HF_NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*\Z")
_DATA_EXTS = set(R.TEXT_EXTS) | set(R.ARROW_EXTS)
_NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,119}\Z")
# Overall progress: brief and light pass, then the worker's seven stages, then the write-up.
_TOTAL = 10.0
# Above this a source is validated once, in the worker, which reads it anyway: the server then neither
# spends the time twice nor holds a large set in memory.
LIGHT_PASS_MAX_BYTES = 4 << 20


def _tables(pc: PhaseContext) -> dict[str, dict]:
    return {t: pc.skills.table(SKILL, t).model_dump(mode="json") for t in ("formats", "validation", "collapse", "card")}


def _err(e: JobError) -> FtError:
    return from_dict({"kind": e.kind, "message": e.message, "where": e.where, "fix": e.fix})


# ---------------------------------------------------------------- sources


def hf_dataset_cached(hf_id: str) -> dict[str, Path]:
    """Where hf_id sits in the local caches: {"datasets": built cache dir, "snapshot": hub snapshot dir}. Stdlib only."""
    name = hf_id.split(":")[0]
    home = Path(os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface").expanduser()
    ds_cache = Path(os.environ.get("HF_DATASETS_CACHE") or home / "datasets").expanduser()
    hub = Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or home / "hub").expanduser()
    org, _, repo = name.partition("/")
    found: dict[str, Path] = {}
    built = ds_cache / f"{org}___{repo}"
    if built.is_dir() and any(built.iterdir()):
        found["datasets"] = built
    repo_dir = hub / f"datasets--{org}--{repo}"
    snaps = repo_dir / "snapshots"
    if snaps.is_dir():
        try:
            main = (repo_dir / "refs" / "main").read_text().strip()
        except OSError:
            main = ""
        cands = [d for d in snaps.iterdir() if d.is_dir() and any(d.iterdir())]
        pick = snaps / main if main and (snaps / main).is_dir() else (max(cands, key=lambda d: d.stat().st_mtime) if cands else None)
        if pick is not None:
            found["snapshot"] = pick
    return found


def resolve_source(pc: PhaseContext, source: Any) -> dict:
    """{"kind": "path", "path": real} or {"kind": "hf", "id": ..., "config": ..., "split": ...}."""
    if not isinstance(source, str) or not source.strip():
        raise BadInput("source is empty", where="source", fix="pass a data file or folder, a save_to_disk folder, or an HF dataset id")
    s = source.strip()
    hf = None
    if s.startswith(("hf://", "hf:")):
        hf = s.split(":", 1)[1].lstrip("/")
    else:
        try:
            real = pc.guard.check_read(s, "source")
        except Forbidden:
            if _HF_ID.fullmatch(s) and not Path(s).expanduser().exists():
                real = None
            else:
                raise
        if real is not None and real.exists():
            return {"kind": "path", "path": str(real), "given": source}
        if _HF_ID.fullmatch(s) and Path(s).suffix.lower() not in _DATA_EXTS:
            hf = s
        else:
            raise NotFound(f"source {source!r} not found", where=str(real) if real else source,
                           fix="pass an existing file or folder (relative paths are taken from DGX_SPARK_ROOT), or an HF dataset id org/name[:config]:split")
    parts = hf.split(":")
    hf_id = parts[0]
    config, split = (parts[1] or None, parts[2] or None) if len(parts) == 3 else (None, (parts[1] or None) if len(parts) == 2 else None)
    if not _HF_NAME.fullmatch(hf_id) or len(parts) > 3:
        raise BadInput(f"{hf!r} is not an HF dataset id", where="source", fix="write it as org/name, org/name:split or org/name:config:split")
    # Loaded in the worker by datasets.load_dataset: from the local cache, or from the hub when it can be reached.
    # The worker runs offline; it may fetch a missing dataset from the hub unless the user set offline mode here.
    offline = any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on") for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    out = {"kind": "hf", "id": hf_id, "config": config, "split": split, "hub": not offline, "given": source}
    cached = hf_dataset_cached(hf_id)
    if "snapshot" in cached:
        out["snapshot"] = str(cached["snapshot"])
    return out


# ---------------------------------------------------------------- the tool


def prepare_dataset(pc: PhaseContext, brief_path: str, source: str, dataset_name: str | None = None,
                    eval_fraction: float = 0.05) -> S.PrepareDatasetResult:
    if not isinstance(eval_fraction, (int, float)) or isinstance(eval_fraction, bool) or not (0 <= eval_fraction < 0.5):
        raise BadInput(f"eval_fraction {eval_fraction!r} is out of range", where="eval_fraction", fix="use a fraction from 0 up to (not including) 0.5, e.g. 0.05")
    pc = _monotonic(pc)
    pc.progress(0, _TOTAL, "reading the brief")
    brief_real = pc.guard.check_read(brief_path, "brief_path")
    brief_text = _read_brief_text(brief_real)
    brief = load_brief(brief_real)
    tables = _tables(pc)
    experiment = brief.experiment
    exp_dir = pc.guard.check_write(pc.ws.experiment_dir(experiment, must_exist=False), "experiment")
    name = dataset_name if dataset_name is not None else experiment
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise BadInput(f"invalid dataset_name {name!r}", where="dataset_name", fix="use letters, digits, '.', '_' and '-' (up to 120), starting with a letter or digit")
    final_dir = pc.guard.check_write(pc.ws.datasets_dir / name, "dataset_name")
    src = resolve_source(pc, source)

    from finetune_mcp.models import resolve_base_model

    model = resolve_base_model(brief.base_model, pc.ws.base_models_dir, data_dirs=pc.guard.read_roots)
    data = data_settings(pc, brief, src)

    # Light pass: plain-text sources are read and checked here, so bad records never cost a child start.
    light = None
    if src["kind"] == "path":
        try:
            kind, files, _ = R.source_files(Path(src["path"]))
            if kind == "text" and sum(f.stat().st_size for f in files) <= LIGHT_PASS_MAX_BYTES:
                pc.progress(0.5, _TOTAL, "reading and validating the records")
                raw, sink = R.read_text_source(Path(src["path"]), tables["validation"]["listed_per_code"])
                checked = R.check_records(raw, sink, method=brief.method, formats=tables["formats"], validation=tables["validation"],
                                          path_ok=_path_ok(pc), fill=data["fill"], keep_placeholders=data["keep_placeholders"],
                                          needs_reference=data["needs_reference"],
                                          provenance=(data["provenance"] or {}).get("value"))
                light = {"checked": checked, "raw": raw}
                if len(checked.records) < tables["validation"]["min_examples"] and not sink.errors:
                    sink.error("too-few-records", f"{len(checked.records)} usable records; the skill asks for at least {tables['validation']['min_examples']}")
        except JobError as e:
            raise _err(e) from None

    if light is None or not light["checked"].sink.errors:
        from finetune_mcp.worker import prewarm

        prewarm()  # a job follows: the worker imports the training stack while the experiment opens
    _open_experiment(pc, exp_dir, brief, brief_text)
    if light is not None and light["checked"].sink.errors:
        c = light["checked"]
        job = {"ok": False, "stage": "validation", "shape": c.shape, "format": c.format, "conversion": c.conversion,
               "conversion_report": c.extra.get("report"),
               "files": light["raw"].files, "ignored_files": light["raw"].ignored,
               "counts": {"read": c.read, "kept": len(c.records), "dropped_exact_duplicates": c.dropped["exact-duplicate"]},
               **c.sink.to_dict()}
        return _finish(pc, brief, exp_dir, name, final_dir, src, model, job, tables, eval_fraction, data)

    if model.embedded and not model.exists:
        from finetune_mcp.worker import run_job

        pc.progress(1, _TOTAL, f"building the embedded base model {model.name}")
        pc.guard.check_write(model.path, "base model")
        run_job("build_tiny_model", {"target_dir": str(model.path), "seed": 0}, timeout=900)
    job = _run_prepare(pc, brief, src, model, name, final_dir, tables, eval_fraction, data)
    return _finish(pc, brief, exp_dir, name, final_dir, src, model, job, tables, eval_fraction, data)


def data_settings(pc: PhaseContext, brief: Brief, src: dict) -> dict:
    """What the brief (and the data's own card) decide about preparing the records, resolved once for the light
    pass, the worker job and the card: the sequence length, placeholders, the provenance, GRPO's reference column."""
    from finetune_mcp.phases.config import effective_max_seq_length

    seq, seq_from, seq_cite = effective_max_seq_length(brief, pc.skills)
    needs_reference = True
    if brief.method == "grpo":
        rewards = pc.skills.table("grpo-rlvr-training", "rewards").rewards
        needs_reference = any(rewards[r].needs for r in brief.reward if r in rewards)
    return {"max_seq_length": seq, "max_seq_length_from": seq_from, "max_seq_length_cite": seq_cite,
            "fill": brief.fill, "keep_placeholders": brief.keep_placeholders, "needs_reference": needs_reference,
            "provenance": provenance_of(brief, src)}


_STRICTNESS = {"curated": 0, "mixed": 1, "synthetic": 2}


def provenance_of(brief: Brief, src: dict) -> dict:
    """{"value", "from", "conflict"}: the brief's provenance line and the data's own card; on disagreement the stricter."""
    said = [(brief.provenance, "the brief's ## Dataset Expectation")] if brief.provenance else []
    d, where = _card_provenance(src)
    if d:
        said.append((d, where))
    if not said:
        return {"value": None, "from": None, "conflict": None}
    value, frm = max(said, key=lambda x: _STRICTNESS[x[0]])
    conflict = None
    if len({v for v, _ in said}) > 1:
        conflict = " and ".join(f"{w} says {v}" for v, w in said) + f": the stricter, {value}, applies"
    return {"value": value, "from": frm, "conflict": conflict}


def _card_cands(src: dict) -> list[Path]:
    """Files beside the source that may carry its card or license: README.md, LICENSE and the like."""
    if src["kind"] == "hf":
        cached = hf_dataset_cached(src["id"])
        return [p for d in cached.values() for p in sorted(d.rglob("README.md"))[:3]]
    p = Path(src["path"])
    base = p if p.is_dir() else p.parent
    return [base / n for n in ("README.md", "LICENSE", "LICENSE.md", "LICENSE.txt", "DATASET_LICENSE")]


def _card_provenance(src: dict) -> tuple[str | None, str | None]:
    """A dataset card's own word on provenance: a `provenance:` key in its YAML front matter, or a `synthetic` tag
    (the tag the HF hub gives generated sets)."""
    import yaml

    for c in _card_cands(src):
        if c.name != "README.md":
            continue
        try:
            text = c.read_text(encoding="utf-8", errors="replace")[:20000]
        except OSError:
            continue
        m = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", text, re.S)
        if not m:
            continue
        try:
            meta = yaml.safe_load(m.group(1)) or {}
        except yaml.YAMLError:
            continue
        if not isinstance(meta, dict):
            continue
        value = str(meta.get("provenance") or "").strip().lower()
        if value in _STRICTNESS:
            return value, f"the dataset card {c}"
        tags = meta.get("tags") or []
        if isinstance(tags, list) and "synthetic" in [str(t).strip().lower() for t in tags]:
            return "synthetic", f"the dataset card {c} (tag synthetic)"
    return None, None


def _monotonic(pc: PhaseContext) -> PhaseContext:
    """MCP progress must increase with every notification; stages that report the same point are nudged."""
    last = [-1.0]

    def report(done, total=None, message=None):
        done = float(done)
        if done <= last[0]:
            done = min(last[0] + 1e-3, float(total or _TOTAL))
            if done <= last[0]:
                return
        last[0] = done
        pc.progress(done, total, message)

    return pc.with_progress(report if pc.progress_fn else None)


def _read_brief_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8-sig")
    except FileNotFoundError:
        raise NotFound(f"training brief {str(path)!r} not found", where=str(path), fix="pass the path of an existing training-brief.md") from None
    except IsADirectoryError:
        raise BadInput(f"training brief {str(path)!r} is a directory", where=str(path)) from None
    except UnicodeDecodeError as e:
        raise BadInput(f"the training brief is not UTF-8 (byte {e.start})", where=str(path), fix="save the brief as UTF-8") from None


def _path_ok(pc: PhaseContext):
    """Image paths named by records must be readable under the role's policy, like the source itself."""

    def ok(p: Path) -> bool:
        try:
            pc.guard.check_read(p)
            return True
        except FtError:
            return False

    return ok


def _open_experiment(pc: PhaseContext, exp_dir: Path, brief: Brief, brief_text: str) -> None:
    """Copy the brief in (and a README when there is none) and commit them, whatever the data turns out to be."""
    pc.guard.write_text(exp_dir / BRIEF_FILE, brief_text)
    readme = exp_dir / "README.md"
    if not readme.exists():
        pc.guard.write_text(readme, (
            f"# {exp_dir.name}\n\n"
            f"Goal: {brief.title or brief.task_slug}. Task: {brief.task.splitlines()[0] if brief.task else brief.task_slug}\n\n"
            f"- Base model: {brief.base_model}\n- Method: {brief.method_label}\n- Deployment target: {brief.deployment_target}\n\n"
            "Phase 2 writes data/ (prepare.py, dataset-card.md, validation-report.md); later phases add configs/, "
            "train.py and train.sh. Key results and gotchas go here as runs finish.\n"))
    commit(pc.ws.experiments_repo, [exp_dir / BRIEF_FILE, readme], f"prepare_dataset: open {exp_dir.name} from its brief")


def _run_prepare(pc: PhaseContext, brief: Brief, src: dict, model, name: str, final_dir: Path, tables: dict, eval_fraction: float,
                 data: dict) -> dict:
    from finetune_mcp.worker import run_job

    datasets_dir = final_dir.parent
    datasets_dir.mkdir(parents=True, exist_ok=True)
    stage = pc.guard.check_write(datasets_dir / f".staging-{name}-{uuid.uuid4().hex[:8]}", "staging")
    params = _job_params(brief, src, model, name, tables, eval_fraction, [str(r) for r in pc.guard.read_roots], data)
    params["out_dir"] = str(stage)

    def progress(done, total, message):
        pc.progress(1 + 7 * float(done) / float(total or 7), _TOTAL, message)

    try:
        stage.mkdir()  # made here, so it goes with the job if this server dies (scratch)
        job = run_job("prepare_data", params, progress=progress, timeout=900 + 0.05 * _size_hint(src), scratch=[str(stage)])
        job["_stage_dir"] = str(stage)
        job["_params"] = params
        if not job.get("ok"):
            shutil.rmtree(stage, ignore_errors=True)
        return job
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _size_hint(src: dict) -> int:
    try:
        return Path(src["path"]).stat().st_size // 200 if src["kind"] == "path" else 0
    except OSError:
        return 0


def _job_params(brief: Brief, src: dict, model, name: str, tables: dict, eval_fraction: float, roots: list[str], data: dict) -> dict:
    return {
        "name": name,
        "experiment": brief.experiment,
        "source": {k: v for k, v in src.items() if k != "given"},
        "model_path": model.load_path,
        "method": brief.method,
        "max_seq_length": data["max_seq_length"],
        "max_seq_length_from": data["max_seq_length_from"],
        "max_seq_length_cite": data["max_seq_length_cite"],
        "fill": data["fill"],
        "keep_placeholders": data["keep_placeholders"],
        "needs_reference": data["needs_reference"],
        "provenance": data["provenance"],
        "packing": brief.packing,
        "long_records": brief.long_records,
        "system_prompt": brief.system_prompt,
        "eval_fraction": float(eval_fraction),
        "seed": 0,
        "tables": {k: tables[k] for k in ("formats", "validation", "collapse")},
        "allowed_roots": roots,
    }


def _install(stage: Path, final_dir: Path) -> None:
    """Swap the staging folder into place; an older dataset of the same name is replaced whole."""
    old = None
    if final_dir.exists():
        old = final_dir.with_name(f".old-{final_dir.name}-{uuid.uuid4().hex[:8]}")
        os.replace(final_dir, old)
    try:
        os.replace(stage, final_dir)
    except BaseException:
        if old is not None:
            os.replace(old, final_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- write-up


def _finish(pc: PhaseContext, brief: Brief, exp_dir: Path, name: str, final_dir: Path, src: dict, model, job: dict,
            tables: dict, eval_fraction: float, data: dict) -> S.PrepareDatasetResult:
    ok = bool(job.get("ok"))
    stage = job.pop("_stage_dir", None)
    params = job.pop("_params", None) or _job_params(brief, src, model, name, tables, eval_fraction, [], data)
    pc.progress(8.5, _TOTAL, "writing the dataset card and the validation report")
    now = utc_now()
    data_dir = exp_dir / "data"
    report_path = data_dir / "validation-report.md"
    card_path = data_dir / "dataset-card.md"
    prep_path = data_dir / "prepare.py"
    problems = [S.Problem(**p) for p in job.get("problems", [])]
    written: list[Path] = [exp_dir / BRIEF_FILE]
    if (exp_dir / "README.md").exists():
        written.append(exp_dir / "README.md")
    try:
        if ok:
            _install(Path(stage), final_dir)
        card_text = _card(brief, name, final_dir, src, model, job, tables, eval_fraction, now, data) if ok else None
        card_ok = bool(card_text) and all(f"## {f['title']}" in card_text for f in tables["card"]["card_fields"])
        pc.guard.write_text(report_path, _report(brief, name, final_dir, src, job, tables, now, data))
        written.append(report_path)
        if ok:
            pc.guard.write_text(card_path, card_text)
            pc.guard.write_text(prep_path, _prepare_py(name, params, now))
            written += [card_path, prep_path]
        commit_id = commit(pc.ws.experiments_repo, written,
                           f"prepare_dataset: {name} ({'prepared' if ok else 'validation failed'})")
    except BaseException:
        if stage and Path(stage).exists():
            shutil.rmtree(stage, ignore_errors=True)
        raise
    checklist = _checklist(brief, job, tables, final_dir if ok else None, card_ok if ok else False, commit_id, data)
    complete = ok and all(c.ok for c in checklist)
    cites = [pc.skills.cite(SKILL, a) for a in ("format-table", "conversions", "placeholders", "validation-thresholds", "chat-template", "loss-masking",
                                                "packing", "collapse-guard", "dataset-card", "phase-2-exit-checklist")]
    counts = {k: v for k, v in (job.get("counts") or {}).items() if isinstance(v, int)}
    n_err = sum(c["error"] for c in (job.get("problem_counts") or {}).values())
    n_warn = sum(c["warning"] for c in (job.get("problem_counts") or {}).values())
    if ok:
        pk = job.get("packing") or {}
        summary = (f"Phase 2 {'complete' if complete else 'NOT complete'}: {counts.get('train', 0)} train / {counts.get('eval', 0)} eval "
                   f"{job.get('format')} records in datasets/{name}"
                   + (f"; packed at {pk.get('seq_length')} tokens, efficiency {pk.get('efficiency'):.1%}" if pk.get("enabled") else "")
                   + _removed_said(job)
                   + (f"; {n_warn} warning(s)" if n_warn else ""))
    else:
        first = next((p for p in problems if p.severity == "error"), None)
        where = _where(first) if first else ""
        summary = (f"Phase 2 NOT complete: {n_err} error(s) in the {job.get('stage')} stage"
                   + (f" (first: {where} — {first.message})" if first else "") + f"; nothing written to datasets/{name}")
    res = S.PrepareDatasetResult(
        summary=summary,
        citations=cites,
        experiment=exp_dir.name,
        experiment_dir=str(exp_dir),
        method=brief.method,
        format=job.get("format") or brief.dataset_format,
        converted_from=job.get("shape") if job.get("conversion") else None,
        conversion=job.get("conversion_report"),
        max_seq_length=data["max_seq_length"],
        provenance=(job.get("provenance") or {}).get("value") or (data["provenance"] or {}).get("value"),
        tokens=job.get("tokens"),
        transformations=({"long_records": job.get("long_records"), "exact_duplicates": job.get("duplicates") or [],
                          "line": long_records_said(job, data)} if job.get("tokens") else None),
        dataset_dir=str(final_dir) if ok else None,
        counts=counts,
        problems=problems,
        problem_counts=job.get("problem_counts") or {},
        masking=(job.get("template") or {}).get("masking"),
        packing=job.get("packing"),
        decoded_samples=job.get("decoded_samples") or [],
        files=[str(p) for p in written] + ([str(final_dir / f) for f in ("train.jsonl", "eval.jsonl", "meta.json")] if ok else []),
        checklist=checklist,
        complete=complete,
    )
    pc.progress(_TOTAL, _TOTAL, "done")
    return res


def conversion_lines(job: dict, tables: dict) -> list[str]:
    """The card's account of a conversion: the source shape and where it is defined, each step with its rule, what
    the steps did (counted in records), and what was dropped (the content: nothing; unused columns: named)."""
    rep = job.get("conversion_report") or {}
    shape = job.get("shape")
    spec = (tables["formats"].get("shapes") or {}).get(shape) or {}
    convs = {c["id"]: c for c in tables["formats"]["conversions"]}
    L = [f"- Source format: {shape}" + (f" ({', '.join(spec['fields'])}), as defined by {spec['origin']}" if spec else "")]
    steps = rep.get("steps") or ([job["conversion"]] if job.get("conversion") else [])
    if not steps:
        L.append("- Conversion: none; the records are already in the trainer's format")
    for st in steps:
        c = convs.get(st, {})
        L.append(f"- Conversion {st}: {c.get('how', '')} (rule: {c.get('cite', 'see the skill')})"
                 + (f"; trained: {c['trained']}" if c.get("trained") else ""))
    for text, n in sorted((rep.get("notes") or {}).items(), key=lambda kv: (-kv[1], kv[0])):
        L.append(f"  - {text}: {n} records")
    for key, f in sorted((rep.get("filled") or {}).items()):
        L.append(f"- Placeholder {{{{{key}}}}} filled with {f['value']!r} (the brief's `fill:`) in {f['records']} records")
    w = rep.get("message_weights") or {}
    if w:
        L.append(f"- Per-message weights kept on the assistant messages: {', '.join(f'{k} on {v}' for k, v in sorted(w.items()))}"
                 + ("; weight 0 messages are context, not trained (meta.json trainer_settings.message_weights)" if w.get("weight 0") else ""))
    left = rep.get("left_out_columns") or {}
    L.append("- Dropped from the records' content: nothing"
             + (f". Columns the trainer does not read, left out of train.jsonl: {', '.join(f'{k} ({v} records)' for k, v in sorted(left.items()))}" if left else ""))
    return L


def _removed_said(job: dict) -> str:
    """The summary's clause on records removed or cut, so a large share dropped is never only in the warnings."""
    c = job.get("counts") or {}
    lr = job.get("long_records") or {}
    parts = []
    if c.get("dropped_long"):
        parts.append(f"{c['dropped_long']} of {lr.get('records')} records longer than {lr.get('max_seq_length')} tokens dropped "
                     f"({c['dropped_long'] / max(lr.get('records') or 1, 1):.1%}; `long_records: truncate` or `max_seq_length: "
                     f"{(lr.get('max_seq_length_for') or {}).get('95%')}` keeps them)")
    if c.get("truncated"):
        parts.append(f"{c['truncated']} records truncated to {lr.get('max_seq_length')} tokens")
    if c.get("dropped_exact_duplicates"):
        parts.append(f"{c['dropped_exact_duplicates']} exact duplicates removed")
    return "".join(f"; {p}" for p in parts)


def long_records_said(job: dict, data: dict) -> str:
    """One line on the records longer than max_seq_length and what the brief's long_records policy did with them."""
    tok = job.get("tokens") or {}
    lr = job.get("long_records") or {}
    q = tok.get("record_lengths") or tok.get("tokens_per_sequence") or {}
    over = tok.get("over_max_seq_length", 0)
    line = (f"{over} of {lr.get('records', '?')} records over max_seq_length {data['max_seq_length']} "
            f"({tok.get('over_share', 0):.1%}), long_records: {lr.get('policy', 'drop')}")
    if over:
        line += (f": {len(lr.get('dropped') or [])} dropped, {len(lr.get('truncated') or [])} truncated"
                 + (f" ({lr.get('cut_inside_answer', 0)} cut inside an answer)" if lr.get("truncated") else "")
                 + f", {tok.get('tokens_cut', 0)} tokens cut")
    return (line + f"; record lengths p50 {q.get('p50')}, p95 {q.get('p95')}, p99 {q.get('p99')}, max {q.get('max')}: "
            f"max_seq_length {q.get('p95')} keeps 95%, {q.get('p99')} keeps 99%")


def transformation_lines(job: dict, data: dict, n: int = 5) -> list[str]:
    """The card's account of what was removed or changed, with counts and the first few records of each."""
    counts = job.get("counts") or {}
    lr = job.get("long_records") or {}
    dups = job.get("duplicates") or []
    L = [f"- Exact duplicates removed: {counts.get('dropped_exact_duplicates', 0)}"
         + (": " + "; ".join(f"{d['where']} (same as {d['same_as']})" for d in dups[:n]) + (f"; and {len(dups) - n} more" if len(dups) > n else "")
            if dups else "")]
    L.append(f"- Longer than max_seq_length {data['max_seq_length']}: {(job.get('tokens') or {}).get('over_max_seq_length', 0)} records; "
             f"policy long_records: {lr.get('policy', 'drop')} (the brief's ## Dataset Expectation)")
    for key, label, what in (("dropped", "Dropped for length", "why"), ("truncated", "Truncated", "what")):
        items = lr.get(key) or []
        L.append(f"- {label}: {len(items)}" + (": " + "; ".join(f"{d['where']} ({d['tokens']} tokens: {d[what]})" for d in items[:n])
                                              + (f"; and {len(items) - n} more" if len(items) > n else "") if items else ""))
    if lr.get("truncated"):
        L.append(f"- Truncations that fall inside a trained answer: {lr.get('cut_inside_answer', 0)} (their end-of-turn token is cut too, "
                 "so the model is not taught to stop there); every kept record keeps trained answer tokens")
    L.append(f"- Kept: {counts.get('kept')} of {counts.get('read')} records read; the full lists are in validation-report.md "
             "and `python data/prepare.py` rebuilds exactly these files")
    return L


def seq_said(data: dict) -> str:
    """The sequence length and where it came from, for people: "64 (brief)" or "2048 (recipe default, ...; not in the brief)"."""
    if data["max_seq_length_from"] == "brief":
        return f"{data['max_seq_length']} (brief)"
    return f"{data['max_seq_length']} ({data['max_seq_length_cite']}; the brief states none)"


def _masking_lines(mk: dict | None) -> list[str]:
    """The card's account of how assistant-only loss was made to work on this template (jobs/masking.py)."""
    if not mk:
        return []
    L = ["## Assistant-only masking", "",
         f"- Method: **{mk['method']}** — {mk['summary']}. Every record was checked: its trained tokens decode to exactly "
         "its assistant replies (and their tool calls) plus the end-of-turn token.",
         "- Ways tried, in order: " + "; ".join(f"{a['method']} {'verified' if a['ok'] else 'failed (' + str(a['why']) + ')'}"
                                               for a in mk.get("attempts") or []),
         "- Row kinds on the probe: " + ", ".join(f"{k}: {v}" for k, v in (mk.get("rows") or {}).items())]
    if mk.get("default_system_prompt"):
        L.append(f"- The template writes its own system prompt when a conversation has none: {mk['default_system_prompt']!r}. "
                 + ("The brief's `system_prompt:` replaces it in every conversation without one." if mk.get("system_prompt")
                    else "The brief's `system_prompt: none` gives such conversations an empty system turn instead."
                    if mk.get("system_prompt") == "" else
                    "Conversations without a system turn are trained with it; set `system_prompt:` in the brief's Dataset "
                    "Expectation to use your own, or `system_prompt: none`."))
    elif mk.get("system_prompt") is not None:
        L.append(f"- System prompt from the brief for conversations without one: {mk['system_prompt']!r}.")
    return L + [""]


def _where(p) -> str:
    get = (lambda k: getattr(p, k)) if not isinstance(p, dict) else p.get
    loc = Path(get("file")).name if get("file") else ""
    if get("line"):
        loc += f":{get('line')}"
    elif get("record") is not None:
        loc += f" record {get('record')}"
    if get("field"):
        loc += f" [{get('field')}]"
    return loc.strip() or "dataset"


def _checklist(brief: Brief, job: dict, tables: dict, final_dir: Path | None, card_ok: bool, commit_id: str, data: dict) -> list[S.ChecklistItem]:
    items = {i["id"]: i["item"] for i in tables["card"]["exit_checklist"]}
    ok = bool(job.get("ok"))
    pc_counts = job.get("problem_counts") or {}
    errors = {k: v["error"] for k, v in pc_counts.items() if v["error"]}
    warns = {k: v["warning"] for k, v in pc_counts.items() if v["warning"]}
    fmt = job.get("format")
    tok = job.get("tokens") or {}
    tpl = job.get("template") or {}
    pk = job.get("packing") or {}
    col = job.get("collapse") or {}
    out: list[S.ChecklistItem] = []

    def add(i: str, good: bool, evidence: str) -> None:
        out.append(S.ChecklistItem(item=f"{i}: {items[i]}", ok=bool(good), evidence=evidence))

    add("brief-read", True, f"method {brief.method_label} ({brief.method}); format {brief.dataset_format}; max_seq_length {seq_said(data)}; "
        f"packing {str(brief.packing).lower()}" + (f"; defaults: {', '.join(brief.defaults_applied)}" if brief.defaults_applied else ""))
    fits = fmt in [n for n, s in tables["formats"]["formats"].items() if brief.method in s["methods"]]
    add("format-fits-method", bool(fmt) and fits,
        f"detected {job.get('shape')}" + (f", converted by {job['conversion']}" if job.get("conversion") else "")
        + f"; {brief.method} takes {', '.join(n for n, s in tables['formats']['formats'].items() if brief.method in s['methods'])}")
    add("validation-clean", not errors and job.get("stage") != "validation",
        ("no failing problem" if not errors else "errors: " + ", ".join(f"{k} x{v}" for k, v in sorted(errors.items())))
        + ("; warnings: " + ", ".join(f"{k} x{v}" for k, v in sorted(warns.items())) if warns else ""))
    if ok:
        add("template-before-packing", bool(tpl.get("sha256")) or fmt == "grpo" or not tpl.get("assistant_only_loss"),
            f"per-example apply_chat_template ({tpl.get('source')}, sha256 {str(tpl.get('sha256'))[:12]}) ran before "
            + ("trl.data_utils.pack_dataset" if pk.get("enabled") else "any batching (packing off)"))
        tt = tok.get("trained_tokens_per_sequence")
        stop = tpl.get("stop_token_trained")
        add("loss-mask", fmt == "grpo" or (tt is not None and tt["min"] > 0),
            ("GRPO: loss on sampled completions; no target tokens in the data" if fmt == "grpo" else
             f"trained tokens per sequence min {tt['min']}, mean {tt['mean']}; "
             + ("assistant turns only" if tpl.get("assistant_only_loss") else "completion only")
             + ("; end-of-turn token inside the mask" if stop else "; end-of-turn token NOT in the mask" if stop is False else "")))
        dmin = tables["validation"]["decoded_samples"]["min"]
        if pk.get("enabled"):
            att = pk.get("attention") or {}
            n = pk.get("decoded_rows", 0)
            add("packing-inspected", n >= min(dmin, pk.get("rows", 0)) and att.get("verified") is True,
                f"{n} packed rows decoded into validation-report.md with boundaries and trained spans marked; efficiency "
                f"{pk.get('efficiency'):.1%}; attention separation {'verified' if att.get('verified') else 'NOT verified'} "
                f"({att.get('samples', 0)} samples: position_ids restarts and cu_seq_lens match the sample boundaries)")
        else:
            add("packing-inspected", True, f"packing off in the brief; {len(job.get('decoded_samples') or [])} templated examples decoded with trained spans marked")
        add("lengths-fit", "too-long" not in errors, long_records_said(job, data))
        vals = col.get("values") or {}
        add("collapse-guard", "fail" not in (col.get("verdicts") or {}).values(),
            ", ".join(f"{k} {v} ({(col.get('verdicts') or {}).get(k)})" for k, v in vals.items()))
        files = [f for f in ("train.jsonl", "eval.jsonl", "meta.json") if final_dir and (final_dir / f).is_file()]
        counts = job.get("counts") or {}
        add("splits-written", len(files) == 3,
            f"{final_dir}: {', '.join(files)}; train {counts.get('train')} / eval {counts.get('eval')}; sha256 "
            + ", ".join(f"{k} {v[:12]}" for k, v in (job.get("files_sha256") or {}).items()))
        add("card-complete", card_ok, "data/dataset-card.md has " + ", ".join(f["title"] for f in tables["card"]["card_fields"]) if card_ok else "card missing a field")
    else:
        for i in ("template-before-packing", "loss-mask", "packing-inspected", "lengths-fit", "collapse-guard", "splits-written", "card-complete"):
            add(i, False, f"not reached: the {job.get('stage')} stage failed")
    add("committed", bool(commit_id) and ok, f"experiments commit {commit_id[:12]}" + ("" if ok else " (brief and failure report only)"))
    return out


def _fence(text: str) -> str:
    return "````text\n" + text.replace("````", "` ` ` `") + "\n````"


def _report(brief: Brief, name: str, final_dir: Path, src: dict, job: dict, tables: dict, now: str, data: dict) -> str:
    ok = bool(job.get("ok"))
    counts = job.get("counts") or {}
    L = [f"# Validation report: {name}", "",
         f"- Prepared: {now} by finetune-mcp prepare_dataset",
         f"- Brief: {brief.path} — method {brief.method_label}, max_seq_length {seq_said(data)}, packing {str(brief.packing).lower()}",
         f"- Source: {src.get('given') or src.get('path') or src.get('id')}",
         f"- Verdict: {'PASSED — written to ' + str(final_dir) if ok else 'FAILED in the ' + str(job.get('stage')) + ' stage — nothing written to datasets/'}",
         f"- Format: detected {job.get('shape')}" + (f", converted by {job['conversion']}" if job.get("conversion") else "") + f" → {job.get('format')}",
         f"- Records: {', '.join(f'{k} {v}' for k, v in counts.items())}", ""]
    if job.get("ignored_files"):
        L += [f"- Ignored (held-out split files in the source folder): {', '.join(job['ignored_files'])}", ""]
    L += ["## Problems", ""]
    pcounts = job.get("problem_counts") or {}
    if not pcounts:
        L += ["None.", ""]
    else:
        L += ["| code | errors | warnings |", "|---|---|---|"]
        L += [f"| {k} | {v['error']} | {v['warning']} |" for k, v in sorted(pcounts.items())]
        L += ["", f"Listed one by one (up to {tables['validation']['listed_per_code']} per code):", "",
              "| severity | code | where | record | field | message |", "|---|---|---|---|---|---|"]
        for p in job.get("problems", []):
            loc = (Path(p["file"]).name if p.get("file") else "") + (f":{p['line']}" if p.get("line") else "")
            msg = str(p["message"]).replace("|", "\\|").replace("\n", " ")
            L.append(f"| {p['severity']} | {p['code']} | {loc} | {'' if p.get('record') is None else p['record']} | {p.get('field') or ''} | {msg} |")
        L.append("")
    if not ok:
        if (final_dir / "meta.json").is_file():
            L += [f"{final_dir} still holds the dataset an earlier run prepared; data/dataset-card.md describes that one.", ""]
        return "\n".join(L)
    tok = job.get("tokens") or {}
    tpl = job.get("template") or {}
    L += ["## Conversion", "", *conversion_lines(job, tables), ""]
    L += ["## Token lengths", "", "| measure | min | p50 | p90 | p95 | p99 | max | mean |", "|---|---|---|---|---|---|---|---|"]
    for label, key in (("templated records, before long_records", "record_lengths"), ("tokens per sequence, as trained", "tokens_per_sequence"),
                       ("trained tokens per sequence", "trained_tokens_per_sequence")):
        s = tok.get(key)
        if s:
            L.append(f"| {label} | {s['min']} | {s['p50']} | {s['p90']} | {s.get('p95')} | {s['p99']} | {s['max']} | {s['mean']} |")
    lr = job.get("long_records") or {}
    L += ["", f"- {long_records_said(job, data)}.", ""]
    dups = job.get("duplicates") or []
    for title, items, fmt in (("Dropped for length", lr.get("dropped") or [], lambda d: f"{d['tokens']} tokens: {d['why']}"),
                              ("Truncated", lr.get("truncated") or [], lambda d: f"{d['tokens']} tokens: {d['what']}"),
                              ("Exact duplicates removed", dups, lambda d: f"same as {d['same_as']}")):
        if items:
            L += [f"### {title} ({len(items)})", "", "| where | record | what |", "|---|---|---|"]
            L += [f"| {d['where']} | {d['record']} | {fmt(d).replace('|', chr(92) + '|')} |" for d in items] + [""]
    L += ["",
          "## Chat template and loss mask", "",
          f"- Template: {tpl.get('source')} (sha256 {tpl.get('sha256')}), applied to each example on its own before any packing.",
          f"- Generation markers in the base template: {tpl.get('generation_markers')}; loss on "
          + ("assistant turns (assistant_only_loss)" if tpl.get("assistant_only_loss") else "the completion only" if job.get("format") != "grpo" else "sampled completions (GRPO)"),
          f"- Assistant end-of-turn token inside the loss mask: {tpl.get('stop_token_trained')}", ""]
    L += _masking_lines(tpl.get("masking"))
    pk = job.get("packing")
    L += ["## Packing", ""]
    if pk and pk.get("enabled"):
        att = pk.get("attention") or {}
        L += [f"- {pk['function']}(strategy=\"{pk['strategy']}\", seq_length={pk['seq_length']}) on {pk['sequences_in']} training sequences "
              f"→ {pk['rows']} rows ({pk['rows_with_several_samples']} hold several samples).",
              f"- Packing efficiency (real tokens / rows × seq_length): {pk['efficiency']:.2%}.",
              f"- Cross-sample attention: {att.get('how')}.",
              f"- Checked on the decoded rows with TRL's collator and transformers' find_packed_sequence_indices: "
              + ("verified" if att.get("verified") else f"NOT verified {att.get('error', '')}")
              + f" ({att.get('samples', 0)} samples; segment starts match: {att.get('segment_starts_match')}, cu_seq_lens match: "
              f"{att.get('cu_seq_lens_match')}, attention mask dropped: {att.get('attention_mask_dropped')}).", ""]
    else:
        L += ["Packing is off in the brief; each example is its own sequence, truncated at max_seq_length.", ""]
    L += ["## Decoded samples", "",
          f"Trained tokens are wrapped in {'⟦'} {'⟧'}; `──` lines mark sample boundaries"
          + (" inside a packed row (the labels shown are the ones TRL's padding-free collator hands the model)" if pk and pk.get("enabled") else "")
          + ".", ""]
    for t in job.get("decoded_samples") or []:
        L += [_fence(t), ""]
    col = job.get("collapse") or {}
    bounds = tables["collapse"]["metrics"]
    L += ["## Collapse guard", "", f"Measured on the trained text ({col.get('sample_words')} words sampled for distinct-n).", "",
          "| metric | value | bounds | verdict |", "|---|---|---|---|"]
    for k, v in (col.get("values") or {}).items():
        b = bounds.get(k, {})
        bs = ", ".join(f"{x.replace('_', ' ')} {b[x]}" for x in ("fail_below", "warn_below", "warn_above", "fail_above") if b.get(x) is not None) or "reported only"
        L.append(f"| {k} | {v} | {bs} | {(col.get('verdicts') or {}).get(k)} |")
    nd = job.get("near_duplicates") or {}
    L += ["", f"Near duplicates: {nd.get('records', 0)} records ({nd.get('share', 0):.1%}); each cluster was kept within one split.", ""]
    return "\n".join(L)


def _card(brief: Brief, name: str, final_dir: Path, src: dict, model, job: dict, tables: dict, eval_fraction: float, now: str,
          data: dict) -> str:
    fields = {f["key"]: f["title"] for f in tables["card"]["card_fields"]}
    counts = job.get("counts") or {}
    tok = job.get("tokens") or {}
    tpl = job.get("template") or {}
    pk = job.get("packing") or {}
    col = job.get("collapse") or {}
    meta = {}
    try:
        meta = json.loads((final_dir / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    license_text, license_src = _license(src)
    if license_text is None and brief.dataset_expectation.get("license"):
        license_text, license_src = str(brief.dataset_expectation["license"]), "the brief's Dataset Expectation"
    spec = tables["formats"]["formats"].get(job.get("format") or "", {})
    risks: list[str] = []
    if license_text is None:
        risks.append("No license was found with the source (no LICENSE file beside it, no license in a dataset card or in the brief): "
                     "check the terms before sharing the model.")
    prov = job.get("provenance") or data.get("provenance") or {}
    if prov.get("value"):
        rule = tables["collapse"]["provenance"][prov["value"]]
        risks.append(f"Provenance: {prov['value']}" + (f" ({'stated by ' + prov['from'] if prov.get('stated', True) and prov.get('from') else 'not stated; the default'})")
                     + f": the collapse guard's fail bounds {'fail the set' if rule['on_fail'] == 'error' else 'are reported as warnings'}.")
    for p in job.get("problems") or []:
        if p["severity"] == "warning" and p["code"].startswith(("collapse-", "provenance-", "fill-")):
            risks.append(p["message"] + ".")
    pcounts = job.get("problem_counts") or {}
    for code, label in (("exact-duplicate", "exact duplicates dropped"), ("near-duplicate", "near duplicates kept (each cluster in one split)"),
                        ("too-long", f"records longer than max_seq_length (long_records: {(job.get('long_records') or {}).get('policy', 'drop')}; see Processing)"),
                        ("stop-token", "end-of-turn token outside the loss mask"), ("one-sided-labels", "KTO labels all one kind")):
        n = (pcounts.get(code) or {}).get("warning", 0)
        if n:
            risks.append(f"{n} {label}.")
    risks.append(f"The eval split ({counts.get('eval')} records) comes from the same source by content hash: it measures fit to this "
                 "distribution, not generalisation beyond it.")
    if brief.sections.get("dataset_expectation"):
        prose = [ln.strip() for ln in brief.sections["dataset_expectation"].splitlines() if ln.strip() and not re.match(r"^[-*]?\s*\w[\w ]{0,40}:\s*\S", ln.strip())]
        if prose:
            risks.append("From the brief: " + " ".join(prose))
    ts = job.get("trainer_settings") or {}
    L = [f"# Dataset card: {name}", "", f"Prepared {now} by finetune-mcp prepare_dataset for experiment {brief.experiment}. "
         f"Files: {final_dir}/train.jsonl, eval.jsonl, meta.json. Rebuild with `python data/prepare.py`.", ""]
    L += [f"## {fields['source-and-license']}", "",
          f"- Source: {src.get('given') or src.get('path') or src.get('id')}"
          + (f" (HF dataset {src['id']}" + (f", config {src['config']}" if src.get("config") else "") + (f", split {src['split']}" if src.get("split") else "")
             + ", loaded by datasets.load_dataset)" if src["kind"] == "hf" else ""),
          *(f"- {Path(f).name}: sha256 {d}" for f, d in (meta.get("source_sha256") or {}).items()),
          f"- License: {license_text + ' (' + license_src + ')' if license_text else 'not stated by the source'}", ""]
    L += [f"## {fields['format-and-method-fit']}", "",
          *conversion_lines(job, tables),
          f"- Format: {job.get('format')} — required columns {', '.join(spec.get('required_fields', []))}",
          f"- Chosen method: {brief.method_label}; the format table lists {job.get('format')} for "
          f"{', '.join(spec.get('methods', []))}, so it fits.",
          f"- Loss on: {spec.get('loss_on')}", f"- Trainer setting: {spec.get('trainer_setting')}", ""]
    L += [f"## {fields['size-and-split']}", "",
          f"- Records read {counts.get('read')}, exact duplicates dropped {counts.get('dropped_exact_duplicates', 0)}, "
          f"dropped for length {counts.get('dropped_long', 0)}, truncated {counts.get('truncated', 0)}, kept {counts.get('kept')}",
          f"- Train {counts.get('train')} / eval {counts.get('eval')} (eval_fraction {eval_fraction}); split by a content hash with seed 0, "
          "so a record always lands in the same split; near-duplicate clusters share a split.", ""]
    tps = tok.get("tokens_per_sequence") or {}
    tts = tok.get("trained_tokens_per_sequence") or {}
    L += [f"## {fields['token-length-statistics']}", "",
          f"- Tokenizer: {model.name} ({model.load_path})",
          f"- Tokens per record under the real template ({tpl.get('source')}; a preference pair counts as two sequences): "
          f"p50 {tps.get('p50')}, p95 {tps.get('p95')}, p99 {tps.get('p99')}, max {tps.get('max')} (min {tps.get('min')}, mean {tps.get('mean')}; total {tok.get('total_tokens')})",
          (f"- Trained tokens per sequence: min {tts.get('min')}, median {tts.get('p50')}, max {tts.get('max')}, mean {tts.get('mean')}" if tts else "- Trained tokens: none in the data (GRPO samples its completions)"),
          f"- Share over max_seq_length {seq_said(data)}: {tok.get('over_share', 0):.1%} ({tok.get('over_max_seq_length', 0)} records, {tok.get('tokens_cut', 0)} tokens cut)",
          f"- {long_records_said(job, data)}",
          *([f"- max_seq_length was not in the brief: the method's default applies; the data's p99 is {tps.get('p99')} tokens, "
             f"so `max_seq_length: {tps.get('p99')}` fits 99% of the records"] if data["max_seq_length_from"] == "default" else []), ""]
    L += [f"## {fields['processing']}", "",
          f"- Template: {tpl.get('source')} of the base model, sha256 {tpl.get('sha256')}; applied per example before packing.",
          f"- Masking: " + ("assistant turns only (assistant_only_loss=True)" if tpl.get("assistant_only_loss") else
                            "sampled completions only (GRPO)" if job.get("format") == "grpo" else "completion only")
          + (f"; end-of-turn token trained: {tpl.get('stop_token_trained')}" if tpl.get("stop_token_trained") is not None else ""),
          (f"- Packing: TRL pack_dataset, strategy bfd, {pk.get('seq_length')} tokens, {pk.get('rows')} rows, efficiency {pk.get('efficiency'):.1%}; "
           f"cross-sample attention kept apart by padding-free position_ids restarts ({'verified' if (pk.get('attention') or {}).get('verified') else 'not verified'})"
           if pk.get("enabled") else "- Packing: off"),
          f"- Trainer settings to use (meta.json trainer_settings): {json.dumps(ts)}", "",
          "### Records removed or changed", "", *transformation_lines(job, data), ""]
    L += _masking_lines(tpl.get("masking"))
    L += [f"## {fields['known-limitations-and-risks']}", "", *(f"- {r}" for r in risks), "",
          "Collapse guard readings: " + ", ".join(f"{k} {v}" for k, v in (col.get("values") or {}).items()) + ".", ""]
    return "\n".join(L)


def _license(src: dict) -> tuple[str | None, str | None]:
    """The license named by a dataset card or LICENSE file beside the source, if any."""
    for c in _card_cands(src):
        try:
            text = c.read_text(encoding="utf-8", errors="replace")[:20000]
        except OSError:
            continue
        m = re.search(r"^license:\s*(.+)$", text, re.M | re.I)
        if m:
            return m.group(1).strip().strip("'\""), c.name
        if c.name.upper().startswith("LICENSE") or c.name == "DATASET_LICENSE":
            first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
            return (first[:80] or "see file"), c.name
    return None, None


def _prepare_py(name: str, params: dict, now: str) -> str:
    p = {k: v for k, v in params.items() if k not in ("out_dir",)}
    return f'''#!/usr/bin/env python3
"""Rebuilds dataset {name!r} from its source, exactly as prepare_dataset did on {now}.

Run it with the training Python (the one with transformers, trl and datasets):

    python data/prepare.py

It writes $DATASET_DIR, else $DGX_SPARK_ROOT/datasets/{name}/ (DGX_SPARK_ROOT defaults to ~/dgx-spark):
train.jsonl, eval.jsonl and meta.json, through a staging folder that is renamed into place only when
every check passes. Paths below are absolute; edit SOURCE or MODEL_PATH if the data or model moved.
It needs the finetune_mcp package importable (pip install finetune-mcp, or PYTHONPATH=<checkout>/server).
"""

import json
import os
import sys
from pathlib import Path

PARAMS = json.loads(r"""
{json.dumps(p, indent=2, ensure_ascii=False)}
""")


def main() -> int:
    try:
        from finetune_mcp.jobs.prepare_data import reproduce
    except ImportError:
        print("finetune_mcp is not importable: pip install finetune-mcp into this Python, or set PYTHONPATH to the checkout's server/ folder", file=sys.stderr)
        return 2
    root = Path(os.environ.get("DGX_SPARK_ROOT") or Path.home() / "dgx-spark").expanduser()
    out = Path(os.environ.get("DATASET_DIR") or root / "datasets" / PARAMS["name"])
    res = reproduce(PARAMS, out)
    print(f"wrote {{out}}: train {{res['counts']['train']}}, eval {{res['counts']['eval']}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


# ---------------------------------------------------------------- drafting a brief (the draft_brief MCP prompt)


_SHAPE_METHOD = {
    "preference": "DPO", "implicit-prompt-preference": "DPO", "alpaca-preference": "DPO", "sharegpt-preference": "DPO",
    "messages-preference": "DPO", "openai-preference": "DPO", "paired-messages": "DPO",
    "kto": "KTO", "messages-label": "KTO", "sharegpt-kto": "KTO", "alpaca-kto": "KTO",
    "grpo": "GRPO", "prompt-only": "GRPO", "vision": "VLM-SFT",
}


def draft_brief(pc: PhaseContext, goal: str, base_model: str, data_file: str) -> str:
    """A prompt that hands the agent a draft brief for a one-line goal, a base model and a data file: the method
    follows from the data's shape (read with the same light pass prepare_dataset uses), the rest from the example
    brief, and every value the draft had to assume is marked ASK for the agent to confirm with the user."""
    from finetune_mcp.phases.brief import example_brief, slugify

    real = pc.guard.check_read(data_file, "data_file")
    if not real.exists():
        raise NotFound(f"data file {data_file!r} not found", where=str(real), fix="pass an existing data file or folder")
    shape, rows, holes = "unknown", None, []
    try:
        kind, files, _ = R.source_files(real)
        if kind == "text" and sum(f.stat().st_size for f in files) <= LIGHT_PASS_MAX_BYTES:
            raw, _ = R.read_text_source(real)
            rows = len(raw.rows)
            shape = R.detect_shape(raw.rows, pc.skills.table(SKILL, "formats").reference_fields)
            holes = sorted({n for r in raw.rows[:2000] for _, names in C.find_placeholders(r) for n in names})
    except JobError:
        pass
    method = _SHAPE_METHOD.get(shape, "SFT-LoRA")
    slug = slugify(" ".join(goal.split()[:5])) or "task"
    lines = [f"# Training brief: {goal.strip()}", "", "## Task", f"{slug} — {goal.strip()}", "", "## Base Model", base_model.strip(), "",
             "## Chosen Method", method,
             f"<!-- from the data's shape ({shape}); ASK whether the user meant another method -->", "",
             "## Dataset Expectation", f"Records from {real.name}.", ""]
    if rows is not None:
        lines.append(f"examples: ~{rows}")
    lines += ["<!-- ASK: provenance: synthetic | curated | mixed (curated sets get collapse warnings, not a refusal) -->"]
    if holes:
        lines.append(f"<!-- ASK: the records hold {', '.join('{{' + h + '}}' for h in holes)}: add "
                     f"fill: {', '.join(h + '=...' for h in holes)} -->")
    lines += ["<!-- max_seq_length left out: prepare_dataset takes the recipe default and reports the data's p99 to state here -->", "",
              "## Memory Budget", "24 GB", "<!-- ASK: the memory of the machine that trains -->", "",
              "## Deployment Target", "transformers (lora)", "<!-- ASK: transformers, vllm, llama.cpp or ollama, and a format -->", "",
              "## Evaluation", "min_accuracy: 0.8", "<!-- ASK: the bar the tuned model must clear -->"]
    if method == "GRPO":
        lines += ["", "## Reward", "format" if shape == "prompt-only" else "exact_match, format"]
    draft = "\n".join(lines) + "\n"
    return (
        f"Draft a training brief for this goal: {goal.strip()}\n\nBase model: {base_model.strip()}. Data: {real} "
        f"({shape} shape" + (f", {rows} records" if rows is not None else "") + ").\n\n"
        "Below is a draft. Confirm every line marked ASK with the user, save it as training-brief.md, then call "
        f"prepare_dataset(brief_path=..., source={str(real)!r}). Every section and accepted value is in the example brief "
        "(resource brief://example), shown after the draft.\n\n"
        f"````markdown\n{draft}````\n\nThe example brief:\n\n````markdown\n{example_brief()}````\n"
    )
