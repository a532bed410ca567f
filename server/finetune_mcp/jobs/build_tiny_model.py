"""Builds the embedded base model finetune-mcp-tiny (a tiny Llama and its BPE tokenizer), deterministically.

Run as a worker job (`python -m finetune_mcp.jobs.build_tiny_model`, params {"target_dir", "seed"}) or
call build() directly. The same seed and library versions give byte-identical files.

Tokenizer, for whoever converts this model to GGUF later: a byte-level BPE trained here with the
`tokenizers` library; normalizer none; pre-tokenizer ByteLevel(add_prefix_space=False, use_regex=True),
which is the GPT-2 split regex; ByteLevel decoder; no BOS is added. llama.cpp's convert_hf_to_gguf.py
recognises pre-tokenizers by a hash of the ids it gets for a fixed text, and this vocabulary is new,
so its hash is unknown there: map it to the "gpt-2" pre-tokenizer.

The model is a standard LlamaForCausalLM (untied embeddings). Its weights are random: the synthetic
task in finetune_mcp.common.task is what it learns, fast enough on a CPU for tests and demos.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from finetune_mcp.common import task
from finetune_mcp.common.files import process_umask
from finetune_mcp.common.proto import JobError, emit_progress, run_main
from finetune_mcp.common.shapes import TINY_MODEL_SHAPE, TINY_VOCAB_SIZE

MODEL_NAME = "finetune-mcp-tiny"
# Bump when anything below changes what gets written: an older build is then replaced.
BUILDER_VERSION = 1
STAMP_NAME = "finetune-mcp-build.json"
# Not __name__: that is "__main__" when the module runs as a job.
BUILDER = "finetune_mcp.jobs.build_tiny_model"

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
# ChatML. The generation markers let transformers (return_assistant_tokens_mask) and TRL
# (assistant_only_loss) find the assistant tokens; <|im_end|> sits inside them so the model
# learns to stop.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}"
    "{{- message['content'] + '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# Plain prose so that everyday words get merges too, not only the task's.
_GENERAL_TEXT = """\
The quick brown fox jumps over the lazy dog. A small model can still learn a narrow task well.
On a quiet morning the town was still, and the sea was calm under a grey sky. People walked to
work, children went to school, and the shops opened one by one. What is two plus two? It is four.
Name three colours: red, green and blue. The days of the week are Monday, Tuesday, Wednesday,
Thursday, Friday, Saturday and Sunday. Numbers such as 0 1 2 3 4 5 6 7 8 9 10 42 100 and 2026
appear in text, and so do symbols like ( ) [ ] { } < > = + - * / % # @ & ! ? ; : , . ' " _ |.
You are a helpful assistant. Answer the question in one sentence. Please write a short summary
of the text above. The system, the user and the assistant take turns in a conversation.
Training a language model means showing it examples and adjusting its weights so that the next
token becomes more likely. Evaluation measures how often the answers are right on new prompts.
"""


def default_target() -> Path:
    """$DGX_SPARK_ROOT/base-models/finetune-mcp-tiny (DGX_SPARK_ROOT defaults to ~/dgx-spark)."""
    root = os.environ.get("DGX_SPARK_ROOT") or str(Path.home() / "dgx-spark")
    return Path(root).expanduser() / "base-models" / MODEL_NAME


def _tokenizer_corpus() -> list[str]:
    """Task text in the chat layout (every word at a line start and after a space) plus prose."""
    words = task.WORDS
    n = len(words)
    corpus = []
    for i in range(10 * n):
        # Strides coprime to n walk every word through every position.
        triple = (words[i % n], words[(7 * i + 3) % n], words[(13 * i + 11) % n])
        prompt = task.make_prompt(triple)
        corpus.append(f"user\n{prompt}\nassistant\n{' '.join(triple)}\n")
    corpus += [_GENERAL_TEXT] * 3
    corpus += task.drift_prompts()
    return corpus


def build_tokenizer():
    """Train the byte-level BPE and wrap it as a transformers fast tokenizer with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps each token's offsets on its own characters, which the assistant
    # mask (char_to_token) relies on.
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_tokenizer_corpus(), trainer)

    split = [w for w in task.WORDS for v in (w, " " + w) if len(backend.encode(v).ids) != 1]
    if split:
        raise JobError(
            f"tokenizer build: task words not merged into one token: {split}",
            kind="JobFailed",
            fix="raise TINY_VOCAB_SIZE in finetune_mcp/common/shapes.py",
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=TINY_MODEL_SHAPE["max_position_embeddings"],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def build_model(tokenizer, seed: int = 0):
    """A randomly initialised LlamaForCausalLM sized to the tokenizer; same seed, same weights."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **TINY_MODEL_SHAPE,
    )
    # Fork the RNG so an in-process build neither depends on nor disturbs the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False)
    return model.eval()


def _digests(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != STAMP_NAME
    }


def _stamp_for(seed: int) -> dict[str, Any]:
    return {"builder": BUILDER, "model": MODEL_NAME, "builder_version": BUILDER_VERSION, "seed": seed}


def read_stamp(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


def is_current(folder: Path, seed: int) -> bool:
    """True when folder holds this builder's output for this seed, with files unchanged since."""
    stamp = read_stamp(folder)
    if not stamp or any(stamp.get(k) != v for k, v in _stamp_for(seed).items()):
        return False
    return stamp.get("files") == _digests(folder)


def _result(target: Path, built: bool) -> dict[str, Any]:
    stamp = read_stamp(target) or {}
    config = json.loads((target / "config.json").read_text())
    return {
        "path": str(target),
        "built": built,
        "model": MODEL_NAME,
        "seed": stamp.get("seed"),
        "builder_version": stamp.get("builder_version"),
        "files": stamp.get("files", {}),
        "vocab_size": config.get("vocab_size"),
        "architecture": (config.get("architectures") or [None])[0],
    }


def build(target_dir: str | os.PathLike | None = None, seed: int = 0, progress: Callable | None = None) -> dict[str, Any]:
    """Build the model and tokenizer into target_dir (default: default_target()); return what is there.

    Idempotent: a folder already holding this build (same builder version and seed, files intact) is
    left alone. The files are written to a temporary sibling folder and renamed into place, so the
    target never holds half a model. An existing folder this builder did not write is refused.
    """
    progress = progress or (lambda *a: None)
    target = Path(target_dir).expanduser() if target_dir else default_target()
    target = target.absolute()
    if target.exists():
        if is_current(target, seed):
            return _result(target, built=False)
        stamp = read_stamp(target)
        if not stamp or stamp.get("builder") != BUILDER:
            raise JobError(
                f"{target} exists and was not written by the finetune-mcp-tiny builder",
                kind="Refused",
                where=str(target),
                fix="move that folder away, or pass another target_dir",
            )
    target.parent.mkdir(parents=True, exist_ok=True)

    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
    try:
        progress(0, 3, "training the BPE tokenizer")
        tokenizer = build_tokenizer()
        progress(1, 3, "initialising the model")
        model = build_model(tokenizer, seed)
        progress(2, 3, "saving")
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        stamp = {**_stamp_for(seed), "files": _digests(tmp)}
        (tmp / STAMP_NAME).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
        _usual_modes(tmp)
        _swap_into_place(tmp, target, seed)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    progress(3, 3, f"built {target}")
    return _result(target, built=True)


def _usual_modes(folder: Path) -> None:
    """mkdtemp makes a 0700 folder and safetensors writes 0600: give the model the umask's usual modes, so that an
    eval role running as another OS user (finetune-mcp setup-roles) can load it."""
    mask = process_umask()
    for p in [folder, *folder.rglob("*")]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def _swap_into_place(tmp: Path, target: Path, seed: int) -> None:
    if not target.exists():
        try:
            os.rename(tmp, target)
            return
        except OSError:
            # A concurrent build got there first; its output is as good as ours if it is current.
            if is_current(target, seed):
                return
    # An older build (other seed or builder version, or damaged): replace it, keeping the
    # window without a target as short as two renames.
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rename(target, old / target.name)
    os.rename(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def _job(params: dict[str, Any]) -> dict[str, Any]:
    seed = params.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise JobError(f"seed must be an integer, got {seed!r}", kind="BadInput", where="params.seed")
    return build(params.get("target_dir"), seed=seed, progress=emit_progress)


def main() -> None:
    run_main(_job)


if __name__ == "__main__":
    main()
