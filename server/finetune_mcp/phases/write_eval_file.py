"""write_eval_file: create or replace one file of an experiment's eval suite (eval role only).

The suite lives in $DGX_SPARK_ROOT/eval/<experiment>/, its own git repository (domain/suite.py says what each
file holds); every write is checked against the file's format first and committed there.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from finetune_mcp import schemas as S
from finetune_mcp.common.errors import BadInput, Forbidden
from finetune_mcp.context import PhaseContext
from finetune_mcp.domain.suite import (
    EVAL_DIR,
    MACHINE_PARTS,
    MAX_EVAL_FILE,
    commit_eval,
    ensure_eval_repo,
    resolve_scorers,
    suite_dir,
    validate_suite_file,
)


def write_eval_file(pc: PhaseContext, args: S.WriteEvalFileArgs) -> S.WriteEvalFileResult:
    eval_dir = suite_dir(pc, args.experiment)
    rel = _suite_relpath(args.relpath)
    if len(args.content.encode("utf-8")) > MAX_EVAL_FILE:
        raise BadInput(f"content is larger than {MAX_EVAL_FILE // (1024 * 1024)} MiB", where="content")
    target = pc.guard.check_write(eval_dir / rel, "relpath")
    real_eval = Path(os.path.realpath(eval_dir))
    if not target.is_relative_to(real_eval):
        raise Forbidden(f"relpath {args.relpath!r} resolves outside the experiment's eval/", where=str(target))
    rows = _check_content(eval_dir, rel, args.content)
    ensure_eval_repo(eval_dir)
    pc.guard.write_text(target, args.content)
    committed = commit_eval(eval_dir, [target], f"eval: {args.experiment}/{rel}")
    what = f"{len(rows)} rows" if isinstance(rows, list) else ("validated" if rows is not None else "written")
    return S.WriteEvalFileResult(
        summary=f"wrote {args.experiment}/{EVAL_DIR}/{rel} ({what}{', committed ' + committed[:10] if committed else ''})",
        path=str(target),
        bytes=len(args.content.encode("utf-8")),
    )


def _suite_relpath(relpath: str) -> PurePosixPath:
    """The path inside eval/ that relpath names (a leading eval/ dropped), refusing what is not a suite file."""
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
    return rel


def _check_content(eval_dir: Path, rel: PurePosixPath, content: str):
    """The file's rows (or parsed eval.yaml) once it validates, None for a file that is not one of the suite's own."""
    rows = validate_suite_file(rel.name, content) if len(rel.parts) == 1 else None
    if len(rel.parts) == 1 and rel.name in ("prompts.jsonl", "eval.yaml"):
        # The suite default scorer decides what an accepted answer must look like (numbers for numeric):
        # check the pair as it will stand, before anything is written.
        other = eval_dir / ("eval.yaml" if rel.name == "prompts.jsonl" else "prompts.jsonl")
        if other.is_file():
            texts = {rel.name: content, other.name: other.read_text(encoding="utf-8")}
            resolve_scorers(validate_suite_file("prompts.jsonl", texts["prompts.jsonl"]), validate_suite_file("eval.yaml", texts["eval.yaml"]))
    return rows
