"""Worker job: builds one export artifact from base + adapter and smoke-tests it in its target runtime.

Params (JSON on stdin):
  base_model, adapter_dir   what was promoted
  format                    lora | merged-16bit | gguf-f16 | gguf-q8_0 | gguf-q4_k_m
  runtime                   transformers | vllm | llama.cpp | ollama
  smoke_runtime             transformers | vllm | llama.cpp (from the format map)
  goldens                   [{"prompt", "output"}] from the signed verdict (3-5)
  max_new_tokens            as used at evaluation
  export_dir, merged_dir    the run's export/ and merged/
  name                      file name stem for GGUF artifacts
  lossless, max_tie_margin, min_similarity
                            the smoke criterion (format map): identical outputs; every token the artifact chose
                            within max_tie_margin nats of the float32 reference's greedy choice; similarity floor
  llama_ftype               e.g. LLAMA_FTYPE_MOSTLY_Q8_0 for quantized GGUF
  converter                 path of llama.cpp's convert_hf_to_gguf.py (GGUF only)
  pre_tokenizer             llama.cpp pre-tokenizer name to use when the converter does not know the
                            tokenizer's hash (null: derived from tokenizer.json when it is plain GPT-2 byte-level)
  modelfile                 write an Ollama Modelfile beside the GGUF

Pre-export outputs come from base + adapter in transformers (float32), generated exactly as
evaluate_checkpoint generates them; the artifact's outputs are diffed against them. For a 16-bit
downcast the same reference also scores the artifact's own answers token by token (`logit_gaps`).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune_mcp.common.proto import JobError, emit_progress, run_main
from finetune_mcp.jobs.evaluate import generate_ids, load_adapted, load_model, load_tokenizer, prompt_ids, prompt_text, resolve_model, stop_ids

CONVERTER_TIMEOUT_S = 4 * 3600.0

# Runs llama.cpp's converter unchanged, from where it lies, with two run-time adjustments made in
# memory (the user's files are never edited):
# - a BPE tokenizer whose pre-tokenizer hash the converter's table lacks is mapped to the name in
#   $FINETUNE_MCP_GGUF_PRE (the converter otherwise stops with "BPE pre-tokenizer was not recognized");
# - without a tokenizer.model file the SentencePiece path is skipped as if the file were missing,
#   which is what the converter does when sentencepiece is installed.
CONVERTER_SHIM = r'''
import importlib.util, os, sys
from pathlib import Path
conv = os.path.abspath(sys.argv[1])
here = os.path.dirname(conv)
sys.path.insert(0, here)
if "NO_LOCAL_GGUF" not in os.environ:
    sys.path.insert(1, os.path.join(here, "gguf-py"))
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", conv)
mod = importlib.util.module_from_spec(spec)
sys.modules["convert_hf_to_gguf"] = mod
spec.loader.exec_module(mod)
pre = os.environ.get("FINETUNE_MCP_GGUF_PRE") or None
classes = {c for c in (getattr(mod, "TextModel", None), getattr(sys.modules.get("conversion.base"), "TextModel", None),
                        getattr(mod, "Model", None)) if c is not None}
for cls in classes:
    if hasattr(cls, "get_vocab_base_pre"):
        def get_pre(self, tokenizer, _orig=cls.get_vocab_base_pre):
            try:
                return _orig(self, tokenizer)
            except NotImplementedError:
                if pre:
                    print(f"finetune-mcp: pre-tokenizer hash not in the converter's table; using {pre!r}", file=sys.stderr)
                    return pre
                raise
        cls.get_vocab_base_pre = get_pre
    if hasattr(cls, "_set_vocab_sentencepiece"):
        def sp(self, *a, _orig=cls._set_vocab_sentencepiece, **k):
            if not (Path(self.dir_model) / "tokenizer.model").is_file():
                raise FileNotFoundError("no tokenizer.model")
            return _orig(self, *a, **k)
        cls._set_vocab_sentencepiece = sp
sys.argv = [conv] + sys.argv[2:]
mod.main()
'''

CHATML_MODELFILE_TEMPLATE = (
    '{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n'
)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _artifact(path: Path) -> dict[str, Any]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        return {"path": str(path), "bytes": sum(p.stat().st_size for p in files), "files": [p.name for p in files]}
    return {"path": str(path), "bytes": path.stat().st_size, "sha256": _sha256(path)}


def _replace_dir(src: Path, dst: Path) -> None:
    """Put a finished folder in place; a previous export of the same format is replaced whole."""
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.rename(dst, old / dst.name)
        os.rename(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(src, dst)


def gpt2_byte_level(model_dir: Path) -> bool:
    """True when tokenizer.json pre-tokenizes exactly like GPT-2: ByteLevel with its regex, no prefix space, nothing else."""
    try:
        tj = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    pre, model = tj.get("pre_tokenizer") or {}, tj.get("model") or {}
    return (
        pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space", False)
        and model.get("type") == "BPE" and not tj.get("normalizer")
    )


def chat_family(tokenizer) -> str | None:
    t = getattr(tokenizer, "chat_template", None) or ""
    if "<|im_start|>" in t and "<|im_end|>" in t:
        return "chatml"
    return None


def render_chatml(messages: list[dict[str, str]]) -> str:
    """What CHATML_MODELFILE_TEMPLATE renders in Ollama for these messages (with the generation prompt)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def similarity(a: str, b: str) -> float:
    if a == b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first generated token where two answers part, None when they are the same tokens."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def logit_gaps(model, tok, prompt: Any, tokens: list[int], end_ids: list[int]) -> list[float]:
    """Per token an artifact generated (its stop included): how far the reference ranks it below the reference's own
    greedy choice, in nats (its top logit minus this token's), given the same preceding tokens; 0 where they agree.

    Rounding weights to 16 bits moves logits by a few hundredths: it can flip a greedy near-tie, after which the
    answers part for good while every token stays one the reference itself nearly chose. A wrong artifact (lost
    adapter, corrupt weights, wrong tokenizer) picks tokens the reference ranks whole nats lower. `end_ids`: the stop
    the artifact ended on (any of them, when the runtime reports only that it stopped), empty when cut by length.
    """
    import torch

    q = prompt_ids(tok, prompt)
    seq = q + list(tokens) + end_ids[:1]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([seq], device=model.device)).logits[0, len(q) - 1:len(seq) - 1].float()
    top = logits.max(-1).values
    gaps = [float(top[i] - logits[i, t]) for i, t in enumerate(tokens)]
    if end_ids:
        gaps.append(min(float(top[-1] - logits[-1, e]) for e in end_ids))
    return gaps


# ---------------------------------------------------------------- runtimes


def _smoke_transformers(model, tok, goldens, mnt) -> list[dict[str, Any]]:
    """The goldens as one batch, as evaluation records them (see evaluate.generate_golden_batch)."""
    ids = [prompt_ids(tok, g["prompt"]) for g in goldens]
    return [{"output": text, "tokens": toks, "end_ids": [end] if end is not None else []}
            for text, toks, end in generate_ids(model, tok, ids, mnt, max(1, len(ids)))]


def _smoke_llama_cpp(gguf: Path, tok, goldens, mnt, threads: int, stops: list[int]) -> list[dict[str, Any]]:
    from llama_cpp import Llama

    lens = [len(prompt_ids(tok, g["prompt"])) for g in goldens]
    llm = Llama(model_path=str(gguf), n_ctx=max(256, max(lens) + mnt + 16), n_threads=threads, verbose=False, seed=0)
    out = []
    try:
        for g in goldens:
            text = prompt_text(tok, g["prompt"])
            # The runtime's own tokenizer reads the rendered prompt, as a server given this text would.
            ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
            r = llm.create_completion(prompt=ids, max_tokens=mnt, temperature=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                      repeat_penalty=1.0, seed=0)
            text_out, finish = r["choices"][0]["text"], r["choices"][0].get("finish_reason")
            # The answer's ids as the HF tokenizer reads its text (llama.cpp reports text): a tokenization other than
            # the generated one can only score worse, never hide a wrong token.
            out.append({"output": text_out, "finish_reason": finish, "tokens": tok(text_out, add_special_tokens=False)["input_ids"],
                        "end_ids": stops if finish == "stop" else [],
                        "tokenizer_match": ids == prompt_ids(tok, g["prompt"])})
    finally:
        llm.close() if hasattr(llm, "close") else None
    return out


def _vllm_unavailable() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "vLLM needs an NVIDIA GPU and this machine has none (torch.cuda.is_available() is False)"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vllm is not installed in the training environment"
    return None


def _smoke_vllm(model_dir: str, adapter: str | None, tok, goldens, mnt, stops: list[int]) -> list[dict[str, Any]]:
    from vllm import LLM, SamplingParams

    kwargs = {"enable_lora": True} if adapter else {}
    llm = LLM(model=model_dir, dtype="auto", enforce_eager=True, **kwargs)
    sp = SamplingParams(temperature=0.0, max_tokens=mnt)
    lora = None
    if adapter:
        from vllm.lora.request import LoRARequest

        lora = LoRARequest("promoted", 1, adapter)
    out = []
    for g in goldens:
        res = llm.generate({"prompt_token_ids": prompt_ids(tok, g["prompt"])}, sp, lora_request=lora, use_tqdm=False)
        o = res[0].outputs[0]
        toks = list(o.token_ids)
        end = [toks.pop()] if toks and toks[-1] in stops else (stops if o.finish_reason == "stop" else [])
        out.append({"output": o.text, "tokens": toks, "end_ids": end})
    return out


# ---------------------------------------------------------------- the job


@dataclass
class _Built:
    """An artifact built in the work folder, where it goes, and the model its transformers smoke test loads."""

    art: Path
    final: Path
    model_for_smoke: Any = None


class _Export:
    """One export's settings and its running record (commands to reproduce it, notes for the report)."""

    def __init__(self, params: dict[str, Any]):
        self.params = params
        self.fmt, self.smoke_rt = params["format"], params["smoke_runtime"]
        self.base_model, self.adapter_dir = params["base_model"], params["adapter_dir"]
        self.goldens, self.mnt = params["goldens"], int(params.get("max_new_tokens") or 32)
        self.export_dir, self.merged_dir = Path(params["export_dir"]), Path(params["merged_dir"])
        self.threads = int(params.get("threads") or max(1, min(8, os.cpu_count() or 1)))
        self.commands: list[str] = []
        self.notes: list[str] = []


def export(params: dict[str, Any]) -> dict[str, Any]:
    """check -> reference outputs (base + adapter) -> build -> smoke test -> judge -> place."""
    import torch

    torch.manual_seed(0)
    x = _Export(params)
    x.export_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    _check_can_export(x)
    tok = load_tokenizer(x.base_model)
    if params.get("modelfile") and chat_family(tok) != "chatml":
        raise JobError("the Ollama Modelfile is written for ChatML chat templates, and this model's template is not ChatML",
                       kind="Refused", fix="export for llama.cpp instead (the GGUF carries the model's own chat template), or write the Modelfile TEMPLATE by hand")

    emit_progress(0, 4, "pre-export outputs: base + adapter in transformers")
    ref = load_adapted(x.base_model, x.adapter_dir)
    pre = _smoke_transformers(ref, tok, x.goldens, x.mnt)
    stops = stop_ids(tok, ref)

    work = Path(tempfile.mkdtemp(prefix=f".export-{x.fmt}-", dir=x.export_dir))
    try:
        emit_progress(1, 4, f"building {x.fmt}")
        built = (_build_lora(x, tok, work) if x.fmt == "lora" else
                 _build_merged(x, tok, work, ref) if x.fmt == "merged-16bit" else _build_gguf(x, tok, work, ref))
        del ref
        emit_progress(3, 4, f"smoke test in {x.smoke_rt}")
        smoke, post = _run_smoke(x, tok, built, stops)
        if params.get("modelfile"):
            _write_modelfile(x, tok, work, built, smoke)
        items = _compare(x, tok, pre, post, built) if post is not None else []
        if post is not None:
            smoke["ran"] = True
        smoke["passed"] = _judge(x, smoke, items)
        emit_progress(4, 4, "placing artifacts")
        artifacts = _place(x, work, built)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"artifacts": artifacts, "smoke": smoke, "commands": x.commands, "notes": x.notes, "versions": _versions(x.fmt),
            "seconds": round(time.time() - t0, 1)}


def _check_can_export(x: _Export) -> None:
    if x.fmt.startswith("gguf-"):
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise JobError("llama-cpp-python is not installed in the training environment, so GGUF cannot be quantized or smoke-tested",
                           kind="Refused", fix="pip install 'finetune-mcp[export]' (or llama-cpp-python) into the training Python") from None
        if not x.params.get("converter"):
            raise JobError("no llama.cpp converter was given", kind="Refused")


def _build_lora(x: _Export, tok, work: Path) -> _Built:
    art = work / "lora"
    shutil.copytree(x.adapter_dir, art)
    tok.save_pretrained(art)
    model = None
    if x.smoke_rt == "transformers":
        from peft import PeftModel

        model = PeftModel.from_pretrained(load_model(x.base_model), str(art)).eval()
    return _Built(art, x.export_dir / "lora", model)


def _build_merged(x: _Export, tok, work: Path, ref) -> _Built:
    import torch

    cfg = json.loads((Path(resolve_model(x.base_model)) / "config.json").read_text()) if Path(resolve_model(x.base_model)).is_dir() else {}
    dtype = torch.float16 if str(cfg.get("dtype") or cfg.get("torch_dtype")) == "float16" else torch.bfloat16
    merged = ref.merge_and_unload().to(dtype)
    art = work / "merged"
    merged.save_pretrained(art, safe_serialization=True)
    tok.save_pretrained(art)
    del merged
    x.notes.append(f"merged in float32, saved as {str(dtype).replace('torch.', '')}")
    model = load_model(str(art), str(dtype).replace("torch.", "")) if x.smoke_rt == "transformers" else None
    return _Built(art, x.merged_dir, model)


def _build_gguf(x: _Export, tok, work: Path, ref) -> _Built:
    """Merge, convert with llama.cpp's converter (through the in-memory shim), then quantize if the format asks."""
    params, fmt = x.params, x.fmt
    hf = work / "hf"
    merged = ref.merge_and_unload()
    merged.save_pretrained(hf, safe_serialization=True)
    tok.save_pretrained(hf)
    n_params = sum(p.numel() for p in merged.parameters())
    del merged
    quant = fmt != "gguf-f16"
    outtype = "f16" if not quant else ("f32" if n_params * 4 < 8e9 else "auto")
    stem = params.get("name") or "model"
    converted = work / (f"{stem}-{outtype}.gguf" if quant else f"{stem}-f16.gguf")
    _convert(x, hf, converted, outtype)
    shutil.rmtree(hf, ignore_errors=True)
    if not quant:
        return _Built(converted, x.export_dir / converted.name)
    art = work / f"{stem}-{fmt.removeprefix('gguf-')}.gguf"
    _quantize(x, converted, art)
    converted.unlink()
    return _Built(art, x.export_dir / art.name)


def _convert(x: _Export, hf: Path, converted: Path, outtype: str) -> None:
    params = x.params
    pre_tok = params.get("pre_tokenizer") or ("gpt-2" if gpt2_byte_level(hf) else "")
    cmd = [sys.executable, "-c", CONVERTER_SHIM, params["converter"], str(hf), "--outfile", str(converted), "--outtype", outtype]
    x.commands.append(f"FINETUNE_MCP_GGUF_PRE={pre_tok or '(unset)'} python convert_hf_to_gguf.py {hf.name}/ --outfile {converted.name} --outtype {outtype}"
                      f"   # converter: {params['converter']}, run through finetune-mcp's in-memory shim")
    env = {**os.environ, "FINETUNE_MCP_GGUF_PRE": pre_tok}
    try:
        # The converter reads the whole model once; hours means it is stuck, not slow.
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=CONVERTER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise JobError(f"llama.cpp's converter did not finish within {CONVERTER_TIMEOUT_S:.0f}s", kind="JobFailed",
                       where=" ".join(cmd[:1] + cmd[3:]), fix="run the command by hand to see where it stops") from None
    if p.returncode != 0 or not converted.is_file():
        tail = (p.stderr or p.stdout)[-3000:]
        hint = "the converter does not know this tokenizer's pre-tokenizer; set FINETUNE_MCP_GGUF_PRE_TOKENIZER to the llama.cpp name it matches (e.g. gpt-2, llama-bpe, qwen2)" \
            if "pre-tokenizer was not recognized" in tail else "its output ends with the lines shown"
        raise JobError(f"llama.cpp's converter failed (exit {p.returncode}):\n{tail}", kind="JobFailed", where=" ".join(cmd[:1] + cmd[3:]), fix=hint)
    if pre_tok and "pre-tokenizer hash not in the converter's table" in p.stderr:
        x.notes.append(f"the converter did not know this tokenizer's hash; mapped to llama.cpp pre-tokenizer {pre_tok!r}")


def _quantize(x: _Export, converted: Path, art: Path) -> None:
    import ctypes

    import llama_cpp

    qparams = llama_cpp.llama_model_quantize_default_params()
    qparams.ftype = getattr(llama_cpp, x.params["llama_ftype"])
    qparams.nthread = x.threads
    emit_progress(2, 4, f"quantizing to {x.fmt}")
    rc = llama_cpp.llama_model_quantize(str(converted).encode(), str(art).encode(), ctypes.byref(qparams))
    x.commands.append(f"llama_cpp.llama_model_quantize({converted.name}, {art.name}, ftype={x.params['llama_ftype']})"
                      f"   # = llama-quantize {converted.name} {art.name} {x.fmt.removeprefix('gguf-').upper()}")
    if rc != 0 or not art.is_file():
        raise JobError(f"llama_model_quantize returned {rc}", kind="JobFailed", where=str(converted))


def _run_smoke(x: _Export, tok, built: _Built, stops: list[int]) -> tuple[dict[str, Any], list | None]:
    """The artifact's answers to the goldens in the target runtime (None where that runtime is unavailable, with why)."""
    smoke: dict[str, Any] = {"runtime": x.smoke_rt, "ran": False, "reason": None}
    post = None
    if x.smoke_rt == "transformers":
        post = _smoke_transformers(built.model_for_smoke, tok, x.goldens, x.mnt)
    elif x.smoke_rt == "llama.cpp":
        post = _smoke_llama_cpp(built.art, tok, x.goldens, x.mnt, x.threads, stops)
    elif x.smoke_rt == "vllm":
        why = _vllm_unavailable()
        if why:
            smoke["reason"] = why
        else:
            lora = x.fmt == "lora"
            post = _smoke_vllm(resolve_model(x.base_model) if lora else str(built.art), str(built.art) if lora else None, tok, x.goldens, x.mnt, stops)
    return smoke, post


def _write_modelfile(x: _Export, tok, work: Path, built: _Built, smoke: dict) -> None:
    (work / "Modelfile").write_text(
        f"# Ollama Modelfile written by finetune-mcp export for {x.params.get('run_id', '')}\n"
        f"FROM ./{built.final.name}\n"
        f'TEMPLATE """{CHATML_MODELFILE_TEMPLATE}"""\n'
        'PARAMETER stop "<|im_end|>"\n'
        'PARAMETER stop "<|im_start|>"\n',
        encoding="utf-8",
    )
    smoke["modelfile_template_match"] = all(
        render_chatml(g["prompt"] if isinstance(g["prompt"], list) else [{"role": "user", "content": g["prompt"]}]) == prompt_text(tok, g["prompt"])
        for g in x.goldens
    )


def _compare(x: _Export, tok, pre: list, post: list, built: _Built) -> list[dict[str, Any]]:
    """Each golden's answer before and after export; with a tie margin, each generated token's gap to the float32
    reference's greedy choice."""
    margin = x.params.get("max_tie_margin")
    gaps: list[list[float] | None] = [None] * len(post)
    if margin is not None:
        emit_progress(3, 4, "scoring the artifact's answers with the float32 reference")
        built.model_for_smoke = None
        reference = load_adapted(x.base_model, x.adapter_dir)
        gaps = [logit_gaps(reference, tok, g["prompt"], b["tokens"], b["end_ids"]) for g, b in zip(x.goldens, post)]
        del reference
    items = []
    for g, a, b, gp in zip(x.goldens, pre, post, gaps):
        items.append({
            "prompt": g["prompt"],
            "pre_export": a["output"],
            "post_export": b["output"],
            "identical": a["output"] == b["output"],
            "similarity": round(similarity(a["output"], b["output"]), 4),
            "matches_verdict": a["output"] == g.get("output"),
            **({"first_divergence": first_divergence(a["tokens"] + a["end_ids"][:1], b["tokens"] + b["end_ids"][:1])}
               if b.get("tokens") is not None else {}),
            **({"max_logit_gap": round(max(gp, default=0.0), 4), "off_greedy_tokens": sum(v > 0 for v in gp)} if gp is not None else {}),
            **({"tokenizer_match": b["tokenizer_match"]} if "tokenizer_match" in b else {}),
        })
    return items


def _judge(x: _Export, smoke: dict, items: list[dict]) -> bool:
    """Whether the smoke test passed, by the criterion the format is held to (stated in smoke["criterion"])."""
    params = x.params
    margin = params.get("max_tie_margin")
    if params.get("lossless"):
        smoke["criterion"] = "identical greedy outputs (lossless format: the runtime computes what evaluation computed)"
        for i in items:
            i["meets_criterion"] = i["identical"]
    elif margin is not None:
        smoke["criterion"] = (f"every token the artifact generated is the float32 reference's greedy choice or within {margin} nats "
                              "of it, given the same preceding tokens (16-bit rounding may flip a near-tie, nothing more)")
        for i in items:
            i["meets_criterion"] = i["max_logit_gap"] <= float(margin)
    else:
        smoke["criterion"] = f"similarity >= {params['min_similarity']} for every golden (quantized format)"
        for i in items:
            i["meets_criterion"] = i["similarity"] >= float(params["min_similarity"])
    smoke["items"] = items
    ok = bool(items) and all(i["meets_criterion"] for i in items)
    if any(g.get("output") is not None and not i["matches_verdict"] for g, i in zip(x.goldens, items)):
        # What would be exported is not what was judged: the base model or the stack moved since.
        ok = False
        x.notes.append("base + adapter no longer reproduce the golden outputs recorded in the signed verdict: the base model, "
                       "the libraries or the hardware changed since evaluation; ask for a fresh evaluation before exporting")
    if any(i.get("tokenizer_match") is False for i in items):
        ok = False
        x.notes.append("llama.cpp tokenizes the golden prompts differently from the HF tokenizer: the pre-tokenizer mapping is wrong")
    if params.get("modelfile") and not smoke.get("modelfile_template_match"):
        ok = False
        x.notes.append("the Modelfile TEMPLATE renders the golden prompts differently from the model's chat template")
    return bool(smoke["ran"] and ok)


def _place(x: _Export, work: Path, built: _Built) -> list[dict[str, Any]]:
    if built.art.is_dir():
        _replace_dir(built.art, built.final)
    else:
        os.replace(built.art, built.final)
    artifacts = [_artifact(built.final)]
    if x.params.get("modelfile"):
        os.replace(work / "Modelfile", x.export_dir / "Modelfile")
        artifacts.append(_artifact(x.export_dir / "Modelfile"))
    return artifacts


def _versions(fmt: str) -> dict[str, str]:
    import peft
    import torch
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
    if fmt.startswith("gguf-"):
        import llama_cpp

        versions["llama_cpp_python"] = llama_cpp.__version__
    return versions


if __name__ == "__main__":
    run_main(export)
