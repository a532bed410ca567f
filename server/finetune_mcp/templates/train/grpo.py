

# --- GRPO with verifiable rewards -----------------------------------------------------------------------

from trl import GRPOConfig, GRPOTrainer

# The reward functions the brief may name (grpo-rlvr-training, table rewards). Each gets the batch's
# completions (conversational: a list of messages each) and the dataset's extra columns by name; the
# reference answer is the column config.yaml names in data.reference_field.
REFERENCE_FIELD = "answer"
STOP_IDS: set[int] = set()  # the tokenizer's end-of-turn and padding ids, set in build_trainer
_END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "</s>")


def _text(completion):
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion if m.get("role", "assistant") == "assistant")


def _first_line(completion):
    text = _text(completion)
    for marker in _END_MARKERS:
        text = text.split(marker, 1)[0]
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return " ".join(lines[0].split()) if lines else ""


def exact_match(completions, **kwargs):
    """1 when the first line equals the reference answer (whitespace-normalised), else 0."""
    answers = kwargs[REFERENCE_FIELD]
    return [1.0 if _first_line(c) == " ".join(str(a).split()) else 0.0 for c, a in zip(completions, answers)]


def format_reward(completions, completion_ids=None, **kwargs):
    """1 when the completion stopped by itself (an end-of-turn token within max_completion_length)
    and is one non-empty line; else 0."""
    out = []
    for i, c in enumerate(completions):
        text = _text(c)
        for marker in _END_MARKERS:
            text = text.split(marker, 1)[0]
        text = text.strip()
        stopped = completion_ids is None or (len(completion_ids[i]) > 0 and completion_ids[i][-1] in STOP_IDS)
        out.append(1.0 if stopped and text and "\n" not in text else 0.0)
    return out


def partial_match(completions, **kwargs):
    """The share of the reference's words that the first line reproduces in the same positions."""
    scores = []
    for c, a in zip(completions, kwargs[REFERENCE_FIELD]):
        want, got = str(a).split(), _first_line(c).split()
        scores.append(sum(1 for i, w in enumerate(want) if i < len(got) and got[i] == w) / len(want) if want else 0.0)
    return scores


format_reward.__name__ = "format"  # TRL logs rewards/<__name__>/mean: keep the brief's name
REWARDS = {"exact_match": exact_match, "format": format_reward, "partial_match": partial_match}


def load_datasets(cfg, tokenizer):
    """Prompt rows with the reference the rewards check (`answer`); GRPO evaluates by generating, so no eval set."""
    train_path, _ = data_files(cfg)
    return Dataset.from_list(read_jsonl(train_path)), None


def build_trainer(cfg, run_dir, model, tokenizer, peft_config, train_ds, eval_ds, callbacks):
    global REFERENCE_FIELD
    REFERENCE_FIELD = cfg["data"].get("reference_field") or "answer"
    eos = getattr(model, "generation_config", None) and model.generation_config.eos_token_id
    STOP_IDS.update(i for i in ([eos] if isinstance(eos, int) else list(eos or [])) + [tokenizer.eos_token_id, tokenizer.pad_token_id]
                    if isinstance(i, int))
    names = cfg["calls"]["script"]["rewards"]
    unknown = [n for n in names if n not in REWARDS]
    if unknown:
        raise SystemExit(f"unknown reward function(s) {unknown}; this script has {sorted(REWARDS)}")
    args = GRPOConfig(**trainer_args(cfg, run_dir))
    return GRPOTrainer(
        model=model,
        reward_funcs=[REWARDS[n] for n in names],
        args=args,
        train_dataset=train_ds,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
    )
