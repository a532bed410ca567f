

# --- the training stack: Unsloth (imported first, so that its patches reach transformers and TRL) ----

#>> if family == "vlm"
from unsloth import FastVisionModel
from unsloth.trainer import UnslothVisionDataCollator
#>> else
from unsloth import FastLanguageModel
#>> end
#>> if family == "preference"
from unsloth import PatchDPOTrainer

PatchDPOTrainer()
#>> end
import torch
from datasets import Dataset
from transformers import TrainerCallback


def _dtype(name):
    return getattr(torch, name) if isinstance(name, str) else name


#>> if family == "vlm"
def load_model(cfg):
    """A vision-language model and processor from FastVisionModel, with the LoRA adapter attached."""
    calls = cfg["calls"]
    load = dict(calls["load"])
    load["dtype"] = _dtype(load.get("dtype", "float32"))
    model, processor = FastVisionModel.from_pretrained(model_name=cfg["model"]["path"], **load)
    model = FastVisionModel.get_peft_model(model, bias="none", **calls["peft"])
    return model, processor, None
#>> else
def load_model(cfg):
    """The base model and tokenizer from FastLanguageModel, with the LoRA adapter attached."""
    calls = cfg["calls"]
    load = dict(calls["load"])
    load["dtype"] = _dtype(load.get("dtype", "float32"))
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=cfg["model"]["path"], **load)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = FastLanguageModel.get_peft_model(model, bias="none", **calls["peft"])
    return model, tokenizer, None
#>> end
