"""Pydantic input and output models of every tool: the arguments a client sends and the structured content it receives.

An input model *is* the tool's input schema: its fields (with their descriptions and limits) are the
tool's arguments, its docstring the tool's description, and the phase function takes exactly these
keywords. Every result starts with `summary`, one line a person reads first; `citations` name the
skill sections (skill#anchor) whose facts the tool applied. Sections are owned per tool.
"""

import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer


class _Model(BaseModel):
    # Validators and schemas are built on first use, not at import: a server builds only its role's tools'
    # (cold start, bench/bench_startup.py).
    model_config = ConfigDict(defer_build=True)


class Args(_Model):
    """A tool's arguments; the docstring of each subclass is the tool's description."""

    model_config = ConfigDict(extra="forbid")


RunRef = Annotated[str, Field(description="<experiment>/<YYYYMMDD-HHMM-tag>, as launch_run returned it")]
ExperimentRef = Annotated[str, Field(description="the experiment's name, as prepare_dataset returned it (a folder under $DGX_SPARK_ROOT)")]
TagRef = Annotated[str, Field(description="the tag generate_config committed the run's config under (configs/run-<tag>.yaml)")]


class Result(_Model):
    model_config = ConfigDict(extra="forbid")

    summary: str = Field(description="one line on what happened, for a person reading the call")
    citations: list[str] = Field(default_factory=list, description="skill sections applied, as skill#anchor")

    def text(self) -> str:
        """The human-readable text content; results override it to show what matters most."""
        return self.summary


# --- prepare_dataset ---------------------------------------------------------------------


class PrepareDatasetArgs(Args):
    """Open the experiment from a training brief, then load, validate, template, pack and describe its dataset.

    Applies the chat template before packing, decodes packed samples with the trained spans
    marked, writes the dataset card and validation report, runs the collapse guard, and walks
    the Phase 2 exit checklist (`complete` is false unless every item holds)."""

    brief_path: Annotated[str, Field(description="the training-brief.md to execute")]
    source: Annotated[str, Field(description="JSONL/JSON/Parquet/CSV file or folder, a save_to_disk folder, or an HF dataset id: org/name, org/name:split or org/name:config:split")]
    dataset_name: Annotated[str | None, Field(description="name under $DGX_SPARK_ROOT/datasets/ (default: from the experiment)")] = None
    eval_fraction: Annotated[float, Field(ge=0.0, lt=0.5, description="share of the records held out as the eval split (0 to under 0.5)")] = 0.05


class Problem(_Model):
    severity: Literal["error", "warning"]
    code: str = Field(description="problem class, e.g. malformed-json, roles-order, near-duplicate")
    message: str
    file: str | None = None
    line: int | None = Field(default=None, description="1-based line (JSONL/CSV) in the source file")
    record: int | None = Field(default=None, description="0-based record index")
    field: str | None = None


class ChecklistItem(_Model):
    item: str
    ok: bool
    evidence: str


class PrepareDatasetResult(Result):
    experiment: str
    experiment_dir: str
    method: str
    format: str = Field(description="detected source format")
    converted_from: str | None = None
    conversion: dict[str, Any] | None = Field(None, description="source shape, conversion steps, what they did (in records), placeholders filled, columns left out")
    max_seq_length: int | None = Field(None, description="the length applied: the brief's, or the method recipe's default (then a warning gives the data's p99)")
    provenance: str | None = Field(None, description="synthetic | curated | mixed: decides whether the collapse guard fails or warns")
    tokens: dict[str, Any] | None = Field(None, description="tokens per record under the real template (p50, p95, p99, max) and the share over max_seq_length")
    transformations: dict[str, Any] | None = Field(None, description="what the brief's long_records policy dropped or truncated and the exact "
                                                   "duplicates removed, each with where (file:line) and why; the max_seq_length that keeps 95%/99%")
    dataset_dir: str | None = None
    counts: dict[str, int] = Field(default_factory=dict)
    problems: list[Problem] = Field(default_factory=list, description="listed one by one, up to the skill's listed_per_code per code and severity")
    problem_counts: dict[str, dict[str, int]] = Field(default_factory=dict, description="code -> {error, warning} counts, listed or not")
    masking: dict[str, Any] | None = Field(default=None, description="conversations: how the assistant's tokens are found (method, end-of-turn, "
                                           "every way tried and why it failed, row kinds verified, the template's default system prompt)")
    packing: dict[str, Any] | None = None
    decoded_samples: list[str] = Field(default_factory=list)
    files: list[str] = Field(default_factory=list)
    checklist: list[ChecklistItem] = Field(default_factory=list)
    complete: bool

    def text(self) -> str:
        lines = [self.summary, "", f"Experiment: {self.experiment_dir}"]
        if self.dataset_dir:
            lines.append(f"Dataset: {self.dataset_dir}")
        if self.conversion and self.conversion.get("steps"):
            lines.append(f"Converted from the {self.conversion.get('source_shape')} shape: {' → '.join(self.conversion['steps'])} "
                         "(the dataset card says how, and that nothing was dropped)")
        if self.transformations and self.transformations.get("line"):
            lines.append("Lengths: " + self.transformations["line"])
        lines += ["", "Phase 2 exit checklist:"]
        lines += [f"  [{'x' if c.ok else ' '}] {c.item}\n        {c.evidence}" for c in self.checklist]
        errors = [p for p in self.problems if p.severity == "error"]
        warnings = [p for p in self.problems if p.severity == "warning"]
        for label, group in (("Errors", errors), ("Warnings", warnings)):
            if group:
                lines += ["", f"{label} ({len(group)} listed):"]
                for p in group[:15]:
                    where = ":".join(str(x) for x in (p.file.rsplit("/", 1)[-1] if p.file else None, p.line) if x is not None)
                    lines.append(f"  - {p.code} {where}{' [' + p.field + ']' if p.field else ''}: {p.message}")
                if len(group) > 15:
                    lines.append(f"  ... {len(group) - 15} more in data/validation-report.md")
        if self.decoded_samples:
            lines += ["", f"First of {len(self.decoded_samples)} decoded samples (all in data/validation-report.md; "
                      "trained tokens in ⟦ ⟧):", self.decoded_samples[0]]
        if self.citations:
            lines += ["", "Applied: " + ", ".join(self.citations)]
        return "\n".join(lines)


# --- preflight ---------------------------------------------------------------------------


class PreflightArgs(Args):
    """Probe driver, GPU, memory, disk, thermals and the training stack; write env-report.json with
    verdict ready / ready-with-warnings / blocked (DGX Spark G-checks, else the generic fallback)."""

    experiment: Annotated[str, Field(description="experiment name returned by prepare_dataset")]


class CheckResult(_Model):
    id: str
    name: str
    status: Literal["pass", "warn", "fail"]
    observed: str
    threshold: str
    remediation: str | None = None
    cite: str


class PreflightResult(Result):
    experiment: str
    platform: Literal["dgx-spark", "generic-nvidia", "cpu"]
    verdict: Literal["ready", "ready-with-warnings", "blocked"]
    checks: list[CheckResult]
    memory_estimate: dict[str, Any] = Field(default_factory=dict)
    time_estimate: dict[str, Any] = Field(default_factory=dict, description="expected wall time from real training steps timed in the worker "
                                          "(seconds per step, steps, wall, the brief's time budget)")
    env_report: str

    def text(self) -> str:
        lines = [self.summary, ""]
        for c in self.checks:
            lines.append(f"[{c.status.upper()}] {c.id} {c.name}: {c.observed}")
            lines.append(f"       threshold: {c.threshold}")
            if c.status != "pass" and c.remediation:
                lines.append(f"       next step: {c.remediation} ({c.cite})")
        gb = (self.memory_estimate or {}).get("gb") or {}
        if gb:
            parts = ", ".join(f"{k} {v:g}" for k, v in gb.items() if k != "total")
            lines.append("")
            lines.append(f"memory estimate: {gb.get('total'):g} GB ({parts}); {self.memory_estimate.get('formula', '')}")
        lines.append(f"env-report: {self.env_report}")
        return "\n".join(lines)


# --- generate_config ---------------------------------------------------------------------


class GenerateConfigArgs(Args):
    """Resolve the chosen method's recipe with the brief and memory budget (every value says where it came
    from), render train.py for the backend (Unsloth first, TRL+PEFT escape hatch) and commit config + script."""

    experiment: ExperimentRef
    tag: Annotated[str, Field(description="what this run varies, e.g. r16-lr2e4; names configs/run-<tag>.yaml and the run id")]
    backend: Annotated[Literal["auto", "unsloth", "trl"], Field(description="training backend: auto picks Unsloth where the preflight found it importable and it trains the method on this platform, else TRL+PEFT")] = "auto"
    overrides: Annotated[dict[str, Any], Field(description="values for keys of the chosen method's recipe only")] = {}


class ResolvedValue(_Model):
    value: Any
    source: str = Field(description="recipe | brief | budget-rule | override | platform, with the skill section")


class GenerateConfigResult(Result):
    experiment: str
    tag: str
    method: str
    backend: Literal["unsloth", "trl"]
    backend_reason: str
    resolved: dict[str, ResolvedValue]
    files: list[str]
    commit: str
    warnings: list[str] = Field(default_factory=list, description="values outside settled ranges, budget misses, forced backends")
    memory_estimate: dict[str, Any] = Field(default_factory=dict, description="the estimate for the resolved values against the brief's budget")
    time_estimate: dict[str, Any] = Field(default_factory=dict, description="the preflight's expected wall time restated for the resolved "
                                          "batch, accumulation, length and steps (from the same timed training steps)")
    masking: str | None = Field(default=None, description="conversations: the assistant-only masking way train.py uses (config data.masking)")

    def text(self) -> str:
        lines = [self.summary, f"backend: {self.backend} — {self.backend_reason}"]
        if self.masking:
            lines.append(f"assistant-only masking: {self.masking}")
        for w in self.warnings:
            lines.append(f"warning: {w}")
        lines.append("resolved (value — source):")
        for k, v in self.resolved.items():
            lines.append(f"  {k}: {v.value!r} — {v.source}")
        lines.append("files: " + ", ".join(self.files))
        lines.append(f"commit: {self.commit}")
        if self.citations:
            lines.append("cites: " + ", ".join(self.citations))
        return "\n".join(lines)


# --- launch_run / poll_progress / stop_run / prune_checkpoints ---------------------------


class LaunchRunArgs(Args):
    """Start the committed config as a detached run that outlives this server. Refuses without a preflight,
    on blocked, on unaccepted warnings, on an uncommitted or changed config, on a busy GPU, on an existing run id."""

    experiment: ExperimentRef
    tag: TagRef
    accept_warnings: Annotated[bool, Field(description="launch despite a ready-with-warnings preflight (the caller's decision)")] = False
    launcher: Annotated[Literal["local", "torchrun", "docker", "slurm"], Field(description="how the run starts: a detached local process, torchrun, a docker container, or a Slurm job")] = "local"
    nproc: Annotated[int, Field(ge=1, le=64, description="processes per node (torchrun, docker, slurm): one per GPU")] = 1
    nodes: Annotated[int, Field(ge=1, le=64, description="Slurm nodes (1 elsewhere)")] = 1
    gpus_per_node: Annotated[int | None, Field(description="Slurm GPUs per node, one trainer process each (unset: no GPUs asked for; processes follow nproc)")] = None
    partition: Annotated[str | None, Field(description="Slurm partition (default: the cluster's)")] = None
    time_limit: Annotated[str | None, Field(description="Slurm time limit, e.g. 01:00:00")] = None
    account: Annotated[str | None, Field(description="Slurm account to charge (default: the user's)")] = None
    resume_from: Annotated[str | None, Field(description="a failed or stopped run of this experiment (its id, or 'latest') to continue from its "
                                                          "newest checkpoint: optimizer, scheduler and RNG state restored, records continue at "
                                                          "the next step, in a new run beside it")] = None


class PollProgressArgs(Args):
    """Records since the cursor, each exactly {step, loss, lr, mem_gb, temp_c}; the run status with exit
    code or signal; anomalies (NaN/inf loss, spikes, stalls); and the next cursor.

    The cursor is a byte offset into the run's record log (logs/progress.jsonl; logs/stdout.log for a
    script without our progress callback), always at a line boundary: a poll reads only what was written
    after it, and the same cursor gives the same records from any server, also after a restart. Keep
    polling with next_cursor; `more` says records are waiting past `limit`. A client that sends a
    progress token gets a notification with the latest step and loss."""

    run_id: RunRef
    cursor: Annotated[int, Field(ge=0, description="next_cursor of the previous call, unchanged; 0 from the start")] = 0
    limit: Annotated[int, Field(ge=1, le=5000, description="at most this many records per call; `more` says others are waiting")] = 200
    plot: Annotated[bool, Field(description="also return the loss curve as a PNG image")] = False


class StopRunArgs(Args):
    """SIGTERM to the run's process group (the trainer saves a checkpoint), then SIGKILL after the grace period."""

    run_id: RunRef
    grace_seconds: Annotated[float, Field(ge=0, le=600, description="seconds between SIGTERM (the trainer saves a checkpoint) and SIGKILL")] = 30.0


class PruneCheckpointsArgs(Args):
    """Delete checkpoints/ of a run that succeeded and whose adapter/ verifies against its digest. adapter/ is never touched."""

    run_id: RunRef


class ProgressRecord(_Model):
    """Exactly the record shape of the training-engineer seed, keys in this order."""

    model_config = ConfigDict(extra="forbid")

    step: int
    loss: float | None = Field(description="null only when the logged loss was NaN or infinite (see anomalies)")
    lr: float
    mem_gb: float | None
    temp_c: float | None

    @field_serializer("loss")
    def _finite(self, v: float | None):
        return None if v is None or not math.isfinite(v) else v


class Anomaly(_Model):
    kind: Literal["nan-loss", "inf-loss", "loss-spike", "stalled", "loss-jump-after-resume"]
    step: int | None = None
    message: str


class LaunchResult(Result):
    run_id: str
    run_dir: str
    launcher: str
    pid: int | None = None
    job_id: str | None = None
    command: list[str] = Field(default_factory=list)
    commit: str | None = None
    warnings_accepted: list[str] = Field(default_factory=list)
    resumed_from: dict[str, Any] | None = Field(default=None, description="{run_id, checkpoint, step} of the run this one continues")


class PollResult(Result):
    run_id: str
    status: Literal["starting", "running", "succeeded", "failed", "stopped"]
    exit_code: int | None = None
    signal: str | None = None
    detail: str | None = None
    records: list[ProgressRecord]
    last: ProgressRecord | None = None
    anomalies: list[Anomaly] = Field(default_factory=list)
    cursor: int
    next_cursor: int
    more: bool = Field(default=False, description="true when more records are waiting past `limit`")
    tokens_per_s: float | None = Field(default=None, description="training tokens per second over the last trainer logs (null when the trainer counts no tokens)")
    steps_per_s: float | None = Field(default=None, description="optimizer steps per second over the last trainer logs")
    eta_s: float | None = Field(default=None, description="seconds left to max_steps at that pace, while the run is running")

    def text(self) -> str:
        # The records one JSON line each, in the seed's exact shape, so a reader can copy them as they are.
        lines = [self.summary]
        if self.detail:
            lines.append(self.detail)
        lines += [json.dumps(r.model_dump(mode="json")) for r in self.records]
        if not self.records and self.last is not None:
            lines.append("last: " + json.dumps(self.last.model_dump(mode="json")))
        lines += [f"anomaly {a.kind}" + (f" at step {a.step}" if a.step is not None else "") + f": {a.message}" for a in self.anomalies]
        lines.append(f"next_cursor: {self.next_cursor}" + (" (more records waiting: poll again now)" if self.more else ""))
        return "\n".join(lines)


class StopResult(Result):
    run_id: str
    status: str
    signal_sent: list[str] = Field(default_factory=list)
    checkpoint: str | None = None


class PruneResult(Result):
    run_id: str
    freed_bytes: int
    removed: list[str] = Field(default_factory=list)


# --- compare_runs ------------------------------------------------------------------------


class CompareRunsArgs(Args):
    """The runs of one experiment side by side: each config value that differs from the first run, final and best
    loss, eval loss and accuracy, wall time and tokens/s; and one PNG with their loss curves overlaid."""

    experiment: ExperimentRef
    runs: Annotated[list[str] | None, Field(description="run ids to compare, the first being the baseline (default: every run of the experiment, oldest first)")] = None
    plot: Annotated[bool, Field(description="also return the overlaid loss curves as a PNG image")] = True


class CompareRow(_Model):
    run_id: str
    status: str
    differs: dict[str, Any] = Field(default_factory=dict, description="this run's value of every setting that is not the same in all runs")
    steps: int
    final_loss: float | None = None
    best_loss: float | None = None
    best_step: int | None = None
    eval_loss: float | None = None
    eval_accuracy: float | None = Field(default=None, description="task accuracy from the eval engineer's signed evaluation (the verdict's, for the training role)")
    wall_s: float | None = None
    tokens_per_s: float | None = None
    resumed_from: str | None = None


class CompareResult(Result):
    experiment: str
    baseline: str
    varied: list[str] = Field(default_factory=list, description="settings whose value differs from the baseline in at least one run")
    runs: list[CompareRow]

    def text(self) -> str:
        def cell(v: Any) -> str:
            if v is None:
                return "—"
            if isinstance(v, float):
                return f"{v:.4g}"
            return str(v).replace("|", "\\|")

        cols = ["run", "status", *self.varied, "steps", "final loss", "best loss (step)", "eval loss", "eval acc", "wall s", "tokens/s"]
        lines = [self.summary, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in self.runs:
            best = f"{cell(r.best_loss)} ({r.best_step})" if r.best_loss is not None else "—"
            lines.append("| " + " | ".join([r.run_id.split("/", 1)[1], r.status, *(cell(r.differs.get(k)) for k in self.varied), str(r.steps),
                                            cell(r.final_loss), best, cell(r.eval_loss), cell(r.eval_accuracy), cell(r.wall_s),
                                            cell(r.tokens_per_s)]) + " |")
        return "\n".join(lines)


# --- triage_failure ----------------------------------------------------------------------


class TriageFailureArgs(Args):
    """Diagnose the failure class (environment / divergence / oom / none) with verbatim evidence lines, then the
    response: the preflight check to re-run, the ordered divergence causes, or the next OOM-ladder rung."""

    run_id: Annotated[str | None, Field(description="a run of ours")] = None
    log_path: Annotated[str | None, Field(description="any training log file")] = None


class EvidenceLine(_Model):
    file: str
    line: int
    text: str


class CauseCheck(_Model):
    cause: str
    verdict: Literal["explains", "cleared", "not-checked"]
    why: str


class RunnerUp(_Model):
    failure_class: Literal["environment", "divergence", "oom", "none"]
    confidence: float = Field(ge=0, le=1)
    why: str


class MetricsSeen(_Model):
    """What the log's numbers were, as parsed from any format (HF dicts, key=value, tables, JSON, Megatron)."""

    records: int = 0
    losses: int = 0
    loss_first: float | None = None
    loss_min: float | None = None
    loss_last: float | None = None
    grad_norm_max: float | None = None
    loss_scale_last: float | None = None
    loss_nonfinite_at_end: int = Field(0, description="training losses logged NaN/inf at the end, with no finite one after")


class TriageResult(Result):
    failure_class: Literal["environment", "divergence", "oom", "none"]
    none_reason: Literal["healthy", "unrecognised", "stopped"] | None = None
    evidence: list[EvidenceLine] = Field(default_factory=list)
    check_id: str | None = None
    causes: list[CauseCheck] = Field(default_factory=list)
    next_rung: str | None = None
    tried_rungs: list[str] = Field(default_factory=list)
    next_step: str
    halt_run: bool = False
    confidence: float | None = Field(None, ge=0, le=1, description="how far the deciding evidence stands above the rest (a ranking, not a calibrated probability)")
    runner_up: RunnerUp | None = Field(None, description="the next most likely class, when any other class has evidence")
    signals: list[str] = Field(default_factory=list, description="the signal ids that matched, the deciding one first")
    missing_evidence: list[str] = Field(default_factory=list, description="what would settle the verdict, where the log lacks it")
    metrics: MetricsSeen | None = None


# --- gate and export ---------------------------------------------------------------------


class EvalItem(_Model):
    """One task prompt, judged on the base model and on the fine-tuned one."""

    prompt: Any
    expected: list[str] = Field(description="the accepted answers")
    scorer: str = Field(description="the scorer that judged it, with options that differ from its defaults, e.g. rouge_l(threshold=0.4)")
    base_output: str
    output: str = Field(description="the fine-tuned model's answer")
    base_correct: bool
    correct: bool
    base_score: float = Field(description="1.0 / 0.0, or the ROUGE-L F-measure for rouge_l")
    score: float
    change: Literal["improved", "regressed", "unchanged"]


class SideBySide(_Model):
    improved: int = 0
    regressed: int = 0
    unchanged: int = 0


class DriftFigures(_Model):
    kl: float | None = Field(default=None, description="mean per-token KL(base || tuned), nats, on the base model's greedy continuations of general prompts")
    perplexity_ratio: float | None = Field(default=None, description="perplexity on a general text, fine-tuned / base (1.0 = unchanged)")
    perplexity_base: float | None = None
    perplexity_tuned: float | None = None
    changed_share: float | None = Field(default=None, description="share of general prompts whose greedy answer would change")
    prompts: int = 0
    kl_tokens: int | None = None
    perplexity_tokens: int | None = None
    prompts_source: str | None = None
    text_source: str | None = None


class EvaluateCheckpointArgs(Args):
    """Run the experiment's eval/ suite against the run's adapter and the base model: task accuracy with each
    prompt's scorer and both answers side by side (eval/<experiment>/reports/), eval loss, and drift (KL to the base
    model on general prompts, perplexity ratio on a general text) against the thresholds. The result is signed with
    the eval key into eval/<experiment>/results/<run>.json, where only the eval role writes."""

    run_id: RunRef


class RecordVerdictArgs(Args):
    """Write the run's promotion-report.md under verdicts/<experiment>/<run>/, signed (Ed25519) over run id, adapter and
    base model digests, verdict, evidence digest and the signed evaluation it rests on. Every check is recomputed from
    that evaluation's signed figures; a PROMOTE against a failed check needs override_reason, which the verdict records."""

    run_id: RunRef
    verdict: Annotated[Literal["PROMOTE", "REJECT"], Field(description="PROMOTE lets export run for this adapter; REJECT stops it, with top_remediation")]
    evidence: Annotated[str, Field(min_length=1, description="what the verdict rests on (figures, eval report)")]
    top_remediation: Annotated[str, Field(description="for REJECT: the one change to try first")] = ""
    override_reason: Annotated[str, Field(description="PROMOTE only: why the run is promoted although the evaluation fails a check "
                                                      "(recorded in the signed verdict as an override)")] = ""


class WriteEvalFileArgs(Args):
    """Create or replace a file under the experiment's eval/ (eval-engineer only)."""

    experiment: ExperimentRef
    relpath: Annotated[str, Field(description="path inside eval/, e.g. prompts.jsonl, goldens.jsonl, drift.jsonl, eval.yaml")]
    content: Annotated[str, Field(description="the file's whole new text (UTF-8); checked against the file's format before it is written")]


class ExportArgs(Args):
    """Export only under a valid signed PROMOTE for this run's adapter; always smoke-tests the artifact in its
    target runtime against 3-5 golden outputs. A REJECT is passed along with its evidence and remediation."""

    run_id: RunRef
    format: Annotated[Literal["lora", "merged-16bit", "gguf-f16", "gguf-q8_0", "gguf-q4_k_m"] | None,
                      Field(description="artifact format (default: chosen from the brief's deployment target)")] = None
    target_runtime: Annotated[Literal["transformers", "vllm", "llama.cpp", "ollama"] | None,
                              Field(description="runtime the artifact is smoke-tested in (default: the brief's)")] = None


class EvalResult(Result):
    run_id: str
    task_accuracy: float | None = None
    base_accuracy: float | None = None
    eval_loss: float | None = None
    base_eval_loss: float | None = Field(default=None, description="the base model's loss on the same rows, beside the fine-tuned one")
    drift: DriftFigures = Field(default_factory=DriftFigures)
    side_by_side: SideBySide = Field(default_factory=SideBySide)
    scorers: dict[str, int] = Field(default_factory=dict, description="scorer label -> prompts it judged")
    items: list[EvalItem] = Field(default_factory=list, description="every task prompt: base and fine-tuned answers side by side")
    thresholds: dict[str, Any] = Field(default_factory=dict)
    passed: dict[str, bool] = Field(default_factory=dict)
    details: list[dict[str, Any]] = Field(default_factory=list)
    report: str | None = Field(default=None, description="eval/<experiment>/reports/<run tag>.md: the figures, and every answer side by side")
    side_by_side_report: str | None = Field(default=None, description="the same report (every answer, base beside fine-tuned)")
    result: str | None = Field(default=None, description="eval/<experiment>/results/<run tag>.json: the signed evaluation result")


class VerdictResult(Result):
    run_id: str
    verdict: Literal["PROMOTE", "REJECT"]
    adapter_sha256: str
    report: str
    signed_at: str
    override: dict[str, Any] | None = Field(default=None, description="set when a PROMOTE overrides failed checks: the reason and the checks")


class WriteEvalFileResult(Result):
    path: str
    bytes: int


class ExportResult(Result):
    run_id: str
    exported: bool
    verdict: Literal["PROMOTE", "REJECT"] | None = None
    format: str | None = None
    target_runtime: str | None = None
    artifacts: list[str] = Field(default_factory=list)
    smoke_test: dict[str, Any] | None = None
    report: str | None = None
    evidence: str | None = None
    top_remediation: str | None = None
