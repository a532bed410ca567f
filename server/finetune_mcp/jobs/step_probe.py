"""A few real training steps of the brief's model at the expected batch shape: seconds per micro-step, peak memory.

Run by preflight as a worker job, so its expected wall time rests on a measurement, not on a guess. The
model is loaded as training will load it (fp32 on a CPU, bf16 on a GPU), wrapped with LoRA of the
recipe's rank on the recipe's targets, and trained with AdamW on random token ids of the batch shape
(micro batch x sequences per example x tokens per sequence) with an explicit attention mask, as the
trainer's collator passes one. The first step pays one-time costs (weights paged in, kernels chosen)
and is reported apart; the rest give the steady time per micro-step.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

from finetune_mcp.common.proto import JobError, emit_progress, run_main


def _rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def _rss_peak() -> tuple[list[float], threading.Event]:
    """Samples this process's resident memory every 50 ms into [peak] until the event is set."""
    peak = [_rss_gb()]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.05):
            peak[0] = max(peak[0], _rss_gb())

    threading.Thread(target=sample, daemon=True).start()
    return peak, stop


@dataclass
class Trainee:
    """The base model with LoRA and its AdamW, as training holds them, fed seeded random token ids."""

    model: Any
    opt: Any
    cuda: bool
    reference_forward: bool
    gen: Any

    def timed(self, n: int, rows: int, length: int, tag: str) -> list[float]:
        import torch

        model, vocab = self.model, self.model.config.vocab_size
        times = []
        for i in range(n):
            x = torch.randint(0, vocab, (rows, length), generator=self.gen)
            mask = torch.ones_like(x)
            mask[0, -1] = 0  # a padded position, so attention takes the same kernel as a padded batch does
            if self.cuda:
                x, mask = x.cuda(), mask.cuda()
            t0 = time.perf_counter()
            if self.reference_forward:
                with torch.no_grad(), model.disable_adapter():
                    model(input_ids=x, attention_mask=mask)
            out = model(input_ids=x, attention_mask=mask, labels=x)
            out.loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if self.cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            del out
            emit_progress(len(times), n, f"{tag} step {i + 1}/{n}: {times[-1]:.2f} s")
        return times


def load_trainee(P: dict[str, Any], dtype, cuda: bool) -> Trainee:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(P["model_path"], dtype=dtype)
    except Exception as e:
        raise JobError(f"cannot load the base model for the step probe: {type(e).__name__}: {str(e)[:200]}",
                       kind="JobFailed", where=P["model_path"]) from None
    if cuda:
        model = model.cuda()
    if P.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    targets = [t if t.endswith("_proj") else f"{t}_proj" for t in P.get("lora_targets") or ["q", "k", "v", "o", "gate", "up", "down"]]
    present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    targets = [t for t in targets if t in present] or "all-linear"
    model = get_peft_model(model, LoraConfig(r=int(P.get("lora_r", 16)), lora_alpha=int(P.get("lora_r", 16)),
                                             target_modules=targets, task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    return Trainee(model, opt, cuda, bool(P.get("reference_forward")), torch.Generator().manual_seed(0))


def probe(P: dict[str, Any]) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32
    steps = max(2, int(P.get("steps", 3)))
    b = int(P["micro_batch"]) * int(P.get("sequences_per_example", 1))
    s = int(P["tokens_per_sequence"])
    emit_progress(0, steps + 1, f"loading {P['model_path']}")
    trainee = load_trainee(P, dtype, cuda)
    peak, stop = _rss_peak()
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    times = trainee.timed(steps, b, s, f"{b} x {s} tokens:")
    # The longest shape gives the peak; an average step pads only to the longest of its own rows. Where that is
    # clearly shorter, time it too: seconds per micro-step are not proportional to tokens (the optimizer step and
    # per-layer overheads do not shrink), so the run's time is read at a measured shape, not scaled.
    t_len = int(P.get("time_tokens_per_sequence") or 0)
    expected = None
    if 0 < t_len < 0.9 * s:
        short = trainee.timed(max(2, steps - 1), b, t_len, f"{b} x {t_len} tokens:")
        expected = {"batch_shape": [b, t_len], "s_per_micro_step": round(statistics.median(short), 4)}
    stop.set()
    steady = times[1:]
    return {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "batch_shape": [b, s],
        "steps": steps,
        "first_step_s": round(times[0], 4),
        "s_per_micro_step": round(statistics.median(steady), 4),
        "expected": expected,
        "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3) if cuda else round(peak[0], 3),
        "peak_source": "torch.cuda.max_memory_allocated" if cuda else "process resident memory",
        "params": {k: P.get(k) for k in ("micro_batch", "sequences_per_example", "tokens_per_sequence", "time_tokens_per_sequence", "lora_r",
                                         "gradient_checkpointing", "reference_forward")},
    }


if __name__ == "__main__":
    run_main(probe)
