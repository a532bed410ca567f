

# --- supervised fine-tuning -----------------------------------------------------------------------------

from trl import SFTConfig, SFTTrainer


def load_datasets(cfg, tokenizer):
    """Conversations ({"messages": [...]}) or prompt-completion rows; the trainer applies the chat template."""
    train_path, eval_path = data_files(cfg)
    train_rows = read_jsonl(train_path)
    eval_rows = read_jsonl(eval_path) if eval_path else []
    eval_ds = Dataset.from_list(eval_rows) if same_shape(train_rows, eval_rows) else None
    return Dataset.from_list(train_rows), eval_ds


def build_trainer(cfg, run_dir, model, tokenizer, peft_config, train_ds, eval_ds, callbacks):
    args = SFTConfig(**trainer_args(cfg, run_dir))
    return SFTTrainer(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
    )
