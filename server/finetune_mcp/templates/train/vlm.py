

# --- vision-language supervised fine-tuning -------------------------------------------------------------

from trl import SFTConfig, SFTTrainer


def _with_images(rows, base):
    """Open the rows' image files (paths relative to the dataset folder) as PIL images."""
    from PIL import Image

    out = []
    for row in rows:
        row = dict(row)
        if "images" in row:
            row["images"] = [Image.open(p if os.path.isabs(p) else base / p).convert("RGB") if isinstance(p, str) else p
                             for p in row["images"]]
        out.append(row)
    return out


def load_datasets(cfg, processor):
    """Conversations whose user turns mix image and text parts, with the images in an `images` column."""
    train_path, eval_path = data_files(cfg)
    base = Path(cfg["data"]["dir"])
    train_rows = _with_images(read_jsonl(train_path), base)
    eval_rows = _with_images(read_jsonl(eval_path), base) if eval_path else []
    eval_ds = Dataset.from_list(eval_rows) if same_shape(train_rows, eval_rows) else None
    return Dataset.from_list(train_rows), eval_ds


def build_trainer(cfg, run_dir, model, processor, peft_config, train_ds, eval_ds, callbacks):
#>> if backend == "unsloth"
    # Unsloth's collator builds the pixel inputs; the trainer must keep the image column and skip its own preparation.
    args = SFTConfig(**trainer_args(cfg, run_dir, max_length=None, remove_unused_columns=False,
                                    dataset_kwargs={"skip_prepare_dataset": True}))
    return SFTTrainer(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=processor,
        data_collator=UnslothVisionDataCollator(model, processor),
        callbacks=callbacks,
    )
#>> else
    # max_length stays unset: truncation could cut an image's tokens (vision-sft#image-handling).
    args = SFTConfig(**trainer_args(cfg, run_dir, max_length=None))
    return SFTTrainer(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=processor,
        peft_config=peft_config,
        callbacks=callbacks,
    )
#>> end
