

# --- progress, stop and trainer arguments -----------------------------------------------------------


class ProgressLog(TrainerCallback):
    """One progress record per training log on rank 0, plus every log dict (with its wall-clock time) in
    log_history.jsonl.

    The step comes from the trainer state: TRL's log dicts carry no step of their own. Both files only
    grow: a run that resumes in its own directory (a requeued Slurm job) recomputes the steps after its
    last checkpoint, and their records, already written by the attempt before, are not written twice.
    """

    def __init__(self, run_dir, telemetry):
        logs = Path(run_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.telemetry = telemetry
        self.recorded = last_recorded_step(logs / "progress.jsonl")
        self.progress = open(logs / "progress.jsonl", "a", encoding="utf-8", buffering=1)
        self.history = open(logs / "log_history.jsonl", "a", encoding="utf-8", buffering=1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if "loss" in logs and state.global_step <= self.recorded:
            return  # recorded by the attempt before this one
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


def last_recorded_step(path):
    """The step of the last complete record in progress.jsonl, 0 when there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 65536))
            lines = f.read().split(b"\n")[:-1]  # what follows the last newline is not a record yet
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


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


# The brief's report_to picks the tracker; each writes under logs/ of the run, never to a server.
TRACKER_MODULES = {"tensorboard": "tensorboard", "trackio": "trackio", "mlflow": "mlflow", "wandb": "wandb"}


def report_to(cfg, run_dir):
    """The trainer's report_to for the config's tracking.report_to, with each tracker pointed at its local store."""
    tracking = cfg.get("tracking") or {}
    wanted = tracking.get("report_to") or "tensorboard"
    if wanted == "none":
        return []
    logs = Path(run_dir) / "logs"
    project = tracking.get("project") or cfg.get("experiment") or "finetune-mcp"
    # Each store is chosen before its library is imported: trackio, for one, reads TRACKIO_DIR at import.
    if wanted == "tensorboard":
        os.environ.setdefault("TENSORBOARD_LOGGING_DIR", str(logs))
    elif wanted == "trackio":
        os.environ.setdefault("TRACKIO_DIR", str(logs / "trackio"))  # local SQLite, no Space
    elif wanted == "mlflow":
        os.environ.setdefault("MLFLOW_TRACKING_URI", (logs / "mlruns").as_uri())  # a local file store
        # MLflow 3 keeps the file store in maintenance mode and refuses it unless asked: it is still the one
        # store that needs no database and travels with the run directory.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_EXPERIMENT_NAME", project)
    elif wanted == "wandb":
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_DIR", str(logs))
        os.environ.setdefault("WANDB_PROJECT", project)
    try:
        tracker = __import__(TRACKER_MODULES[wanted])  # optional: only the chosen tracker must be installed
    except ImportError:
        if wanted == "tensorboard":  # the default: a run without it still trains
            print("[train.py] tensorboard is not installed: no TensorBoard events this run", flush=True)
            return []
        raise SystemExit(f"report_to: {wanted} is not installed in the training environment: "
                         f"pip install 'finetune-mcp[tracking]' there, or set report_to: tensorboard in the brief's Tracking section")
    if wanted == "mlflow" and int(os.environ.get("RANK", "0")) == 0:
        # The trainer's callback ends the run it starts when training ends, and the evaluation after it would
        # open a second, randomly named run: one run, opened here, holds both.
        tracker.set_experiment(project)
        if tracker.active_run() is None:
            tracker.start_run(run_name=(cfg.get("run") or {}).get("run_id"))
    return [wanted]


def trainer_args(cfg, run_dir, **extra):
    """The method's *Config arguments: config.yaml's calls.trainer plus where this run writes."""
    args = dict(cfg["calls"]["trainer"])
    trackers = report_to(cfg, run_dir)
    if "trackio" in trackers:  # trackio names its project from here (TrainingArguments.project)
        args["project"] = (cfg.get("tracking") or {}).get("project") or cfg.get("experiment") or "finetune-mcp"
    args.update(
        output_dir=str(Path(run_dir) / "checkpoints"),
        logging_strategy="steps",
        save_strategy="steps",
        eval_strategy="no",
        report_to=trackers,
        run_name=(cfg.get("run") or {}).get("run_id"),
        disable_tqdm=True,  # plain log lines in logs/stdout.log instead of progress-bar redraws
    )
    args.update(extra)
    return args


def same_shape(train_rows, eval_rows):
    """An eval file is used by the trainer only when its rows have the training rows' columns."""
    return bool(train_rows) and bool(eval_rows) and set(eval_rows[0]) >= set(train_rows[0])
