"""Phase 6: export a promoted run — verdict check, format choice from the Format Map, artifact, smoke test, report.

The verdict is read by the server itself at verdicts/<experiment>/<run>/promotion-report.md (eval-owned,
world-readable; the training role may not write it through any tool argument) and verified with the eval
role's public key alone, together with the signed evaluation it embeds, the adapter on disk and the base
model under it. GGUF goes through llama.cpp's own converter (found as described in converter_path) and quantizer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from finetune_mcp import schemas as S
from finetune_mcp.context import PhaseContext
from finetune_mcp.common.errors import BadInput, Refused
from finetune_mcp.domain.run_facts import adapter_digest, append_roadbook, base_model_of, load_run_brief, run_paths
from finetune_mcp.domain.verdicts import cell, prompt_text, read_verdict
from finetune_mcp.worker import run_job
from finetune_mcp.workspace import utc_now


SKILL = "quantized-export"
CONVERTER_ENV = "FINETUNE_MCP_LLAMA_CPP_CONVERTER"
SDIST_ENV = "FINETUNE_MCP_LLAMA_CPP_SDIST"
PRE_TOKENIZER_ENV = "FINETUNE_MCP_GGUF_PRE_TOKENIZER"
_SDIST_RE = re.compile(r"^llama_cpp_python-(\d+(?:\.\d+)*)\.tar\.gz$")


# ---------------------------------------------------------------- format map


def choose(pc: PhaseContext, brief, fmt: str | None, runtime: str | None) -> tuple[Any, Any, list[str]]:
    """(runtime row, format row, how each was chosen) from the arguments, the brief and the Format Map."""
    fm = pc.skills.table(SKILL, "format-map")
    why: list[str] = []
    b_rt, b_fmt = (brief.deploy_runtime, brief.deploy_format) if brief else (None, None)
    if runtime is None:
        if b_rt and (fmt is None or fmt in fm.runtime(b_rt).formats):
            runtime = b_rt
            why.append(f"runtime {runtime} from the brief's ## Deployment Target")
        elif fmt is not None:
            runtime = next(r.id for r in fm.runtimes if fmt in r.formats)
            why.append(f"runtime {runtime}: the first in the Format Map that serves {fmt}")
        else:
            raise BadInput("no target runtime: the brief names none and none was given", where="target_runtime",
                           fix="pass target_runtime (transformers, vllm, llama.cpp, ollama) or set ## Deployment Target in the brief")
    else:
        why.append(f"runtime {runtime} as asked")
    rt = fm.runtime(runtime)
    if fmt is None:
        if b_fmt and b_rt == runtime:
            if b_fmt not in rt.formats:
                raise BadInput(f"the brief's deployment format {b_fmt!r} is not one export produces for {runtime}", where="training-brief.md: ## Deployment Target",
                               fix=f"pass format explicitly, one of: {', '.join(rt.formats)}")
            fmt = b_fmt
            why.append(f"format {fmt} from the brief's ## Deployment Target")
        else:
            fmt = rt.default_format
            why.append(f"format {fmt}: the Format Map's default for {runtime}")
    else:
        why.append(f"format {fmt} as asked")
    if fmt not in rt.formats:
        raise BadInput(f"{runtime} does not load {fmt}", where="format", fix=f"for {runtime} use one of: {', '.join(rt.formats)} (Format Map)")
    return rt, fm.format(fmt), why


# ---------------------------------------------------------------- locating llama.cpp's converter


def _pick_sdist(cands: list[Path]) -> Path | None:
    def ver(p: Path):
        m = _SDIST_RE.match(p.name)
        return tuple(int(x) for x in m.group(1).split(".")) if m else ()

    try:
        from importlib.metadata import version

        installed = version("llama-cpp-python")
    except Exception:
        installed = None
    cands = [p for p in cands if _SDIST_RE.match(p.name)]
    same = [p for p in cands if installed and _SDIST_RE.match(p.name).group(1) == installed]
    pool = same or cands
    return max(pool, key=ver) if pool else None


def extract_converter(sdist: Path, dest_root: Path) -> Path:
    """Unpack convert_hf_to_gguf.py with its gguf-py/ and conversion/ folders from a llama-cpp-python sdist (once)."""
    dest = dest_root / sdist.name.removesuffix(".tar.gz")
    conv = dest / "convert_hf_to_gguf.py"
    if conv.is_file():
        return conv
    dest_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest_root))
    try:
        try:
            with tarfile.open(sdist, "r:gz") as tf:
                members = []
                for m in tf.getmembers():
                    parts = Path(m.name).parts
                    if "llama.cpp" not in parts[:-1] or not (m.isfile() or m.isdir()):
                        continue
                    rel = Path(*parts[parts.index("llama.cpp") + 1:])
                    if rel.as_posix() == "convert_hf_to_gguf.py" or rel.parts[0] in ("gguf-py", "conversion"):
                        m.name = rel.as_posix()
                        members.append(m)
                if not any(m.name == "convert_hf_to_gguf.py" for m in members):
                    raise Refused(f"{sdist.name} holds no vendor/llama.cpp/convert_hf_to_gguf.py", where=str(sdist),
                                  fix="use a llama-cpp-python source distribution (pip download --no-binary :all:), or set " + CONVERTER_ENV)
                # The "data" filter refuses members that climb out, absolute paths and links leaving the folder.
                tf.extractall(tmp, members=members, filter="data")
        except (tarfile.TarError, OSError) as e:
            raise Refused(f"cannot unpack llama.cpp's converter from {sdist.name}: {type(e).__name__}: {e}", where=str(sdist),
                          fix=f"fetch a fresh sdist with pip download, or set {CONVERTER_ENV}") from None
        try:
            os.rename(tmp, dest)
        except OSError:
            if not conv.is_file():  # a concurrent export unpacked it first
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return conv


def converter_path(pc: PhaseContext) -> Path:
    """llama.cpp's convert_hf_to_gguf.py, in this order:
    1. $FINETUNE_MCP_LLAMA_CPP_CONVERTER: the script itself (a llama.cpp checkout or an unpacked sdist);
    2. $FINETUNE_MCP_LLAMA_CPP_SDIST: a llama_cpp_python-*.tar.gz, or a folder holding some;
    3. $DGX_SPARK_ROOT/tools/: an unpacked llama.cpp*/convert_hf_to_gguf.py, or a llama_cpp_python-*.tar.gz.
    An sdist is unpacked (converter, gguf-py/, conversion/ only) into $DGX_SPARK_ROOT/tools/llama-cpp-converter/.
    """
    tools = pc.ws.root / "tools"
    env_conv = os.environ.get(CONVERTER_ENV)
    if env_conv:
        p = Path(env_conv).expanduser()
        if not p.is_file():
            raise BadInput(f"{CONVERTER_ENV} names {env_conv!r}, which is not a file", where=CONVERTER_ENV,
                           fix="point it at convert_hf_to_gguf.py of a llama.cpp checkout or unpacked llama-cpp-python sdist")
        return p
    cands: list[Path] = []
    env_sdist = os.environ.get(SDIST_ENV)
    if env_sdist:
        p = Path(env_sdist).expanduser()
        cands = sorted(p.glob("llama_cpp_python-*.tar.gz")) if p.is_dir() else ([p] if p.is_file() else [])
        if not cands:
            raise BadInput(f"{SDIST_ENV} names {env_sdist!r}, which is neither an sdist nor a folder holding llama_cpp_python-*.tar.gz", where=SDIST_ENV)
    else:
        for p in sorted(tools.glob("llama.cpp*/convert_hf_to_gguf.py")):
            return p
        cands = sorted(tools.glob("llama_cpp_python-*.tar.gz"))
    sdist = _pick_sdist(cands)
    if sdist is None:
        raise Refused(
            "llama.cpp's converter (convert_hf_to_gguf.py) was not found, so GGUF cannot be made",
            where=f"{CONVERTER_ENV}, {SDIST_ENV}, {tools}",
            fix=f"fetch the source distribution that carries it: `pip download --no-deps --no-binary :all: llama-cpp-python==<installed version> -d {tools}` "
                f"(or set {CONVERTER_ENV} to a llama.cpp checkout's convert_hf_to_gguf.py)",
        )
    return extract_converter(sdist, tools / "llama-cpp-converter")


# ---------------------------------------------------------------- export


_FTYPES = {"gguf-q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "gguf-q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def export(pc: PhaseContext, args: S.ExportArgs) -> S.ExportResult:
    """Stages: the verdict (a REJECT is passed along, nothing exported) -> choose runtime and format -> the
    export_model job (artifact + smoke test) in the worker -> the reports -> the result."""
    run_id = args.run_id
    experiment, r, e = run_paths(pc, run_id)
    digest = adapter_digest(r, run_id)
    verdict = read_verdict(pc, r, run_id, digest)
    if verdict["verdict"] == "REJECT":
        return _pass_reject_along(pc, r, run_id, verdict)
    _check_promote(pc, experiment, run_id, verdict)
    brief = load_run_brief(r, e)
    rt, fm, why = choose(pc, brief, args.format, args.target_runtime)
    params = _job_params(pc, run_id, experiment, r, brief, verdict, rt, fm)
    converter = params["converter"]
    res = run_job("export_model", params, progress=pc.progress, timeout=6 * 3600)
    # The artifact must come from the adapter the verdict named, not one swapped in meanwhile.
    if adapter_digest(r, run_id) != digest:
        raise Refused("adapter/ changed during the export; the artifact cannot be trusted", where=str(r / "adapter"), fix="ask for a fresh verdict, then export again")
    smoke = res["smoke"]
    done = bool(smoke.get("passed"))
    report = _write_reports(pc, r, run_id, verdict, rt, fm, why, res, done, converter)
    append_roadbook(pc, r, f"export {fm.id} for {rt.id}: {'done' if done else 'not done'} ({report})")
    citations = [pc.skills.cite(SKILL, "format-map"), pc.skills.cite(SKILL, "smoke-test"), pc.skills.cite(SKILL, fm.cite), pc.skills.cite(SKILL, rt.cite)]
    return S.ExportResult(
        summary=_summary(run_id, rt, fm, smoke, done),
        citations=list(dict.fromkeys(citations)),
        run_id=run_id,
        exported=done,
        verdict="PROMOTE",
        format=fm.id,
        target_runtime=rt.id,
        artifacts=[a["path"] for a in res["artifacts"]],
        smoke_test=smoke,
        report=str(report),
    )


def _pass_reject_along(pc: PhaseContext, r: Path, run_id: str, verdict: dict) -> S.ExportResult:
    append_roadbook(pc, r, f"export: not run — signed REJECT ({verdict['signed_at']}) passed along")
    return S.ExportResult(
        summary=f"{run_id} was REJECTED by the eval engineer; nothing exported. Pass the verdict along and wait for instructions — no retraining on your own authority.",
        citations=[pc.skills.cite(SKILL, "verdict-gate")],
        run_id=run_id,
        exported=False,
        verdict="REJECT",
        evidence=verdict.get("evidence"),
        top_remediation=verdict.get("top_remediation"),
    )


def _check_promote(pc: PhaseContext, experiment: str, run_id: str, verdict: dict) -> None:
    if verdict["verdict"] != "PROMOTE":
        raise Refused(f"unknown verdict {verdict['verdict']!r} in a signed report", where=str(pc.ws.verdict_path(experiment, run_id)))
    goldens = verdict.get("goldens") or []
    if not 3 <= len(goldens) <= 5:
        raise Refused(f"the verdict carries {len(goldens)} golden outputs; the smoke test needs 3-5", where=str(pc.ws.verdict_path(experiment, run_id)),
                      fix="ask the eval engineer to add goldens to eval/goldens.jsonl, evaluate and record the verdict again")


def _job_params(pc: PhaseContext, run_id: str, experiment: str, r: Path, brief, verdict: dict, rt, fm) -> dict[str, Any]:
    export_dir = pc.guard.check_write(r / "export")
    merged_dir = pc.guard.check_write(r / "merged")
    converter = str(converter_path(pc)) if fm.container == "gguf" else None
    metrics = verdict.get("metrics") or {}
    return {
        "run_id": run_id,
        "base_model": base_model_of(pc, r, brief),
        "adapter_dir": str(r / "adapter"),
        "format": fm.id,
        "runtime": rt.id,
        "smoke_runtime": rt.smoke_runtime,
        "goldens": verdict.get("goldens") or [],
        "max_new_tokens": metrics.get("max_new_tokens") or 32,
        "export_dir": str(export_dir),
        "merged_dir": str(merged_dir),
        "name": experiment,
        "lossless": fm.lossless,
        "max_tie_margin": fm.max_tie_margin,
        "min_similarity": fm.min_similarity,
        "llama_ftype": _FTYPES.get(fm.id),
        "converter": converter,
        "pre_tokenizer": os.environ.get(PRE_TOKENIZER_ENV) or None,
        "modelfile": rt.modelfile,
    }


def _write_reports(pc: PhaseContext, r: Path, run_id: str, verdict: dict, rt, fm, why: list[str], res: dict, done: bool,
                   converter: str | None) -> Path:
    """One section per format, each replaced by its next export; export-report.md shows them all."""
    export_dir = r / "export"
    report = export_dir / "export-report.md"
    pc.guard.write_text(export_dir / f"export-report.{fm.id}.md", _export_report(run_id, verdict, rt, fm, why, res, done, converter))
    sections = [export_dir / f"export-report.{f.id}.md" for f in pc.skills.table(SKILL, "format-map").formats]
    body = "\n\n".join(p.read_text(encoding="utf-8").split("\n", 1)[1].strip() for p in sections if p.is_file())
    pc.guard.write_text(report, f"# Export report: {run_id}\n\nLatest: {fm.id} for {rt.id}, {'DONE' if done else 'NOT DONE'} ({utc_now()}).\n\n{body}\n")
    return report


def _summary(run_id: str, rt, fm, smoke: dict, done: bool) -> str:
    if done:
        items = smoke["items"]
        summary = f"exported {run_id} as {fm.id} for {rt.id}; smoke test in {smoke['runtime']} passed ({smoke['criterion']}) on {len(items)} goldens"
        if fm.max_tie_margin is not None:
            summary += (f": {sum(i['identical'] for i in items)} identical, the largest logit gap {max(i['max_logit_gap'] for i in items):.4f} nats"
                        f" (limit {fm.max_tie_margin})")
        return summary
    if not smoke.get("ran"):
        return f"{fm.id} for {rt.id} written but NOT done: the smoke test could not run in {smoke['runtime']} ({smoke.get('reason')}); run export again where it can"
    items = smoke["items"]
    why_not = []
    bad = [i for i in items if not i["meets_criterion"]]
    if bad:
        why_not.append(f"{len(bad)} of {len(items)} goldens miss the criterion ({smoke['criterion']})")
    if any(not i["matches_verdict"] for i in items):
        why_not.append(f"base + adapter no longer reproduce {sum(not i['matches_verdict'] for i in items)} of the verdict's golden outputs")
    if any(i.get("tokenizer_match") is False for i in items):
        why_not.append("llama.cpp tokenizes the prompts differently")
    if smoke.get("modelfile_template_match") is False:
        why_not.append("the Modelfile template renders the prompts differently")
    return f"{fm.id} for {rt.id} written but NOT done: the smoke test failed — {'; '.join(why_not) or 'see the report'}"


def _export_report(run_id: str, verdict: dict, rt, fm, why: list[str], res: dict, done: bool, converter: str | None) -> str:
    smoke = res["smoke"]
    out = [f"# Export report: {run_id}, {fm.id}", "", f"## {fm.id} for {rt.id}", "",
           f"**{'DONE' if done else 'NOT DONE'}** — {fm.id} for {rt.id}; smoke test in {smoke['runtime']}: "
           + ("passed" if done else ("did not run: " + str(smoke.get("reason")) if not smoke.get("ran") else "FAILED")),
           "", f"Written {utc_now()} under the eval engineer's signed PROMOTE of {verdict['signed_at']} "
           f"(key `{verdict['key_id']}`, adapter sha256 `{verdict['adapter_sha256']}`).", "",
           "### Choice", "", *[f"- {w}" for w in why], f"- posture: {fm.posture}; container: {fm.container}; {fm.trade_off}", "",
           "### Artifacts", "", "| path | bytes | sha256 |", "|---|---|---|"]
    for a in res["artifacts"]:
        out.append(f"| {a['path']} | {a['bytes']} | {a.get('sha256', '(folder: ' + ', '.join(a.get('files', [])) + ')')} |")
    if res.get("commands"):
        out += ["", "### Commands", "", "```", *res["commands"], "```"]
    out += ["", "### Smoke test", "", f"Runtime: {smoke['runtime']}. Criterion ({fm.id}): {smoke.get('criterion')}. "
            "Pre-export outputs: base + adapter in transformers (float32, greedy), as at evaluation.", ""]
    if smoke.get("items"):
        first = smoke["items"][0]
        gaps = "max_logit_gap" in first
        out += ["| # | prompt | pre-export | post-export | identical | similarity |" + (" first divergence | max logit gap (nats) | off-greedy tokens |" if gaps else "")
                + (" tokenizer match |" if "tokenizer_match" in first else "") + " meets criterion |",
                "|---|---|---|---|---|---|" + ("---|---|---|" if gaps else "") + ("---|" if "tokenizer_match" in first else "") + "---|"]
        for i, it in enumerate(smoke["items"], 1):
            row = f"| {i} | {cell(prompt_text(it['prompt']), 40)} | {cell(repr(it['pre_export']), 40)} | {cell(repr(it['post_export']), 40)} | " \
                  f"{'yes' if it['identical'] else 'NO'} | {it['similarity']:.3f} |"
            if gaps:
                fd = it.get("first_divergence")
                row += f" {'none' if fd is None else f'token {fd}'} | {it['max_logit_gap']:.4f} | {it['off_greedy_tokens']} |"
            if "tokenizer_match" in it:
                row += f" {'yes' if it['tokenizer_match'] else 'NO'} |"
            row += f" {'yes' if it['meets_criterion'] else 'NO'} |"
            out.append(row)
        if gaps:
            out += ["", "Max logit gap: over the tokens the artifact generated, the most the float32 reference ranked one below its own "
                    "greedy choice given the same preceding tokens (0 = the reference's own choice at every step). Rounding to 16 bits "
                    "flips only near-ties; a wrong artifact picks tokens whole nats lower."]
        diffs = [it for it in smoke["items"] if not it["identical"]]
        if diffs:
            import difflib

            out += ["", "#### Differences", ""]
            for it in diffs:
                out += ["```diff", *difflib.unified_diff([it["pre_export"]], [it["post_export"]], "pre-export", "post-export", lineterm=""), "```"]
        if not all(it["matches_verdict"] for it in smoke["items"]):
            out += ["", "Pre-export outputs differ from the golden outputs recorded in the signed verdict on "
                    f"{sum(not it['matches_verdict'] for it in smoke['items'])} prompt(s): what would be exported is not what was judged."]
    else:
        out.append(f"No outputs: {smoke.get('reason')}.")
    if "modelfile_template_match" in smoke:
        out += ["", f"Modelfile TEMPLATE renders the goldens exactly as the chat template: {'yes' if smoke['modelfile_template_match'] else 'NO'}. "
                "Ollama itself was not run here; llama.cpp is the engine it embeds, and the GGUF was smoke-tested there."]
    if res.get("notes"):
        out += ["", "### Notes", "", *[f"- {n}" for n in res["notes"]]]
    out += ["", "### Versions", "", "```json", json.dumps({**res.get("versions", {}), "converter": converter}, indent=2), "```", ""]
    return "\n".join(out)
