"""The synthetic repeat-words task: rows for every training method, held-out eval items, scoring, sample briefs.

Stdlib only: the light server and the demo import this module.

A prompt is "Repeat:" on one line and three distinct words from a closed 40-word list on the next;
the answer is the same three words in order. Every word is one token of the embedded tokenizer
(with and without a leading space), so the tiny model only has to learn to copy tokens.

The space of ordered triples (40*39*38 = 59,280) is split once, by a hash of the triple, into a
training pool and a held-out pool. Training generators draw only from the first and eval_suite only
from the second, whatever the seeds, so no eval prompt is ever seen in training.

Training rows use TRL's conversational shapes (lists of {"role", "content"} messages) so that the
trainer applies the model's chat template exactly as evaluation does.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from functools import lru_cache
from itertools import permutations
from pathlib import Path
from typing import Iterable

TASK_SLUG = "repeat-words"
PROMPT_HEAD = "Repeat:"
N_WORDS = 3
HELDOUT_PERCENT = 10

WORDS: tuple[str, ...] = (
    "apple", "river", "stone", "cloud", "tiger", "piano", "candle", "forest",
    "silver", "garden", "rocket", "winter", "honey", "marble", "lemon", "castle",
    "violet", "pepper", "anchor", "falcon", "meadow", "copper", "ribbon", "cactus",
    "harbor", "pencil", "walnut", "island", "saddle", "thunder", "velvet", "orbit",
    "lantern", "bamboo", "crystal", "feather", "glacier", "nectar", "puzzle", "tundra",
)
_WORD_SET = frozenset(WORDS)

# Markers that end an answer when a decoder keeps special tokens.
_END_MARKERS = ("<|im_end|>", "<|endoftext|>")

Row = dict
Messages = list


def make_prompt(words: Iterable[str]) -> str:
    """The user text for a list of task words."""
    words = list(words)
    unknown = [w for w in words if w not in _WORD_SET]
    if not words or unknown:
        raise ValueError(f"task prompts take one or more words from WORDS; not task words: {unknown or words!r}")
    return PROMPT_HEAD + "\n" + " ".join(words)


def user_messages(prompt_text: str) -> Messages:
    """The conversational form of a prompt: one user turn."""
    return [{"role": "user", "content": prompt_text}]


def _user_text(prompt: str | Messages) -> str:
    if isinstance(prompt, str):
        return prompt
    for message in reversed(prompt):
        if message.get("role") == "user":
            return message.get("content", "")
    raise ValueError("conversational prompt has no user turn")


def reference_answer(prompt: str | Messages) -> str:
    """The expected answer for a prompt (user text, or a conversational prompt)."""
    text = _user_text(prompt)
    head, _, rest = text.partition("\n")
    words = rest.split()
    if head.strip() != PROMPT_HEAD or not words:
        raise ValueError(f"not a repeat-words prompt (expected 'Repeat:' then a line of words): {text!r}")
    return " ".join(words)


def _output_text(output: str | Messages) -> str:
    if isinstance(output, str):
        return output
    # Conversational completions (GRPO reward functions get these): the assistant turns' text.
    return "".join(m.get("content", "") for m in output if m.get("role", "assistant") == "assistant")


def first_answer_line(output: str | Messages) -> str:
    """The first non-blank line of a model output, cut at an end-of-turn marker, whitespace-normalised."""
    text = _output_text(output)
    for marker in _END_MARKERS:
        text = text.split(marker, 1)[0]
    lines = text.strip().splitlines()
    return " ".join(lines[0].split()) if lines else ""


def score(prompt: str | Messages, output: str | Messages) -> bool:
    """True when the output's first line is exactly the expected words (whitespace-normalised)."""
    return first_answer_line(output) == reference_answer(prompt)


def well_formed(output: str | Messages) -> bool:
    """True when the first line is N_WORDS task words: the shape of an answer, right or wrong."""
    words = first_answer_line(output).split()
    return len(words) == N_WORDS and all(w in _WORD_SET for w in words)


def _triple_is_heldout(triple: tuple[str, ...]) -> bool:
    digest = hashlib.sha256(("repeat-words-split:" + " ".join(triple)).encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT


@lru_cache(maxsize=1)
def _pools() -> tuple[tuple[tuple[str, ...], ...], tuple[tuple[str, ...], ...]]:
    train, heldout = [], []
    for triple in permutations(WORDS, N_WORDS):
        (heldout if _triple_is_heldout(triple) else train).append(triple)
    return tuple(train), tuple(heldout)


def _draw(pool: tuple[tuple[str, ...], ...], n: int, stream: str, seed: int) -> list[tuple[str, ...]]:
    if n < 0 or n > len(pool):
        raise ValueError(f"n must be between 0 and {len(pool)} for {stream!r}; got {n}")
    # A string seed keeps each generator's stream independent and stable across processes.
    return random.Random(f"{stream}:{seed}").sample(pool, n)


def train_triples(n: int, seed: int = 0, stream: str = "train") -> list[tuple[str, ...]]:
    """n distinct word triples from the training pool."""
    return _draw(_pools()[0], n, stream, seed)


def heldout_triples(n: int, seed: int = 0) -> list[tuple[str, ...]]:
    """n distinct word triples from the held-out pool."""
    return _draw(_pools()[1], n, "eval", seed)


def _wrong_answer(words: tuple[str, ...], rng: random.Random, shuffle: bool) -> str:
    """A plausible wrong answer: the right words out of order, or one word swapped for another."""
    wrong = list(words)
    if shuffle:
        while wrong == list(words):
            rng.shuffle(wrong)
    else:
        position = rng.randrange(len(wrong))
        wrong[position] = rng.choice([w for w in WORDS if w not in words])
    return " ".join(wrong)


def sft_conversations(n: int, seed: int = 0) -> list[Row]:
    """SFT rows in the messages format: {"messages": [user, assistant]}."""
    rows = []
    for words in train_triples(n, seed, "sft-messages"):
        prompt = make_prompt(words)
        rows.append({"messages": [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": " ".join(words)},
        ]})
    return rows


def sft_dialogues(n: int, seed: int = 0, max_exchanges: int = 4, words: tuple[int, int] = (2, 5)) -> list[Row]:
    """Multi-turn SFT rows: 1..max_exchanges repeat exchanges of words[0]..words[1] distinct words each.

    The same skill as the single-turn task (copy the words in order), at lengths that spread the way a
    real chat set's do, which is what packing efficiency should be judged on: every sft_conversations
    row is the same length, and whole conversations of them would all be multiples of it. No held-out
    triple occurs in them, not even inside a longer run of words, so eval_suite stays unseen.
    """
    lo, hi = words
    if max_exchanges < 1 or not 1 <= lo <= hi <= len(WORDS):
        raise ValueError(f"need max_exchanges >= 1 and 1 <= words[0] <= words[1] <= {len(WORDS)}; got {max_exchanges}, {words}")
    rng = random.Random(f"sft-dialogues:{seed}")
    rows: list[Row] = []
    seen: set[tuple[tuple[str, ...], ...]] = set()
    while len(rows) < n:
        exchanges: list[tuple[str, ...]] = []
        target = rng.randint(1, max_exchanges)
        while len(exchanges) < target:
            run = tuple(rng.sample(WORDS, rng.randint(lo, hi)))
            if not any(_triple_is_heldout(run[k:k + N_WORDS]) for k in range(len(run) - N_WORDS + 1)):
                exchanges.append(run)
        key = tuple(exchanges)
        if key in seen:
            continue
        seen.add(key)
        messages = []
        for run in exchanges:
            messages += [{"role": "user", "content": make_prompt(run)}, {"role": "assistant", "content": " ".join(run)}]
        rows.append({"messages": messages})
    return rows


def sft_prompt_completion(n: int, seed: int = 0) -> list[Row]:
    """SFT rows in the conversational prompt-completion format."""
    return [
        {"prompt": user_messages(make_prompt(words)),
         "completion": [{"role": "assistant", "content": " ".join(words)}]}
        for words in train_triples(n, seed, "sft-prompt-completion")
    ]


def preference_pairs(n: int, seed: int = 0) -> list[Row]:
    """Preference rows (DPO, ORPO, SimPO): chosen is the right answer, rejected a near miss."""
    rng = random.Random(f"preference-rejected:{seed}")
    rows = []
    for i, words in enumerate(train_triples(n, seed, "preference")):
        rows.append({
            "prompt": user_messages(make_prompt(words)),
            "chosen": [{"role": "assistant", "content": " ".join(words)}],
            "rejected": [{"role": "assistant", "content": _wrong_answer(words, rng, shuffle=i % 2 == 0)}],
        })
    return rows


def kto_rows(n: int, seed: int = 0) -> list[Row]:
    """Unpaired KTO rows, alternately desirable (label True) and undesirable (label False)."""
    rng = random.Random(f"kto-undesirable:{seed}")
    rows = []
    for i, words in enumerate(train_triples(n, seed, "kto")):
        desirable = i % 2 == 0
        answer = " ".join(words) if desirable else _wrong_answer(words, rng, shuffle=i % 4 == 1)
        rows.append({
            "prompt": user_messages(make_prompt(words)),
            "completion": [{"role": "assistant", "content": answer}],
            "label": desirable,
        })
    return rows


def grpo_prompts(n: int, seed: int = 0) -> list[Row]:
    """GRPO rows: a conversational prompt and the answer a verifiable reward compares against."""
    return [
        {"prompt": user_messages(make_prompt(words)), "answer": " ".join(words)}
        for words in train_triples(n, seed, "grpo")
    ]


def eval_suite(n: int = 50, seed: int = 0) -> list[Row]:
    """Held-out items {"prompt": user text, "expected": answer}; never drawn by a training generator."""
    return [{"prompt": make_prompt(words), "expected": " ".join(words)} for words in heldout_triples(n, seed)]


def drift_prompts() -> list[str]:
    """Prompts unrelated to the task, to watch how much training moves the model elsewhere."""
    return [
        "Write one sentence about the sea.",
        "What is two plus two?",
        "Name three colours.",
        "Describe a quiet morning in a small town.",
        "List the days of the week.",
    ]


def write_jsonl(rows: Iterable[Row], path: str | os.PathLike) -> Path:
    """Write rows as JSON lines, atomically (temp file in the same folder, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# Per canonical method: the name the brief shows, the dataset format, examples, packing.
_BRIEF_METHODS = {
    "sft-lora": ("SFT-LoRA", "messages", 2000, True),
    "sft-qlora": ("SFT-QLoRA", "messages", 2000, True),
    "dpo": ("DPO", "preference", 1000, False),
    "orpo": ("ORPO", "preference", 1000, False),
    "kto": ("KTO", "kto", 1000, False),
    "simpo": ("SimPO", "preference", 1000, False),
    "grpo": ("GRPO", "grpo", 256, False),
    "vlm-sft": ("VLM-SFT", "vision", 1000, False),
}

_FORMAT_PROSE = {
    "messages": "Synthetic conversations: the user turn is `Repeat:` and three task words on the next "
                "line; the assistant turn repeats the three words in order. Loss on assistant tokens only.",
    "preference": "Synthetic preference pairs: the chosen answer repeats the three words in order; the "
                  "rejected answer is a near miss (the same words shuffled, or one word swapped).",
    "kto": "Synthetic unpaired rows, half desirable (the right answer) and half undesirable (a near miss).",
    "grpo": "Synthetic prompts with their expected answer; rewards are computed from completions.",
    "vision": "Image-text conversations. The embedded tiny model has no vision tower, so this brief "
              "needs a vision-language base model from the local HF cache instead.",
}


def sample_brief(method: str) -> str:
    """A training brief (markdown) for the repeat-words task on the embedded model, for one method."""
    key = method.strip().lower()
    if key not in _BRIEF_METHODS:
        raise ValueError(f"unknown method {method!r}; one of: {', '.join(_BRIEF_METHODS)}")
    shown, fmt, examples, packing = _BRIEF_METHODS[key]
    lines = [
        "# Training brief: repeat three words back",
        "",
        "## Task",
        f"{TASK_SLUG} — given `Repeat:` and three words from a closed list of {len(WORDS)}, "
        "answer with the same three words in the same order.",
        "",
        "## Base Model",
        "finetune-mcp-tiny",
        "",
        "## Chosen Method",
        shown,
        "",
        "## Dataset Expectation",
        _FORMAT_PROSE[fmt],
        "",
        f"format: {fmt}",
        "max_seq_length: 64",
        f"packing: {'true' if packing else 'false'}",
        f"examples: ~{examples}",
        "",
        "## Memory Budget",
        "4 GB",
        "",
        "## Deployment Target",
        "transformers (merged-16bit)",
        "",
        "## Evaluation",
        "min_accuracy: 0.8",
    ]
    if key == "grpo":
        lines += ["", "## Reward", "exact_match, format"]
    return "\n".join(lines) + "\n"
