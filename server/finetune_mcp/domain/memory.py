"""Training-memory estimate: parameter counts from a model's config.json, then weights, adapter state, activations.

Pure arithmetic over a config dict and the spark-preflight memory table; the formula and its
sources are in skills/spark-preflight/SKILL.md (#memory-estimate). Nothing here imports torch:
configs are JSON and safetensors headers are read as JSON. Sizes are decimal GB.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune_mcp.common.errors import BadInput, NotFound
from finetune_mcp.common.shapes import TINY_MODEL_SHAPE, TINY_VOCAB_SIZE, safetensors_param_count
from finetune_mcp.models import resolve_base_model

GB = 1e9
CITE = "spark-preflight#memory-estimate"

# Families whose MLP is fc1 -> activation -> fc2 rather than gate/up -> down.
_UNGATED = {"gpt2", "gpt_neox", "gptj", "gpt_bigcode", "opt", "bloom", "falcon", "phi", "starcoder2", "mpt", "codegen"}
# Families with biases on the q/k/v projections even without an attention_bias key.
_QKV_BIAS = {"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl"}


def _first(cfg: dict, *keys, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def model_shape(config: dict[str, Any]) -> dict[str, Any]:
    """The numbers the estimate needs, from a transformers config.json (a VLM's text_config is used)."""
    cfg = dict(config)
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(cfg, "num_attention_heads", "n_head")
    vocab = _first(cfg, "vocab_size")
    missing = [n for n, v in (("hidden_size", hidden), ("num_hidden_layers", layers), ("num_attention_heads", heads), ("vocab_size", vocab)) if not v]
    if missing:
        raise BadInput(f"config.json lacks {', '.join(missing)}, so the memory estimate cannot count parameters",
                       where="config.json", fix="use a transformers causal-LM checkpoint whose config.json names these fields")
    head_dim = _first(cfg, "head_dim") or hidden // heads
    model_type = str(cfg.get("model_type") or "")
    experts = int(_first(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)
    inter = _first(cfg, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    return {
        "model_type": model_type,
        "hidden_size": int(hidden),
        "num_hidden_layers": int(layers),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(_first(cfg, "num_key_value_heads", "num_kv_heads", default=heads)),
        "head_dim": int(head_dim),
        "intermediate_size": int(inter),
        "vocab_size": int(vocab),
        # transformers' Llama-family configs default to untied; an absent key counts the lm_head (the larger estimate).
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "gated_mlp": model_type not in _UNGATED,
        "qkv_bias": bool(cfg.get("attention_bias", False)) or model_type in _QKV_BIAS,
        "num_experts": experts,
        "moe_intermediate_size": int(_first(cfg, "moe_intermediate_size", default=inter) or inter),
        "shared_expert_intermediate_size": int(_first(cfg, "shared_expert_intermediate_size", default=0) or 0),
        "num_experts_per_tok": int(_first(cfg, "num_experts_per_tok", "moe_topk", default=1) or 1),
        # The dtype the weights are stored in (transformers writes `dtype`, older configs `torch_dtype`).
        "checkpoint_dtype": str(_first(cfg, "dtype", "torch_dtype", default="bfloat16") or "bfloat16"),
    }


def _linears(s: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
    """Projection -> (in, out, copies per layer) of one decoder layer."""
    h, q, kv = s["hidden_size"], s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    out = {"q": (h, q, 1), "k": (h, kv, 1), "v": (h, kv, 1), "o": (q, h, 1)}
    if s["num_experts"]:
        i, n = s["moe_intermediate_size"], s["num_experts"]
        out.update(gate=(h, i, n), up=(h, i, n), down=(i, h, n))
        if s["shared_expert_intermediate_size"]:
            si = s["shared_expert_intermediate_size"]
            out.update(shared_gate=(h, si, 1), shared_up=(h, si, 1), shared_down=(si, h, 1))
    elif s["gated_mlp"]:
        i = s["intermediate_size"]
        out.update(gate=(h, i, 1), up=(h, i, 1), down=(i, h, 1))
    else:
        i = s["intermediate_size"]
        out.update(up=(h, i, 1), down=(i, h, 1))
    return out


def param_counts(s: dict[str, Any]) -> dict[str, int]:
    """Parameters by part. `linear` is what QLoRA quantises: the projections inside the decoder layers."""
    h, L = s["hidden_size"], s["num_hidden_layers"]
    linear_per_layer = sum(i * o * n for i, o, n in _linears(s).values())
    if s["num_experts"]:
        linear_per_layer += h * s["num_experts"]  # the router
    bias = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * s["head_dim"] if s["qkv_bias"] else 0
    norms = 2 * h * L + h
    embed = s["vocab_size"] * h
    lm_head = 0 if s["tie_word_embeddings"] else s["vocab_size"] * h
    linear = linear_per_layer * L
    return {
        "total": embed + lm_head + linear + bias * L + norms,
        "linear": linear,
        "embeddings": embed,
        "lm_head": lm_head,
        "other": bias * L + norms,
    }


def lora_params(s: dict[str, Any], r: int, targets: list[str]) -> int:
    """r * (in + out) for every adapted projection; MoE experts are adapted one by one, as PEFT does by name."""
    lin = _linears(s)
    total = 0
    for t in targets:
        for name in (t, f"shared_{t}"):
            if name in lin:
                i, o, n = lin[name]
                total += r * (i + o) * n
    return total * s["num_hidden_layers"]


def activation_values_per_token_layer(s: dict[str, Any], lora_targets: list[str] | None = None) -> int:
    """Values one decoder layer keeps for backward, per token, with SDPA/flash attention (no s x s scores).

    Two norm inputs and the two projection inputs (4h), q/k/v (q + 2kv), the attention output (q), and
    for a gated MLP gate, up, act(gate) and their product (4i); an fc1/fc2 MLP keeps 2i. RMSNorm keeps
    its fp32 input and normalised output besides (2h per norm, 4h a layer). Each LoRA-adapted projection
    materialises its output a second time (base output + scaled B(A(x)) is a new tensor): the sum of the
    adapted projections' output widths.
    """
    h, q, kv = s["hidden_size"], s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    # A routed token passes through num_experts_per_tok experts, each keeping its own intermediates.
    i = s["moe_intermediate_size"] * s["num_experts_per_tok"] if s["num_experts"] else s["intermediate_size"]
    base = 4 * h + 2 * q + 2 * kv + (4 * i if s["gated_mlp"] or s["num_experts"] else 2 * i)
    norms = 4 * h
    lin = _linears(s)
    per_tok = s["num_experts_per_tok"] if s["num_experts"] else 1
    lora_out = sum(lin[t][1] * (per_tok if lin[t][2] > 1 else 1) for t in (lora_targets or []) if t in lin)
    return base + norms + lora_out


def load_model_info(base_models_dir: Path, base_model: str, hf_home: Path | None = None, data_dirs: list[Path] | None = None) -> dict[str, Any]:
    """Resolve the brief's base model locally and read its config. Raises NotFound/BadInput like models.resolve_base_model."""
    ref = resolve_base_model(base_model, base_models_dir, hf_home, data_dirs)
    info: dict[str, Any] = {"name": ref.name, "source": None, "config": None}
    cfg_path = ref.path / "config.json" if ref.path is not None else None
    if cfg_path is not None and cfg_path.is_file():
        try:
            raw = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise BadInput(f"{cfg_path} is not readable JSON: {e}", where=str(cfg_path)) from None
        info["source"] = str(cfg_path)
        info["config"] = model_shape(raw)
        info["safetensors_params"] = safetensors_param_count(ref.path)
    elif ref.embedded:
        # Not built yet (prepare_dataset builds it): its shape is fixed by the builder.
        info["source"] = "builder shape (finetune_mcp.jobs.build_tiny_model); not built yet"
        info["config"] = model_shape({**TINY_MODEL_SHAPE, "vocab_size": TINY_VOCAB_SIZE, "model_type": "llama"})
    else:
        raise NotFound(f"base model {base_model!r} has no config.json at {ref.load_path}", where=str(ref.load_path))
    info["embedded"] = ref.embedded
    return info


def estimate(
    model: dict[str, Any],
    method: str,
    max_seq_length: int,
    platform: str,
    table,
    *,
    micro_batch_size: int | None = None,
    lora_r: int | None = None,
    lora_targets: list[str] | None = None,
    gradient_checkpointing: bool | None = None,
    tokens_per_sequence: int | None = None,
    backend: str | None = None,
) -> dict[str, Any]:
    """Peak training memory for one process (one GPU, or the CPU) in GB, itemised, with its assumptions.

    total = weights + adapter state + max(training activations + logits, generation KV cache) + overhead.
    tokens_per_sequence: what the largest batch holds per sequence (packed: max_seq_length; else the
    dataset's longest templated sequence, capped at max_seq_length); default max_seq_length.
    backend: "unsloth" or "trl" (None: trl); on a CPU it picks the process overhead of that stack.
    """
    s = model["config"]
    d = table.defaults
    m = table.methods[method]
    cpu = platform == "cpu"
    r = lora_r or d.lora_r
    targets = list(lora_targets or d.lora_targets)
    b = micro_batch_size or d.micro_batch_size
    gc = (d.gradient_checkpointing_cpu if cpu else d.gradient_checkpointing_gpu) if gradient_checkpointing is None else gradient_checkpointing
    counts = param_counts(s)
    weights, precision = _weights(s, counts, m, table, cpu)
    lora = lora_params(s, r, targets)
    seqs = b * m.sequences_per_example
    seq_tokens = int(tokens_per_sequence or max_seq_length)
    act = _activations(s, targets, table, cpu, gc, seqs, seq_tokens, max_seq_length, m.kv_cache_sequences)
    parts = {
        "weights": weights,
        "adapter_state": lora * table.trainable_bytes_per_param,
        "activations": act["activations"],
        "attention_scores": act["attention_kept"],
        "logits": act["logits"],
        "kv_cache": act["kv_cache"],
        "overhead": table.overhead_gb["cpu_unsloth" if cpu and backend == "unsloth" else "cpu" if cpu else "cuda"] * GB,
    }
    total = parts["weights"] + parts["adapter_state"] + max(act["activations"] + act["logits"], act["kv_cache"]) + parts["overhead"]
    k = round(act["per_layer"] * act["bpv"] / s["hidden_size"], 2)
    g = _gb
    return {
        "model": model.get("name"),
        "method": method,
        "platform": platform,
        "precision": precision,
        "params": counts["total"],
        "params_quantized": counts["linear"] if m.weights == "nf4" else 0,
        "lora_r": r,
        "lora_targets": targets,
        "lora_params": lora,
        "max_seq_length": max_seq_length,
        "tokens_per_sequence": seq_tokens,
        "micro_batch_size": b,
        "sequences_per_step": seqs,
        "gradient_checkpointing": gc,
        "k_bytes_per_token_hidden_layer": k,
        "gb": {**{name: g(v) for name, v in parts.items()}, "total": g(total)},
        "per_sequence_gb": {
            "activations_no_checkpointing": g(act["full"] / seqs),
            "activations_checkpointing": g(act["ckpt"] / seqs),
            "logits": g(act["logits"] / seqs),
        },
        "checkpoint_gb": g(lora * 12),  # adapter (fp32) + AdamW moments, per saved checkpoint
        "merged_16bit_gb": g(counts["total"] * 2),
        "formula": (
            "total = weights + adapter_state + max(activations + logits, kv_cache) + overhead; "
            f"activations = sequences x seq x layers x hidden x k (k = {k} bytes, "
            + ("checkpointed: layer inputs + one layer" if gc else "no checkpointing") + ")"
        ),
        "assumptions": _assumptions(s, m, r, targets, b, seq_tokens, max_seq_length, cpu, backend),
        "cite": CITE,
    }


def _gb(x: float) -> float:
    return round(x / GB, 3)


def _weights(s: dict, counts: dict, m, table, cpu: bool) -> tuple[float, str]:
    """Bytes the model's weights hold during training, and the precision they are held in."""
    P = counts["total"]
    if m.weights != "nf4":
        precision = "fp32" if cpu else "16bit"
        return P * table.bytes_per_param[precision], precision
    q_bytes = table.bytes_per_param["nf4"] + table.nf4_constant_bits_per_param / 8
    rest = P - counts["linear"]
    weights = counts["linear"] * q_bytes + rest * table.bytes_per_param["fp32" if cpu else "16bit"]
    precision = "nf4 + " + ("fp32" if cpu else "16bit")
    if cpu:
        # Quantizing on a CPU reads each stored projection weight through the checkpoint's memory map,
        # and those pages stay in the process's resident memory beside the 4-bit copy (the other weights
        # are used from the same mapping, counted above). Measured: SmolLM2-135M, float32 checkpoint,
        # +0.63 GB resident after a 4-bit load against +0.08 GB after a (lazy) float32 load.
        stored = 4 if s.get("checkpoint_dtype") in ("float32", "fp32") else 2
        weights += counts["linear"] * stored
        precision += " + its stored projections, mapped while quantizing"
    return weights, precision


def _activations(s: dict, targets: list[str], table, cpu: bool, gc: bool, seqs: int, seq_tokens: int,
                 max_seq_length: int, kv_sequences: int) -> dict[str, float]:
    """Bytes of the training activations (with or without checkpointing), kept attention scores, logits and KV cache."""
    bpv = table.activation_bytes_per_value["fp32" if cpu else "16bit"]
    tokens = seqs * seq_tokens
    L, h, V = s["num_hidden_layers"], s["hidden_size"], s["vocab_size"]
    per_layer = activation_values_per_token_layer(s, targets)
    full = tokens * L * per_layer * bpv
    # Checkpointing keeps each layer's input and recomputes one layer at a time in backward.
    ckpt = tokens * (L * h + per_layer) * bpv
    # Attention matrices kept for backward (CPU math kernel): per layer, per sequence, per head, s x s.
    attention = (L * seqs * s["num_attention_heads"] * seq_tokens ** 2 * bpv
                 * table.attention_score_copies["cpu" if cpu else "cuda"])
    attention_kept = attention / L if gc else attention
    return {
        "bpv": bpv, "per_layer": per_layer, "full": full, "ckpt": ckpt, "attention_kept": attention_kept,
        "activations": (ckpt if gc else full) + attention_kept,
        "logits": tokens * V * table.logits_bytes_per_token_vocab["fp32" if cpu else "16bit"],
        "kv_cache": 2 * L * s["num_key_value_heads"] * s["head_dim"] * max_seq_length * kv_sequences * bpv,
    }


def _assumptions(s: dict, m, r: int, targets: list[str], b: int, seq_tokens: int, max_seq_length: int, cpu: bool,
                 backend: str | None) -> list[str]:
    return [
        f"LoRA r={r} on {', '.join(targets)} (before generate_config chooses)",
        f"micro batch {b} x {m.sequences_per_example} sequence(s) per example of {seq_tokens} tokens"
        + (f" (the data's longest, under max_seq_length {max_seq_length})" if seq_tokens < max_seq_length else ""),
        ("SDPA's math kernel on a CPU: s x s attention scores and probabilities kept per head" if cpu
         else "SDPA/flash attention (no s x s attention scores kept)"),
        m.note,
    ] + ([f"the process overhead of {'Unsloth' if backend == 'unsloth' else 'TRL'}'s stack on a CPU"] if cpu else []) \
      + ([f"the stored {s.get('checkpoint_dtype')} projections stay mapped after 4-bit quantization on a CPU"] if cpu and m.weights == "nf4" else [])

