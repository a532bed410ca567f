"""Measures that the embedded tiny model learns the repeat-words task: held-out accuracy before and after SFT.

    /work/main/.venv/bin/python bench/learn_task.py                    # LoRA + trainable embeddings, seed 0
    /work/main/.venv/bin/python bench/learn_task.py --variants lora-only --seeds 0 1
    /work/main/.venv/bin/python bench/learn_task.py --data dialogues --max-length 128   # the multi-turn chat set

Builds the model into a temporary root, trains with plain TRL SFTTrainer + PEFT LoRA on the CPU,
scores greedy answers on held-out prompts with finetune_mcp.common.task.score, and prints a table.
Variants: "lora+embed" (LoRA r=8 on every linear layer, embed_tokens and lm_head fully trained via
modules_to_save) and "lora-only" (the same LoRA, embeddings frozen).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A model this small gains nothing from intra-op threads, and on a busy machine OpenMP threads
# spinning against other processes made a step ~25x slower (measured: 48 s vs 2 s for 50 steps).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from finetune_mcp.common import task  # noqa: E402
from finetune_mcp.jobs.build_tiny_model import build  # noqa: E402

VARIANTS = {
    "lora+embed": ["embed_tokens", "lm_head"],
    "lora-only": None,
}


def accuracy(model, tokenizer, items, batch_size: int = 64) -> float:
    import torch

    model.eval()
    right = 0
    for start in range(0, len(items), batch_size):
        batch = items[start:start + batch_size]
        texts = [tokenizer.apply_chat_template(task.user_messages(it["prompt"]), add_generation_prompt=True, tokenize=False)
                 for it in batch]
        enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=8, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        for it, row in zip(batch, out[:, enc["input_ids"].shape[1]:]):
            right += task.score(it["prompt"], tokenizer.decode(row, skip_special_tokens=True))
    return right / len(items)


def run_one(model_dir: Path, variant: str, seed: int, args, out_dir: Path) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    heldout = task.eval_suite(args.eval_n, seed=0)
    before = accuracy(model, tokenizer, heldout)

    generate = task.sft_dialogues if args.data == "dialogues" else task.sft_conversations
    train = Dataset.from_list(generate(args.examples or args.steps * args.batch_size, seed=seed))
    config = SFTConfig(
        output_dir=str(out_dir),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="linear",
        warmup_steps=0.05,
        max_length=args.max_length,
        packing=args.packing,
        assistant_only_loss=True,
        logging_steps=max(args.steps // 10, 1),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=seed,
        dataloader_num_workers=0,
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    peft_config = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
        modules_to_save=VARIANTS[variant], task_type="CAUSAL_LM",
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer, peft_config=peft_config)
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    after = accuracy(trainer.model, tokenizer, heldout)
    return {"variant": variant, "seed": seed, "before": before, "after": after, "train_s": seconds,
            "loss_first": losses[0] if losses else float("nan"), "loss_last": losses[-1] if losses else float("nan")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=["lora+embed"], choices=sorted(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--packing", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--examples", type=int, default=0, help="training conversations; 0: steps x batch size (one pass unpacked)")
    p.add_argument("--eval-n", type=int, default=200)
    p.add_argument("--data", choices=["single", "dialogues"], default="single",
                   help="single: task.sft_conversations (one exchange of three words); dialogues: task.sft_dialogues (1-4 exchanges of 2-5 words)")
    p.add_argument("--max-length", type=int, default=64)
    args = p.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)

    rows = []
    with tempfile.TemporaryDirectory(prefix="learn-task-") as tmp:
        t0 = time.perf_counter()
        model_dir = Path(build(Path(tmp) / "base-models" / "finetune-mcp-tiny", seed=0)["path"])
        build_s = time.perf_counter() - t0
        for variant in args.variants:
            for seed in args.seeds:
                rows.append(run_one(model_dir, variant, seed, args, Path(tmp) / f"run-{variant}-{seed}"))
                r = rows[-1]
                print(f"# {variant} seed {seed}: {r['before']:.0%} -> {r['after']:.0%} in {r['train_s']:.1f}s", flush=True)

    print()
    print(f"model build: {build_s:.1f}s; steps {args.steps}, batch {args.batch_size}, lr {args.lr:g}, "
          f"packing {args.packing}, data {args.data}, max_length {args.max_length}, examples {args.examples or args.steps * args.batch_size}, held-out items {args.eval_n}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    print(f"| {'variant':<10} | seed | acc before | acc after | loss first | loss last | train s |")
    print(f"|{'-' * 12}|------|------------|-----------|------------|-----------|---------|")
    for r in rows:
        print(f"| {r['variant']:<10} | {r['seed']:>4} | {r['before']:>10.1%} | {r['after']:>9.1%} | "
              f"{r['loss_first']:>10.3f} | {r['loss_last']:>9.3f} | {r['train_s']:>7.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
