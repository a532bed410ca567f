

# --- preference optimization: {{LABEL}} -----------------------------------------------------------------

from {{TRAINER_MODULE}} import {{TRAINER_CONFIG}}, {{TRAINER_CLASS}}
#>> if method == "kto"
from trl.data_utils import unpair_preference_dataset
#>> end


def load_datasets(cfg, tokenizer):
#>> if method == "kto"
    """Unpaired rows (prompt, completion, label); paired rows (prompt, chosen, rejected) are split into two."""
#>> else
    """Preference rows: prompt, chosen, rejected (conversational or plain text)."""
#>> end
    train_path, eval_path = data_files(cfg)
    train_rows = read_jsonl(train_path)
    eval_rows = read_jsonl(eval_path) if eval_path else []
    train_ds = Dataset.from_list(train_rows)
    eval_ds = Dataset.from_list(eval_rows) if same_shape(train_rows, eval_rows) else None
#>> if method == "kto"
    if "chosen" in train_ds.column_names:
        train_ds = unpair_preference_dataset(train_ds)
        eval_ds = unpair_preference_dataset(eval_ds) if eval_ds is not None else None
#>> end
    return train_ds, eval_ds


def build_trainer(cfg, run_dir, model, tokenizer, peft_config, train_ds, eval_ds, callbacks):
    args = {{TRAINER_CONFIG}}(**trainer_args(cfg, run_dir))
    return {{TRAINER_CLASS}}(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
    )
