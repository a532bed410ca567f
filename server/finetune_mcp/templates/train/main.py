

# --- the run ------------------------------------------------------------------------------------------


def _mean(values):
    return sum(values) / len(values) if values else None


def learning_signal(cfg, history):
    """The recipe's signal metric over the run: mean of the first and of the last quarter of its logs."""
    metric, direction = cfg["signal"]["metric"], cfg["signal"]["direction"]
    values = [v for v in (_finite(h.get(metric)) for h in history if metric in h) if v is not None]
    k = max(1, len(values) // 4)
    first, last = _mean(values[:k]), _mean(values[-k:])
    moved = None
    if first is not None and last is not None and len(values) >= 2:
        moved = last < first if direction == "falls" else last > first
    return {"metric": metric, "direction": direction, "first": first, "last": last, "points": len(values), "moved_as_expected": moved}


def write_metrics(run_dir, cfg, status, trainer=None, started=None, **more):
    history = list(trainer.state.log_history) if trainer is not None else []
    losses = [v for v in (_finite(h.get("loss")) for h in history if "loss" in h) if v is not None]
    summary = next((h for h in reversed(history) if "train_runtime" in h), {})
    metrics = {
        "status": status,
        "method": METHOD,
        "backend": BACKEND,
        "run_id": (cfg.get("run") or {}).get("run_id"),
        "global_step": trainer.state.global_step if trainer is not None else 0,
        "epoch": trainer.state.epoch if trainer is not None else None,
        "train_runtime_s": round(time.time() - started, 2) if started else None,
        "train_loss": _finite(summary.get("train_loss")),
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "signal": learning_signal(cfg, history),
        "ended_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    metrics.update(more)
    tmp = Path(run_dir) / ".metrics.json.partial"
    tmp.write_text(json.dumps(metrics, indent=2, default=str) + "\n")
    os.replace(tmp, Path(run_dir) / "metrics.json")
    return metrics


def plot_loss(run_dir, cfg):
    """loss.png from logs/progress.jsonl (and the signal metric beside it when it is not the loss)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[train.py] matplotlib is not installed: no loss.png", flush=True)
        return
    records = [json.loads(l) for l in (Path(run_dir) / "logs" / "progress.jsonl").read_text().splitlines() if l.strip()]
    if not records:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    metric = cfg["signal"]["metric"]
    if metric != "loss":
        hist = [json.loads(l) for l in (Path(run_dir) / "logs" / "log_history.jsonl").read_text().splitlines() if l.strip()]
        points = [(h["step"], h[metric]) for h in hist if metric in h and "loss" in h]
        if points:
            ax2 = ax.twinx()
            ax2.plot([p[0] for p in points], [p[1] for p in points], color="tab:orange", label=metric)
            ax2.set_ylabel(metric)
    ax.set_title(f"{(cfg.get('run') or {}).get('run_id') or cfg.get('experiment')} ({METHOD}, {BACKEND})")
    fig.tight_layout()
    fig.savefig(Path(run_dir) / "loss.png", dpi=100)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=f"{METHOD} training ({BACKEND}); writes into the folder holding the config")
    parser.add_argument("--config", required=True, help="the resolved config.yaml of this run")
    config_path = Path(parser.parse_args(argv).config).resolve()
    cfg = load_config(config_path)
    run_dir = config_path.parent
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TENSORBOARD_LOGGING_DIR", str(run_dir / "logs"))
    script = cfg["calls"].get("script", {})
    telemetry = Telemetry(script.get("telemetry_interval_s", 1.0))
    trainer, started = None, time.time()
    try:
        model, processing, peft_config = load_model(cfg)
        train_ds, eval_ds = load_datasets(cfg, processing)
        callbacks = [ProgressLog(run_dir, telemetry), StopOnRequest()]
        trainer = build_trainer(cfg, run_dir, model, processing, peft_config, train_ds, eval_ds, callbacks)
        resume = resume_point(cfg, run_dir)
        print(f"[train.py] {METHOD} x {BACKEND}: {len(train_ds)} training rows; run dir {run_dir}"
              + (f"; resuming from {resume}" if resume else ""), flush=True)
        if resume:
            trainer.add_callback(ResumeGuard(trainer.model))
        try:
            trainer.train(resume_from_checkpoint=resume)
        except ValueError as e:
            if "parameter group" in str(e):  # torch.optim: "loaded state dict contains a parameter group that doesn't match ..."
                raise SystemExit(f"resume refused: optimizer parameter groups do not match the checkpoint ({e}). The checkpoint's "
                                 "optimizer was built for another set of trainable tensors: the adapter (r, target_modules, "
                                 "modules_to_save) or the method changed since it was saved. Resume with the config it was "
                                 "saved with, or start a new run") from None
            raise
        Stop.training = False

        step = trainer.state.global_step
        final = run_dir / "checkpoints" / f"checkpoint-{step}"
        if not final.is_dir():  # the last step was not a save step
            trainer.save_model(str(final))
        evaluation = None
        # evaluate() is a collective under DDP: every rank takes part, then only rank 0 writes.
        if not Stop.requested and eval_ds is not None and script.get("eval_at_end", True):
            evaluation = {k: _finite(v) for k, v in trainer.evaluate().items()}
        if not trainer.is_world_process_zero():
            return EXIT_STOPPED if Stop.requested else 0
        if Stop.requested:
            write_metrics(run_dir, cfg, "stopped", trainer, started, checkpoint=str(final.relative_to(run_dir)))
            print(f"[train.py] stopped at step {step}; checkpoint {final}", flush=True)
            return EXIT_STOPPED

        digest = copy_adapter(final, run_dir / "adapter")
        write_metrics(run_dir, cfg, "succeeded", trainer, started, eval=evaluation,
                      adapter={"path": "adapter", "digest": digest, "from_checkpoint": final.name})
        plot_loss(run_dir, cfg)
        print(f"[train.py] done: step {step}, adapter/ digest {digest}", flush=True)
        return 0
    except SystemExit:
        raise
    except BaseException as e:
        try:
            write_metrics(run_dir, cfg, "failed", trainer, started, error=f"{type(e).__name__}: {e}")
        except Exception:
            pass
        raise
    finally:
        telemetry.close()
        _leave_process_group(in_step=sys.exc_info()[0] is None)


def resume_point(cfg, run_dir):
    """The checkpoint this start continues from: the run's own newest one (a requeued or restarted job), else the
    one launch_run named (run.resume_from_checkpoint: another run's checkpoint), else None."""
    own = sorted((int(p.name.split("-")[1]), p) for p in (Path(run_dir) / "checkpoints").glob("checkpoint-*")
                 if p.name.split("-")[1].isdigit() and (p / "trainer_state.json").is_file())
    if own:
        step, path = own[-1]
        with open(Path(run_dir) / "logs" / "resumes.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": round(time.time(), 3), "checkpoint": path.name, "step": step,
                                "attempt": int(os.environ.get("SLURM_RESTART_COUNT") or 0)}) + "\n")
        return str(path)
    resume = (cfg.get("run") or {}).get("resume_from_checkpoint")
    if resume and not Path(resume).is_absolute():
        resume = str(Path(run_dir) / resume)
    return resume or None


class ResumeGuard(TrainerCallback):
    """After a resume, every tensor the fresh adapter trains must still be trainable.

    Reloading a PEFT adapter can leave its modules_to_save copies (embed_tokens, lm_head) frozen
    (peft#859, unsloth#3108): the run would go on without training them and its loss drift from the run
    it continues. Refused by name instead.
    """

    def __init__(self, model):
        self.model = model
        self.trainable = {n for n, p in model.named_parameters() if p.requires_grad}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        now = {n for n, p in self.model.named_parameters() if p.requires_grad}
        frozen = sorted(self.trainable - now)
        if frozen:
            raise SystemExit(f"resume refused: {len(frozen)} adapter tensors came back frozen after loading the checkpoint "
                             f"(first: {frozen[0]}); modules_to_save layers such as embed_tokens / lm_head are the known "
                             "case (peft#859). Nothing was trained; start a new run or resume with is_trainable adapters")


def _leave_process_group(in_step: bool):
    """Under DDP, ranks leave together: wait for rank 0's writes, then leave without tearing the group down.

    A rank that exits with the group still up can abort in gloo's threads ("terminate called
    without an active exception", SIGABRT) while rank 0 is still writing, so after a finished step
    every rank meets in a barrier first. After a crash nobody waits (a dead peer would never arrive):
    the launcher ends the others.

    destroy_process_group is not called: once the barrier returns every collective has completed, and
    __main__ leaves with os._exit, so the kernel closes the sockets. Its teardown is the one step that
    was seen hanging (a full suite waited 12 minutes on rank 0 inside gloo's destroy, rank 1 gone);
    bounding it in a helper thread still cost up to 30 s per rank and bought nothing.
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and in_step:
            dist.barrier()
    except Exception:
        pass


def _distributed() -> bool:
    """This process is a rank of a process group (left up on purpose: see _leave_process_group)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    if _distributed():
        # A DDP rank leaves with os._exit once its files are written and flushed: interpreter shutdown would
        # run the process group's C++ destructors, which is where a teardown hangs or aborts.
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)  # what sys.exit would print for a message
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else (0 if code is None else 1))
    sys.exit(code)
