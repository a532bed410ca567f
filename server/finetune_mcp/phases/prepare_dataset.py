"""prepare_dataset: open the experiment from a brief, prepare and inspect its dataset, write the card and the report.

Light on purpose: JSONL/JSON/CSV records are read and validated here with the stdlib (common/records.py), so bad
input is refused before any child starts; everything that needs the training stack (Parquet, save_to_disk, the HF
cache, the tokenizer, TRL packing) runs in one worker job, jobs/prepare_data.py, which reads the source again with
the same code. The job writes into a hidden staging folder under datasets/; it is renamed into place only when every
check passed, so a failure leaves nothing behind.

Stages: the brief and the names -> the source and the base model -> the light pass -> open the experiment (brief,
README, committed whatever the data turns out to be) -> the job (building the embedded model first if needed) ->
install, write the report, the card and data/prepare.py, commit -> the exit checklist and the result.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from finetune_mcp import schemas as S
from finetune_mcp.common import records as R
from finetune_mcp.common.errors import BadInput, FtError, NotFound, from_dict
from finetune_mcp.common.proto import JobError
from finetune_mcp.context import PhaseContext
from finetune_mcp.domain.brief import BRIEF_FILE, Brief, load_brief
from finetune_mcp.domain.dataset_docs import card, checklist, long_records_said, removed_said, report, where_said
from finetune_mcp.domain.prepare_script import render_prepare_py
from finetune_mcp.domain.sources import LIGHT_PASS_MAX_BYTES, data_settings, resolve_source
from finetune_mcp.models import resolve_base_model
from finetune_mcp.worker import prewarm, run_job
from finetune_mcp.workspace import commit, utc_now

SKILL = "dataset-curation"
_NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,119}\Z")
# Overall progress: brief and light pass, then the worker's seven stages, then the write-up.
_TOTAL = 10.0


@dataclass
class Prep:
    """What the stages hand on: the brief, where the data goes, the source, the model, the data settings."""
    brief: Brief
    exp_dir: Path
    name: str
    final_dir: Path
    src: dict
    model: object
    data: dict
    tables: dict
    eval_fraction: float


def prepare_dataset(pc: PhaseContext, args: S.PrepareDatasetArgs) -> S.PrepareDatasetResult:
    eval_fraction = args.eval_fraction
    if not isinstance(eval_fraction, (int, float)) or isinstance(eval_fraction, bool) or not (0 <= eval_fraction < 0.5):
        raise BadInput(f"eval_fraction {eval_fraction!r} is out of range", where="eval_fraction", fix="use a fraction from 0 up to (not including) 0.5, e.g. 0.05")
    pc = _monotonic(pc)
    p, brief_text = _load(pc, args)
    light = _light_pass(pc, p)
    if light is None or not light["checked"].sink.errors:
        prewarm()  # a job follows: the worker imports the training stack while the experiment opens
    _open_experiment(pc, p.exp_dir, p.brief, brief_text)
    if light is not None and light["checked"].sink.errors:
        return _finish(pc, p, _refused_job(light))
    if p.model.embedded and not p.model.exists:
        pc.progress(1, _TOTAL, f"building the embedded base model {p.model.name}")
        pc.guard.check_write(p.model.path, "base model")
        run_job("build_tiny_model", {"target_dir": str(p.model.path), "seed": 0}, timeout=900)
    return _finish(pc, p, _run_prepare(pc, p))


def _load(pc: PhaseContext, args: S.PrepareDatasetArgs) -> tuple[Prep, str]:
    pc.progress(0, _TOTAL, "reading the brief")
    brief_real = pc.guard.check_read(args.brief_path, "brief_path")
    brief_text = _read_brief_text(brief_real)
    brief = load_brief(brief_real)
    tables = _tables(pc)
    experiment = brief.experiment
    exp_dir = pc.guard.check_write(pc.ws.experiment_dir(experiment, must_exist=False), "experiment")
    name = args.dataset_name if args.dataset_name is not None else experiment
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise BadInput(f"invalid dataset_name {name!r}", where="dataset_name", fix="use letters, digits, '.', '_' and '-' (up to 120), starting with a letter or digit")
    final_dir = pc.guard.check_write(pc.ws.datasets_dir / name, "dataset_name")
    src = resolve_source(pc, args.source)
    model = resolve_base_model(brief.base_model, pc.ws.base_models_dir, data_dirs=pc.guard.read_roots)
    data = data_settings(pc, brief, src)
    return Prep(brief, exp_dir, name, final_dir, src, model, data, tables, args.eval_fraction), brief_text


def _light_pass(pc: PhaseContext, p: Prep) -> dict | None:
    """Plain-text sources are read and checked here, so bad records never cost a child start; None for the others."""
    if p.src["kind"] != "path":
        return None
    tables, data = p.tables, p.data
    try:
        kind, files, _ = R.source_files(Path(p.src["path"]))
        if kind != "text" or sum(f.stat().st_size for f in files) > LIGHT_PASS_MAX_BYTES:
            return None
        pc.progress(0.5, _TOTAL, "reading and validating the records")
        raw, sink = R.read_text_source(Path(p.src["path"]), tables["validation"]["listed_per_code"])
        checked = R.check_records(raw, sink, method=p.brief.method, formats=tables["formats"], validation=tables["validation"],
                                  path_ok=_path_ok(pc), fill=data["fill"], keep_placeholders=data["keep_placeholders"],
                                  needs_reference=data["needs_reference"],
                                  provenance=(data["provenance"] or {}).get("value"))
        if len(checked.records) < tables["validation"]["min_examples"] and not sink.errors:
            sink.error("too-few-records", f"{len(checked.records)} usable records; the skill asks for at least {tables['validation']['min_examples']}")
        return {"checked": checked, "raw": raw}
    except JobError as e:
        raise _err(e) from None


def _refused_job(light: dict) -> dict:
    """The light pass's refusal in the shape of a job result, for the report."""
    c = light["checked"]
    return {"ok": False, "stage": "validation", "shape": c.shape, "format": c.format, "conversion": c.conversion,
            "conversion_report": c.extra.get("report"),
            "files": light["raw"].files, "ignored_files": light["raw"].ignored,
            "counts": {"read": c.read, "kept": len(c.records), "dropped_exact_duplicates": c.dropped["exact-duplicate"]},
            **c.sink.to_dict()}


def _run_prepare(pc: PhaseContext, p: Prep) -> dict:
    datasets_dir = p.final_dir.parent
    datasets_dir.mkdir(parents=True, exist_ok=True)
    stage = pc.guard.check_write(datasets_dir / f".staging-{p.name}-{uuid.uuid4().hex[:8]}", "staging")
    params = _job_params(p, [str(r) for r in pc.guard.read_roots])
    params["out_dir"] = str(stage)

    def progress(done, total, message):
        pc.progress(1 + 7 * float(done) / float(total or 7), _TOTAL, message)

    try:
        stage.mkdir()  # made here, so it goes with the job if this server dies (scratch)
        job = run_job("prepare_data", params, progress=progress, timeout=900 + 0.05 * _size_hint(p.src), scratch=[str(stage)])
        job["_stage_dir"] = str(stage)
        job["_params"] = params
        if not job.get("ok"):
            shutil.rmtree(stage, ignore_errors=True)
        return job
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _job_params(p: Prep, roots: list[str]) -> dict:
    brief, data = p.brief, p.data
    return {
        "name": p.name,
        "experiment": brief.experiment,
        "source": {k: v for k, v in p.src.items() if k != "given"},
        "model_path": p.model.load_path,
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
        "eval_fraction": float(p.eval_fraction),
        "seed": 0,
        "tables": {k: p.tables[k] for k in ("formats", "validation", "collapse")},
        "allowed_roots": roots,
    }


def _finish(pc: PhaseContext, p: Prep, job: dict) -> S.PrepareDatasetResult:
    ok = bool(job.get("ok"))
    written, commit_id, card_ok = _write_docs(pc, p, job)
    items = checklist(p.brief, job, p.tables, p.final_dir if ok else None, card_ok if ok else False, commit_id, p.data)
    complete = ok and all(c.ok for c in items)
    cites = [pc.skills.cite(SKILL, a) for a in ("format-table", "conversions", "placeholders", "validation-thresholds", "chat-template", "loss-masking",
                                                "packing", "collapse-guard", "dataset-card", "phase-2-exit-checklist")]
    counts = {k: v for k, v in (job.get("counts") or {}).items() if isinstance(v, int)}
    res = S.PrepareDatasetResult(
        summary=_summary(p, job, counts, complete),
        citations=cites,
        experiment=p.exp_dir.name,
        experiment_dir=str(p.exp_dir),
        method=p.brief.method,
        format=job.get("format") or p.brief.dataset_format,
        converted_from=job.get("shape") if job.get("conversion") else None,
        conversion=job.get("conversion_report"),
        max_seq_length=p.data["max_seq_length"],
        provenance=(job.get("provenance") or {}).get("value") or (p.data["provenance"] or {}).get("value"),
        tokens=job.get("tokens"),
        transformations=({"long_records": job.get("long_records"), "exact_duplicates": job.get("duplicates") or [],
                          "line": long_records_said(job, p.data)} if job.get("tokens") else None),
        dataset_dir=str(p.final_dir) if ok else None,
        counts=counts,
        problems=[S.Problem(**x) for x in job.get("problems", [])],
        problem_counts=job.get("problem_counts") or {},
        masking=(job.get("template") or {}).get("masking"),
        packing=job.get("packing"),
        decoded_samples=job.get("decoded_samples") or [],
        files=[str(x) for x in written] + ([str(p.final_dir / f) for f in ("train.jsonl", "eval.jsonl", "meta.json")] if ok else []),
        checklist=items,
        complete=complete,
    )
    pc.progress(_TOTAL, _TOTAL, "done")
    return res


def _write_docs(pc: PhaseContext, p: Prep, job: dict) -> tuple[list[Path], str, bool]:
    """Install the prepared set, then the validation report, the card and data/prepare.py, committed; the staging
    folder goes if anything here fails."""
    ok = bool(job.get("ok"))
    stage = job.pop("_stage_dir", None)
    params = job.pop("_params", None) or _job_params(p, [])
    pc.progress(8.5, _TOTAL, "writing the dataset card and the validation report")
    now = utc_now()
    data_dir = p.exp_dir / "data"
    report_path, card_path, prep_path = data_dir / "validation-report.md", data_dir / "dataset-card.md", data_dir / "prepare.py"
    written: list[Path] = [p.exp_dir / BRIEF_FILE]
    if (p.exp_dir / "README.md").exists():
        written.append(p.exp_dir / "README.md")
    try:
        if ok:
            _install(Path(stage), p.final_dir)
        card_text = card(p.brief, p.name, p.final_dir, p.src, p.model, job, p.tables, p.eval_fraction, now, p.data) if ok else None
        card_ok = bool(card_text) and all(f"## {f['title']}" in card_text for f in p.tables["card"]["card_fields"])
        pc.guard.write_text(report_path, report(p.brief, p.name, p.final_dir, p.src, job, p.tables, now, p.data))
        written.append(report_path)
        if ok:
            pc.guard.write_text(card_path, card_text)
            pc.guard.write_text(prep_path, render_prepare_py(p.name, params, now))
            written += [card_path, prep_path]
        commit_id = commit(pc.ws.experiments_repo, written, f"prepare_dataset: {p.name} ({'prepared' if ok else 'validation failed'})")
    except BaseException:
        if stage and Path(stage).exists():
            shutil.rmtree(stage, ignore_errors=True)
        raise
    return written, commit_id, card_ok


def _summary(p: Prep, job: dict, counts: dict, complete: bool) -> str:
    pcounts = (job.get("problem_counts") or {}).values()
    n_err, n_warn = sum(c["error"] for c in pcounts), sum(c["warning"] for c in pcounts)
    if job.get("ok"):
        pk = job.get("packing") or {}
        return (f"Phase 2 {'complete' if complete else 'NOT complete'}: {counts.get('train', 0)} train / {counts.get('eval', 0)} eval "
                f"{job.get('format')} records in datasets/{p.name}"
                + (f"; packed at {pk.get('seq_length')} tokens, efficiency {pk.get('efficiency'):.1%}" if pk.get("enabled") else "")
                + removed_said(job)
                + (f"; {n_warn} warning(s)" if n_warn else ""))
    problems = [S.Problem(**x) for x in job.get("problems", [])]
    first = next((x for x in problems if x.severity == "error"), None)
    where = where_said(first) if first else ""
    return (f"Phase 2 NOT complete: {n_err} error(s) in the {job.get('stage')} stage"
            + (f" (first: {where} — {first.message})" if first else "") + f"; nothing written to datasets/{p.name}")


def _tables(pc: PhaseContext) -> dict[str, dict]:
    return {t: pc.skills.table(SKILL, t).model_dump(mode="json") for t in ("formats", "validation", "collapse", "card")}


def _err(e: JobError) -> FtError:
    return from_dict({"kind": e.kind, "message": e.message, "where": e.where, "fix": e.fix})


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


def _size_hint(src: dict) -> int:
    try:
        return Path(src["path"]).stat().st_size // 200 if src["kind"] == "path" else 0
    except OSError:
        return 0


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
