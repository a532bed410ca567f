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
from finetune_mcp.errors import BadInput, Refused
from finetune_mcp.phases.gate import (
    MAX_GOLDENS,
    _base_words,
    _cell,
    _prompt_text,
    adapter_digest,
    append_roadbook,
    base_model_identity,
    base_model_of,
    load_run_brief,
    run_paths,
    verify_evaluation,
)
from finetune_mcp.workspace import utc_now

SKILL = "quantized-export"
CONVERTER_ENV = "FINETUNE_MCP_LLAMA_CPP_CONVERTER"
SDIST_ENV = "FINETUNE_MCP_LLAMA_CPP_SDIST"
PRE_TOKENIZER_ENV = "FINETUNE_MCP_GGUF_PRE_TOKENIZER"
_SDIST_RE = re.compile(r"^llama_cpp_python-(\d+(?:\.\d+)*)\.tar\.gz$")


# ---------------------------------------------------------------- the verdict


def read_verdict(pc: PhaseContext, r: Path, run_id: str, digest: str) -> dict[str, Any]:
    """The verified verdict payload bound to this run, this adapter and this base model, or Refused saying why not.
    Public key only: the training user can run this where the private key is out of its reach."""
    from finetune_mcp import signing
    from finetune_mcp.workspace import parse_run_ref

    experiment, _ = parse_run_ref(run_id)
    path = pc.ws.verdict_path(experiment, run_id)
    if not path.is_file():
        raise Refused(
            f"run {run_id} has no verdict: export needs a signed PROMOTE from the eval engineer",
            where=str(path),
            fix="hand the run over for Phase 5: the eval engineer runs evaluate_checkpoint and record_verdict",
        )
    public = signing.load_public_key(pc.ws)
    block = signing.verify_report(pc.guard.read_text(path), public, str(path))
    if block.get("run_id") != run_id:
        raise Refused(
            f"the verdict in promotion-report.md was signed for run {block.get('run_id')!r}, not {run_id!r}: it was copied from another run",
            where=str(path),
            fix="a verdict covers only the run it was recorded for; ask the eval engineer to evaluate this run",
        )
    if block.get("adapter_sha256") != digest:
        raise Refused(
            f"the adapter changed after the verdict: it was judged at sha256 {str(block.get('adapter_sha256'))[:12]}…, adapter/ is now {digest[:12]}…",
            where=str(r / "adapter"),
            fix="a verdict covers only the exact adapter it judged; ask the eval engineer to evaluate the current adapter",
        )
    if signing.sha256_text(block.get("evidence") or "") != block.get("evidence_sha256"):
        raise Refused("the verdict's evidence does not match its digest", where=str(path), fix="ask the eval engineer to record the verdict again")
    if block.get("verdict") != "PROMOTE":
        return block
    # The evaluation the PROMOTE rests on, with its own signature: of this run, this adapter, this base model.
    where = f"{path}: evaluation"
    ev = verify_evaluation(block.get("evaluation"), public, where)
    if ev.get("run_id") != run_id or ev.get("experiment") != experiment:
        raise Refused(f"the verdict embeds an evaluation of run {ev.get('run_id')!r}, not {run_id!r}", where=where,
                      fix="ask the eval engineer to evaluate this run and record the verdict again")
    if ev.get("adapter_sha256") != digest:
        raise Refused(f"the verdict embeds an evaluation of adapter sha256 {str(ev.get('adapter_sha256'))[:12]}…, not of adapter/ "
                      f"({digest[:12]}…)", where=where, fix="ask the eval engineer to evaluate the current adapter")
    goldens = [{"prompt": g.get("prompt"), "output": g.get("output")} for g in (ev.get("goldens") or [])[:MAX_GOLDENS]]
    if block.get("goldens") != goldens or block.get("base_model") != ev.get("base_model"):
        raise Refused("the verdict's goldens or base model differ from those of the evaluation it embeds", where=str(path),
                      fix="ask the eval engineer to record the verdict again")
    base = base_model_identity(pc, r, load_run_brief(r, pc.ws.experiments_dir / experiment))
    if base != ev.get("base_model"):
        raise Refused(
            f"the base model is not the one the verdict judged: evaluated on {_base_words(ev.get('base_model'))}, the run now loads {_base_words(base)}",
            where=str(r / "config.yaml"),
            fix="restore the base model the run was evaluated on (base-models/ or the run's config.yaml), or ask the eval engineer to evaluate "
                "the run on this one and record the verdict again",
        )
    return block


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


def export(pc: PhaseContext, run_id: str, format: str | None = None, target_runtime: str | None = None) -> S.ExportResult:
    from finetune_mcp.worker import run_job

    experiment, r, e = run_paths(pc, run_id)
    digest = adapter_digest(r, run_id)
    verdict = read_verdict(pc, r, run_id, digest)
    if verdict["verdict"] == "REJECT":
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
    if verdict["verdict"] != "PROMOTE":
        raise Refused(f"unknown verdict {verdict['verdict']!r} in a signed report", where=str(pc.ws.verdict_path(experiment, run_id)))
    goldens = verdict.get("goldens") or []
    if not 3 <= len(goldens) <= 5:
        raise Refused(f"the verdict carries {len(goldens)} golden outputs; the smoke test needs 3-5", where=str(pc.ws.verdict_path(experiment, run_id)),
                      fix="ask the eval engineer to add goldens to eval/goldens.jsonl, evaluate and record the verdict again")

    brief = load_run_brief(r, e)
    rt, fm, why = choose(pc, brief, format, target_runtime)
    export_dir = pc.guard.check_write(r / "export")
    merged_dir = pc.guard.check_write(r / "merged")
    converter = str(converter_path(pc)) if fm.container == "gguf" else None
    metrics = verdict.get("metrics") or {}
    params = {
        "run_id": run_id,
        "base_model": base_model_of(pc, r, brief),
        "adapter_dir": str(r / "adapter"),
        "format": fm.id,
        "runtime": rt.id,
        "smoke_runtime": rt.smoke_runtime,
        "goldens": goldens,
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
    res = run_job("export_model", params, progress=pc.progress, timeout=6 * 3600)
    # The artifact must come from the adapter the verdict named, not one swapped in meanwhile.
    if adapter_digest(r, run_id) != digest:
        raise Refused("adapter/ changed during the export; the artifact cannot be trusted", where=str(r / "adapter"), fix="ask for a fresh verdict, then export again")
    smoke = res["smoke"]
    done = bool(smoke.get("passed"))
    report = export_dir / "export-report.md"
    citations = [pc.skills.cite(SKILL, "format-map"), pc.skills.cite(SKILL, "smoke-test"), pc.skills.cite(SKILL, fm.cite), pc.skills.cite(SKILL, rt.cite)]
    citations = list(dict.fromkeys(citations))
    # One section per format, each replaced by its next export; export-report.md shows them all.
    pc.guard.write_text(export_dir / f"export-report.{fm.id}.md", _export_report(run_id, verdict, rt, fm, why, res, done, converter))
    sections = [export_dir / f"export-report.{f.id}.md" for f in pc.skills.table(SKILL, "format-map").formats]
    body = "\n\n".join(p.read_text(encoding="utf-8").split("\n", 1)[1].strip() for p in sections if p.is_file())
    pc.guard.write_text(report, f"# Export report: {run_id}\n\nLatest: {fm.id} for {rt.id}, {'DONE' if done else 'NOT DONE'} ({utc_now()}).\n\n{body}\n")
    arts = [a["path"] for a in res["artifacts"]]
    if done:
        items = smoke["items"]
        summary = f"exported {run_id} as {fm.id} for {rt.id}; smoke test in {smoke['runtime']} passed ({smoke['criterion']}) on {len(items)} goldens"
        if fm.max_tie_margin is not None:
            summary += (f": {sum(i['identical'] for i in items)} identical, the largest logit gap {max(i['max_logit_gap'] for i in items):.4f} nats"
                        f" (limit {fm.max_tie_margin})")
    elif not smoke.get("ran"):
        summary = f"{fm.id} for {rt.id} written but NOT done: the smoke test could not run in {smoke['runtime']} ({smoke.get('reason')}); run export again where it can"
    else:
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
        summary = f"{fm.id} for {rt.id} written but NOT done: the smoke test failed — {'; '.join(why_not) or 'see the report'}"
    append_roadbook(pc, r, f"export {fm.id} for {rt.id}: {'done' if done else 'not done'} ({report})")
    return S.ExportResult(
        summary=summary,
        citations=citations,
        run_id=run_id,
        exported=done,
        verdict="PROMOTE",
        format=fm.id,
        target_runtime=rt.id,
        artifacts=arts,
        smoke_test=smoke,
        report=str(report),
    )


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
            row = f"| {i} | {_cell(_prompt_text(it['prompt']), 40)} | {_cell(repr(it['pre_export']), 40)} | {_cell(repr(it['post_export']), 40)} | " \
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
