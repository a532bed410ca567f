

# --- supervised fine-tuning -----------------------------------------------------------------------------

from trl import SFTConfig, SFTTrainer

# Assistant-only masking: masking.py beside this script is a verbatim copy of finetune_mcp/common/masking.py
# (generate_config writes and commits both), so the trainer masks with the very code prepare_dataset checked.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from masking import MaskError, encode, template_sha256


def masking_of(cfg):
    """The masking prepare_dataset chose and checked for conversations (data.masking), with its template text."""
    m = (cfg.get("data") or {}).get("masking")
    if not m or (cfg.get("data") or {}).get("format") != "messages":
        return None
    if cfg["calls"]["trainer"].get("assistant_only_loss") is False:
        return None  # the config asks for loss on every token: the trainer gets the conversations as they are
    template = (Path(cfg["data"]["dir"]) / m["template_file"]).read_text(encoding="utf-8")
    if template_sha256(template) != m["plan"]["template_sha256"]:
        raise SystemExit(f"{cfg['data']['dir']}/{m['template_file']} changed since prepare_dataset checked it: prepare the dataset again")
    return m, template


def encode_conversations(rows, tokenizer, masking, system_prompt):
    """input_ids + assistant_masks per conversation, exactly as prepare_dataset encoded and checked them."""
    m, template = masking
    out = []
    for n, row in enumerate(rows, 1):
        messages = row["messages"]
        if system_prompt is not None and not (messages and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": system_prompt}] + list(messages)
        tools = row.get("tools")
        tools = json.loads(tools) if isinstance(tools, str) else tools
        try:
            ids, mask = encode(tokenizer, m["plan"], template, messages, tools, row.get("chat_template_kwargs"))
        except MaskError as e:
            raise SystemExit(f"record {n}: {m['plan']['method']} masking: {e}")
        out.append({"input_ids": ids, "assistant_masks": mask})
    return out


def load_datasets(cfg, tokenizer):
    """Conversations are tokenized and masked here (data.masking); prompt-completion rows go to the trainer as they are."""
    train_path, eval_path = data_files(cfg)
    train_rows = read_jsonl(train_path)
    eval_rows = read_jsonl(eval_path) if eval_path else []
    masking = masking_of(cfg)
    if masking is not None:
        system_prompt = cfg["data"]["masking"].get("system_prompt")
        train_rows = encode_conversations(train_rows, tokenizer, masking, system_prompt)
        eval_rows = encode_conversations(eval_rows, tokenizer, masking, system_prompt) if eval_rows else []
    eval_ds = Dataset.from_list(eval_rows) if same_shape(train_rows, eval_rows) else None
    return Dataset.from_list(train_rows), eval_ds


def build_trainer(cfg, run_dir, model, tokenizer, peft_config, train_ds, eval_ds, callbacks):
    extra = {}
    if "input_ids" in train_ds.column_names:
        # Pre-tokenized with assistant_masks: SFTTrainer builds the labels from the masks itself, and its own
        # assistant_only_loss (which needs {% generation %} markers) must stay off.
        extra["assistant_only_loss"] = False
    args = SFTConfig(**trainer_args(cfg, run_dir, **extra))
    return SFTTrainer(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
    )
