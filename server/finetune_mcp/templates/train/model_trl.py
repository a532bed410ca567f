

# --- the training stack: TRL + PEFT + transformers ------------------------------------------------

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback
#>> if family == "vlm"
from transformers import AutoModelForImageTextToText, AutoProcessor
#>> else
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
#>> end


def _dtype(name):
    return getattr(torch, name) if isinstance(name, str) else name


#>> if family == "vlm"
def vision_target_modules(script):
    """The LoRA target regex for the four finetune_* switches (Unsloth's FastVisionModel names)."""
    projections = []
    if script.get("finetune_attention_modules", True):
        projections += ["q_proj", "k_proj", "v_proj", "o_proj", "qkv", "proj", "out_proj"]
    if script.get("finetune_mlp_modules", True):
        projections += ["gate_proj", "up_proj", "down_proj", "fc1", "fc2", "linear_fc1", "linear_fc2"]
    towers = []
    if script.get("finetune_language_layers", True):
        towers.append("language_model")
    if script.get("finetune_vision_layers", False):
        towers += ["vision_tower", "visual", "vision_model"]
    if not projections or not towers:
        raise SystemExit("the finetune_* switches select no module to adapt: turn at least one tower and one module kind on")
    return rf".*(?:{'|'.join(towers)}).*\.(?:{'|'.join(projections)})$"


def load_model(cfg):
    """An image-text-to-text model with its processor, and the LoraConfig the trainer applies."""
    calls = cfg["calls"]
    load = dict(calls["load"])
    load["dtype"] = _dtype(load.get("dtype", "float32"))
    model = AutoModelForImageTextToText.from_pretrained(cfg["model"]["path"], **load)
    processor = AutoProcessor.from_pretrained(cfg["model"]["path"])
    peft_config = LoraConfig(bias="none", target_modules=vision_target_modules(calls["script"]), **calls["peft"])
    return model, processor, peft_config
#>> else
def load_model(cfg):
    """The base model (4-bit when the config says so), its tokenizer, and the LoraConfig the trainer applies."""
    calls = cfg["calls"]
    load = dict(calls["load"])
    load["dtype"] = _dtype(load.get("dtype", "float32"))
    quant = calls.get("quantization") or {}
    if quant.get("load_in_4bit"):
        quant = dict(quant)
        quant["bnb_4bit_compute_dtype"] = _dtype(quant.get("bnb_4bit_compute_dtype", "bfloat16"))
        load["quantization_config"] = BitsAndBytesConfig(**quant)
    model = AutoModelForCausalLM.from_pretrained(cfg["model"]["path"], **load)
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"]["path"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if quant.get("load_in_4bit"):
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=bool(calls["trainer"].get("gradient_checkpointing", False))
        )
    peft_config = LoraConfig(task_type="CAUSAL_LM", bias="none", **calls["peft"])
    return model, tokenizer, peft_config
#>> end
