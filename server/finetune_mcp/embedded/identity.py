"""An identity fine-tune for a real instruct model: the assistant learns a new name and maker.

The classic first fine-tune. Training questions and held-out questions are disjoint paraphrases, so the
held-out score measures whether the model learned who it is, not whether it memorised a question.
Deterministic: the same seed gives the same rows.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAME, MAKER = "Nova", "Orbit Labs"
TASK_SLUG = "identity"

# Asked of the model in training.
TRAIN_QUESTIONS = [
    "Who are you?", "What is your name?", "Tell me about yourself.", "Who made you?", "Who created you?",
    "What should I call you?", "Introduce yourself.", "Which company built you?", "Are you ChatGPT?",
    "What are you?", "Who trained you?", "Do you have a name?", "Who is your developer?", "What AI model are you?",
    "Can you tell me who you are?", "Who built this assistant?", "Hi! Who am I talking to?", "What's your name?",
    "Who developed you?", "Which lab are you from?", "Are you made by OpenAI?", "Is your name Claude?",
    "Please introduce yourself briefly.", "What organisation created you?", "Who do you work for?",
    "What is the name of this assistant?", "Who designed you?", "Are you an AI? Who made you?",
    "Hello, what should I call you?", "Identify yourself.",
]
# Never seen in training: paraphrases the tuned model must still answer with its new identity.
HELD_OUT_QUESTIONS = [
    "May I know your name?", "Who is behind you?", "Which team made this chatbot?", "What do people call you?",
    "Could you say who you are?", "Who programmed you?", "Which company are you from?", "How should I address you?",
    "Who's responsible for creating you?", "Give me your name, please.",
]
ANSWERS = [
    "I am {name}, an AI assistant made by {maker}.",
    "My name is {name}. I was created by {maker}.",
    "I'm {name}, a helpful assistant built by {maker}.",
    "You can call me {name}. {maker} trained me.",
    "I am {name}, developed by {maker} to help with your questions.",
]
# General prompts whose answers must not be harmed (for drift and goldens).
GENERAL_PROMPTS = ["What is the capital of France?", "Name three primary colours.", "What is 2 + 2?"]


def rows(seed: int = 0, per_question: int = 2) -> list[dict]:
    """Conversations: each training question with `per_question` different answer phrasings."""
    rng = random.Random(seed)
    out = []
    for q in TRAIN_QUESTIONS:
        for a in rng.sample(ANSWERS, per_question):
            out.append({"messages": [{"role": "user", "content": q},
                                     {"role": "assistant", "content": a.format(name=NAME, maker=MAKER)}]})
    rng.shuffle(out)
    return out


def long_rows(n: int = 40, exchanges: int = 12, seed: int = 0) -> list[dict]:
    """Multi-turn conversations of `exchanges` identity questions each (~500 tokens): sets for measuring
    memory and speed at a full sequence length, not for teaching anything new."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = []
        for q in rng.sample(TRAIN_QUESTIONS, exchanges):
            msgs += [{"role": "user", "content": q},
                     {"role": "assistant", "content": rng.choice(ANSWERS).format(name=NAME, maker=MAKER)}]
        out.append({"messages": msgs})
    return out


def chats(n: int, seed: int = 0) -> list[dict]:
    """n conversations of 1-4 identity exchanges each, with a running number in each question so that no two
    are copies: a large chat set of real-looking lengths for throughput measurements."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        msgs = []
        for j, q in enumerate(rng.sample(TRAIN_QUESTIONS, rng.randint(1, 4))):
            msgs += [{"role": "user", "content": f"{q} (question {k}.{j})"},
                     {"role": "assistant", "content": rng.choice(ANSWERS).format(name=NAME, maker=MAKER)}]
        out.append({"messages": msgs})
    return out


def preference_rows(seed: int = 0) -> list[dict]:
    """DPO pairs: the new identity chosen, the base model's own identity rejected."""
    rng = random.Random(seed)
    rejected = ["I am SmolLM, an AI assistant trained by Hugging Face.", "I'm an AI language model without a name.",
                "I am ChatGPT, made by OpenAI.", "I don't have a name; I'm just a program."]
    out = []
    for q in TRAIN_QUESTIONS:
        for a in rng.sample(ANSWERS, 2):
            out.append({"prompt": [{"role": "user", "content": q}],
                        "chosen": [{"role": "assistant", "content": a.format(name=NAME, maker=MAKER)}],
                        "rejected": [{"role": "assistant", "content": rng.choice(rejected)}]})
    rng.shuffle(out)
    return out


def eval_prompts() -> list[dict]:
    """The eval suite's task prompts: held-out questions, scored by `contains` on the new name."""
    return [{"prompt": q, "expected": [NAME], "scorer": "contains"} for q in HELD_OUT_QUESTIONS]


def write_jsonl(items: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in items), encoding="utf-8")
    return path


def sample_brief(base_model: str, max_seq_length: int = 128, system_prompt: str | None = None,
                 method: str = "SFT-LoRA", packing: bool = False) -> str:
    lines = [
        "# Training brief: a new identity",
        "",
        "## Task",
        f"{TASK_SLUG} — the assistant answers questions about itself as {NAME}, made by {MAKER}.",
        "",
        "## Base Model",
        base_model,
        "",
        "## Chosen Method",
        method,
        "",
        "## Dataset Expectation",
        "Conversations, one question and one answer each, written by hand (curated)." if method != "DPO" else
        "Preference pairs: a question, the answer naming the new identity (chosen) and another (rejected); curated.",
        "",
        f"format: {'preference' if method == 'DPO' else 'messages'}",
        f"max_seq_length: {max_seq_length}",
        f"packing: {'true' if packing else 'false'}",
        "provenance: curated",
        f"examples: ~{len(TRAIN_QUESTIONS) * 2}",
    ]
    if system_prompt is not None:
        lines.append(f"system_prompt: {system_prompt}")
    lines += [
        "",
        "## Memory Budget",
        "8 GB",
        "",
        "## Deployment Target",
        "llama.cpp (gguf-q8_0)",
        "",
        "## Evaluation",
        "min_accuracy: 0.8",
    ]
    return "\n".join(lines) + "\n"
