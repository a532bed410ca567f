

# --- progress, stop and trainer arguments -----------------------------------------------------------


class ProgressLog(TrainerCallback):
    """One progress record per training log on rank 0, plus every log dict in log_history.jsonl.

    The step comes from the trainer state: TRL's log dicts carry no step of their own.
    """

    def __init__(self, run_dir, telemetry):
        logs = Path(run_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.telemetry = telemetry
        self.progress = open(logs / "progress.jsonl", "a", encoding="utf-8", buffering=1)
        self.history = open(logs / "log_history.jsonl", "a", encoding="utf-8", buffering=1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        # The wall clock beside each log: throughput between two logs (tokens/s past the warm-up) needs it.
        self.history.write(json.dumps({"step": state.global_step, "time": round(time.time(), 3), **logs}, default=float) + "\n")
        if "loss" not in logs:  # eval results and the end-of-training summary
            return
        record = {
            "step": state.global_step,
            "loss": float(logs["loss"]),  # NaN / Infinity stay visible (JSON's NaN token) for triage
            "lr": float(logs.get("learning_rate", 0.0)),
            "mem_gb": self.telemetry.take_mem_gb(),
            "temp_c": self.telemetry.temp_c,
        }
        self.progress.write(json.dumps(record) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        self.progress.flush()
        self.history.flush()


class StopOnRequest(TrainerCallback):
    """Turns a stop signal into 'save a checkpoint at the end of this step, then stop'."""

    def on_train_begin(self, args, state, control, **kwargs):
        Stop.training = True

    def on_step_end(self, args, state, control, **kwargs):
        # Under DDP every rank must stop at the same step, or the ranks that go on hang in the
        # next collective: agree on the flag (any rank asked -> all stop).
        if _any_rank(Stop.requested):
            Stop.requested = True
            control.should_save = True
            control.should_training_stop = True


def _any_rank(flag):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return bool(flag)
    import torch

    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def report_to():
    try:
        import tensorboard  # noqa: F401  (transformers' TensorBoard callback needs it)

        return ["tensorboard"]
    except ImportError:
        print("[train.py] tensorboard is not installed: no TensorBoard events this run", flush=True)
        return []


def trainer_args(cfg, run_dir, **extra):
    """The method's *Config arguments: config.yaml's calls.trainer plus where this run writes."""
    args = dict(cfg["calls"]["trainer"])
    args.update(
        output_dir=str(Path(run_dir) / "checkpoints"),
        logging_strategy="steps",
        save_strategy="steps",
        eval_strategy="no",
        report_to=report_to(),
        disable_tqdm=True,  # plain log lines in logs/stdout.log instead of progress-bar redraws
    )
    args.update(extra)
    return args


def same_shape(train_rows, eval_rows):
    """An eval file is used by the trainer only when its rows have the training rows' columns."""
    return bool(train_rows) and bool(eval_rows) and set(eval_rows[0]) >= set(train_rows[0])
