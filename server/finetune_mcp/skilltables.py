"""Pydantic models for every skills/<skill>/tables/<table>.yaml; unknown keys are refused.

One section per skill. TABLES maps (skill, table) to the model that validates it; a table file
with no model here is itself an error, so nothing in skills/ goes unchecked.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


TABLES: dict[tuple[str, str], type[BaseModel]] = {}


def table(skill: str, name: str):
    def deco(cls):
        TABLES[(skill, name)] = cls
        return cls

    return deco


# --- dataset-curation ---

from pydantic import model_validator as _dc_model_validator  # noqa: E402  (section-local import)

DC_METHODS = ("sft-lora", "sft-qlora", "dpo", "orpo", "kto", "simpo", "grpo", "vlm-sft")
DC_FORMATS = ("messages", "text", "prompt-completion", "preference", "kto", "grpo", "vision")
DcMethod = Literal["sft-lora", "sft-qlora", "dpo", "orpo", "kto", "simpo", "grpo", "vlm-sft"]


class DcFormat(Strict):
    """One dataset format a method trains on."""

    methods: list[DcMethod]
    required_fields: list[str]
    optional_fields: list[str] = Field(default_factory=list)
    example: str = Field(description="one JSON line of this format")
    loss_on: str = Field(description="which tokens carry the loss by default")
    trainer_setting: str = Field(description="the TRL config value that gives that masking")
    anchor: str


class DcShape(Strict):
    """A record shape prepare_dataset recognises (common/convert.shape_of detects it)."""

    fields: list[str] = Field(min_length=1)
    origin: str = Field(description="the document that defines the shape")


class DcConversion(Strict):
    """A shape the tool rewrites into another shape or a format without losing anything."""

    id: str = Field(pattern=r"^[a-z0-9-]+$", description="one converter in common/convert.CONVERTERS")
    source: str = Field(description="the detected shape")
    target: str = Field(description="a format, or a shape another conversion takes on from")
    only_for: list[DcMethod] = Field(default_factory=list, description="methods it applies to (empty: every method the target fits)")
    how: str
    cite: str = Field(description="where the mapping rule comes from")
    trained: str | None = Field(None, description="which of the converted turns carry loss, when that is worth saying")
    role_map: dict[str, str] = Field(default_factory=dict)


class DcRefusal(Strict):
    shapes: list[str] = Field(min_length=1)
    methods: list[DcMethod] = Field(default_factory=list, description="methods the rule is for (empty: all)")
    why: str
    choices: str = Field(description="what the user can do instead, named in the refusal")


@table("dataset-curation", "formats")
class DcFormatsTable(Strict):
    formats: dict[Literal["messages", "text", "prompt-completion", "preference", "kto", "grpo", "vision"], DcFormat]
    shapes: dict[str, DcShape]
    conversions: list[DcConversion]
    refusals: list[DcRefusal]
    reference_fields: list[str] = Field(description="GRPO: column names accepted as the reference answer, in order of preference")
    roles: list[str]

    @_dc_model_validator(mode="after")
    def _consistent(self):
        from finetune_mcp.common.convert import CONVERTERS

        ids = [c.id for c in self.conversions]
        if set(ids) != set(CONVERTERS) or len(ids) != len(set(ids)):
            raise ValueError(f"conversion ids must be the converters of common/convert.py, once each: {sorted(set(ids) ^ set(CONVERTERS))}")
        known = set(self.shapes) | set(self.formats)
        for c in self.conversions:
            if c.source not in self.shapes or c.target not in known:
                raise ValueError(f"conversion {c.id}: source {c.source!r} and target {c.target!r} must be shapes (or a format)")
        for r in self.refusals:
            unknown = [s for s in r.shapes if s not in self.shapes]
            if unknown:
                raise ValueError(f"refusal of {unknown} names shapes the shapes table lacks")
        return self


class DcShareRule(Strict):
    warn_above: float = Field(ge=0, le=1, description="share of records above which a warning is raised (0: any)")
    fail_above: float = Field(ge=0, le=1, description="share of records above which the phase fails")
    action: Literal["drop", "keep", "truncate"]
    why: str


@table("dataset-curation", "validation")
class DcValidationTable(Strict):
    always_fail: dict[str, str] = Field(description="problem code -> why one occurrence fails the phase")
    warn_only: dict[str, str] = Field(default_factory=dict, description="problem code -> why it is reported but never fails")
    share_rules: dict[str, DcShareRule]
    min_examples: int = Field(ge=1)
    min_eval_examples: int = Field(ge=0)
    decoded_samples: dict[Literal["min", "max"], int]
    listed_per_code: int = Field(ge=1, description="problems listed one by one per code; the rest are counted")


class DcMetric(Strict):
    warn_below: float | None = None
    fail_below: float | None = None
    warn_above: float | None = None
    fail_above: float | None = None
    why: str


class DcMinHash(Strict):
    num_perm: int = Field(ge=16, le=512)
    bands: int = Field(ge=1)
    shingle_words: int = Field(ge=1, le=10)
    jaccard: float = Field(gt=0, le=1)

    @_dc_model_validator(mode="after")
    def _bands_divide(self):
        if self.num_perm % self.bands:
            raise ValueError(f"num_perm {self.num_perm} must be a multiple of bands {self.bands}")
        return self


class DcProvenanceRule(Strict):
    on_fail: Literal["error", "warning"] = Field(description="what a reading past a fail bound becomes")
    why: str


class DcProvenance(Strict):
    default: Literal["synthetic", "curated", "mixed"] = Field(description="applied when neither the brief nor the data says")
    synthetic: DcProvenanceRule
    mixed: DcProvenanceRule
    curated: DcProvenanceRule


@table("dataset-curation", "collapse")
class DcCollapseTable(Strict):
    sample_words: int = Field(ge=100, description="distinct-n is measured on this many words of trained text, so sets of any size compare")
    opening_words: int = Field(ge=1, le=10)
    min_records: int = Field(ge=2, description="below this the metrics are reported but cannot fail the phase")
    minhash: DcMinHash
    metrics: dict[Literal["distinct-1", "distinct-2", "near-duplicate-share", "length-cv", "top-opening-share"], DcMetric]
    provenance: DcProvenance


class DcCardField(Strict):
    key: str
    title: str
    what: str


class DcChecklistItem(Strict):
    id: str
    item: str
    verified_by: str


@table("dataset-curation", "card")
class DcCardTable(Strict):
    card_fields: list[DcCardField] = Field(min_length=6, max_length=6)
    exit_checklist: list[DcChecklistItem]


# --- spark-preflight ---

from pydantic import model_validator as _sp_model_validator  # noqa: E402  (section-local import)

PREFLIGHT_CHECK_IDS = ("G1", "G2", "G3", "G4", "G5", "G6", "G7", "N1", "N2", "N3", "N4", "N5", "N6", "N7", "C1", "T1")
PreflightPlatform = Literal["dgx-spark", "generic-nvidia", "cpu"]


class PreflightThresholds(Strict):
    """The limits one check applies; each check sets only the fields it uses."""

    min_cuda: float | None = Field(default=None, description="lowest CUDA major.minor accepted (driver's or torch's build)")
    min_ptxas: float | None = Field(default=None, description="lowest ptxas release Triton may use for the device")
    headroom_fraction: float | None = Field(default=None, gt=0, le=1, description="share of the available memory an estimate may fill before a warning")
    min_free_gb: float | None = Field(default=None, ge=0, description="free space below which a run cannot even write checkpoints")
    export_slack_gb: float | None = Field(default=None, ge=0, description="free space wanted beyond checkpoints + a merged 16-bit export")
    max_temp_c: float | None = Field(default=None, description="temperature that warns, when NVML gives no slowdown threshold")
    slowdown_margin_c: float | None = Field(default=None, ge=0, description="warn this many degrees below NVML's slowdown threshold")
    throttle_reasons: list[str] | None = Field(default=None, description="NVML clock-event reasons that warn when active")
    required_imports: list[str] | None = Field(default=None, description="modules without which no backend can train")
    backend_imports: list[str] | None = Field(default=None, description="modules of the Unsloth fast path (TRL+PEFT remains without them)")
    method_imports: dict[str, list[str]] | None = Field(default=None, description="modules a method needs on top (method id -> modules)")
    min_capability: float | None = Field(default=None, description="lowest compute capability with native bf16")
    gpu_only_methods: list[str] | None = Field(default=None, description="methods whose kernels need CUDA")


class PreflightCheck(Strict):
    id: Literal["G1", "G2", "G3", "G4", "G5", "G6", "G7", "N1", "N2", "N3", "N4", "N5", "N6", "N7", "C1", "T1"]
    name: str
    platforms: list[PreflightPlatform] = Field(min_length=1)
    what: str = Field(description="one line: what is observed and compared")
    thresholds: PreflightThresholds = Field(default_factory=PreflightThresholds)
    remediation: str = Field(description="the next step when the check does not pass")
    remedies: dict[str, str] = Field(default_factory=dict, description="cause code -> a more specific next step")
    cite: str = Field(description="anchor of this check's section in SKILL.md")


@table("spark-preflight", "checks")
class PreflightChecks(Strict):
    cuda_min_driver: dict[str, int] = Field(description="CUDA major (as text) -> lowest Linux driver branch (CUDA Compatibility, minor version compatibility table)")
    spark_gpu_names: list[str] = Field(min_length=1, description="NVML device-name substrings that identify a DGX Spark GPU")
    spark_capability: list[int] = Field(min_length=2, max_length=2, description="[major, minor] compute capability of a DGX Spark GPU")
    checks: list[PreflightCheck]

    @_sp_model_validator(mode="after")
    def _every_id_once(self):
        ids = [c.id for c in self.checks]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        missing = [i for i in PREFLIGHT_CHECK_IDS if i not in ids]
        if dupes or missing:
            raise ValueError(f"each check id appears exactly once (duplicated: {dupes}, missing: {missing})")
        return self

    def check(self, check_id: str) -> PreflightCheck:
        return next(c for c in self.checks if c.id == check_id)


class MemoryMethod(Strict):
    weights: Literal["16bit", "nf4"] = Field(description="how the frozen base weights are held on a GPU")
    sequences_per_example: int = Field(ge=1, description="sequences one example puts through forward+backward (chosen+rejected = 2)")
    kv_cache_sequences: int = Field(default=0, ge=0, description="sequences generated per prompt whose KV cache is held (GRPO)")
    note: str


class MemoryDefaults(Strict):
    lora_r: int = Field(gt=0)
    lora_targets: list[Literal["q", "k", "v", "o", "gate", "up", "down"]] = Field(min_length=1)
    micro_batch_size: int = Field(gt=0)
    gradient_checkpointing_gpu: bool
    gradient_checkpointing_cpu: bool


@table("spark-preflight", "memory")
class MemoryTable(Strict):
    bytes_per_param: dict[Literal["fp32", "16bit", "nf4"], float]
    nf4_constant_bits_per_param: float = Field(ge=0, description="quantisation constants per 4-bit weight after double quantisation")
    trainable_bytes_per_param: float = Field(gt=0, description="fp32 adapter weight + fp32 gradient + AdamW's two fp32 moments")
    activation_bytes_per_value: dict[Literal["fp32", "16bit"], float]
    logits_bytes_per_token_vocab: dict[Literal["fp32", "16bit"], float]
    overhead_gb: dict[Literal["cuda", "cpu", "cpu_unsloth"], float]
    attention_score_copies: dict[Literal["cuda", "cpu"], float] = Field(
        description="s x s attention matrices kept per head for backward: 0 with fused SDPA kernels, scores + probabilities with the math kernel")
    defaults: MemoryDefaults
    methods: dict[Literal["sft-lora", "sft-qlora", "dpo", "orpo", "kto", "simpo", "grpo", "vlm-sft"], MemoryMethod]

    @_sp_model_validator(mode="after")
    def _every_method(self):
        missing = {"sft-lora", "sft-qlora", "dpo", "orpo", "kto", "simpo", "grpo", "vlm-sft"} - set(self.methods)
        if missing:
            raise ValueError(f"methods lacks {sorted(missing)}")
        return self



# --- dgx-spark-ops ---

import re as _re  # noqa: E402  (section-local import keeps the sections independent)

from pydantic import field_validator as _field_validator, model_validator as _model_validator  # noqa: E402

# The preflight check ids (spark-preflight's checks table); triage names one of them.
OpsCheckId = Literal["G1", "G2", "G3", "G4", "G5", "G6", "G7", "N1", "N2", "N3", "N4", "N5", "N6", "N7", "C1"]


def _compiles(patterns: list[str], flags: int = 0) -> list[str]:
    for p in patterns:
        try:
            _re.compile(p, flags)
        except _re.error as e:
            raise ValueError(f"pattern {p!r} is not a valid regex: {e}") from None
    return patterns


class SignalCheck(Strict):
    generic: OpsCheckId | None = Field(None, description="check to re-run on generic-nvidia or cpu")
    spark: OpsCheckId | None = Field(None, description="check to re-run on dgx-spark (a G-number)")


RecordsRule = Literal["nonfinite-loss", "nonfinite-grad-norm", "nonfinite-metric", "loss-zero-grad-nan", "loss-spike", "loss-rise",
                      "loss-magnitude", "kl-blowup", "grad-norm-explosion", "loss-scale-collapse", "loss-scale-halving", "flat-loss",
                      "discriminator-won", "critic-blowup"]
# The records rules that read the curve's shape, not a value that cannot be a loss (NaN/inf, a loss scale at its floor).
CURVE_RULES = frozenset({"loss-spike", "loss-rise", "flat-loss", "loss-magnitude", "kl-blowup", "grad-norm-explosion",
                         "discriminator-won", "critic-blowup"})
FailureClass = Literal["environment", "divergence", "oom", "none"]


class FailureSignal(Strict):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    failure_class: FailureClass = Field(alias="class")
    priority: int = Field(ge=0, le=100, description="the highest-priority matching signal decides the class")
    patterns: list[str] = Field(default_factory=list, description="regexes searched in each log line")
    ignore_case: bool = False
    unless: list[str] = Field(default_factory=list, description="a matching line that also matches one of these is not this signal")
    unless_log: list[str] = Field(default_factory=list, description="no line of a log that has a line matching one of these "
                                                                    "is this signal (a launcher that prints its words about "
                                                                    "something else)")
    exit_codes: list[int] = Field(default_factory=list, description="exit statuses that show this signal")
    exit_signals: list[int] = Field(default_factory=list, description="terminating signals that show this signal")
    records_rule: RecordsRule | None = None
    explained_by_stop: bool = Field(False, description="a stop we asked for explains it (a SIGKILL from stop_run)")
    before_run: bool = Field(False, description="a command before the program (an install, a build, a shell that cannot start "
                                                "one) failed: a notebook cell whose traceback began after it ran on past it")
    records_decide: bool = Field(False, description="a line the metric readers took as a record is left to the records "
                                                    "rules, which know its columns' names")
    warning_only: bool = Field(False, description="a warning, not an event: in a log that shows no failure, set aside once the "
                                                  "program printed cell_went_on_lines non-blank lines after its last hit")
    stop_request: bool = Field(False, description="present whenever stop_run asked the run to end")
    check: SignalCheck | None = None
    none_kind: Literal["healthy", "stopped"] | None = None
    confirm: str | None = Field(None, description="the evidence that would settle it when this signal decides alone")
    note: str
    source: list[str] = Field(min_length=1)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @_model_validator(mode="after")
    def _consistent(self):
        _compiles(self.patterns, _re.I if self.ignore_case else 0)
        _compiles(self.unless, _re.I if self.ignore_case else 0)
        _compiles(self.unless_log, 0)
        if not (self.patterns or self.exit_codes or self.exit_signals or self.records_rule or self.stop_request):
            raise ValueError(f"signal {self.id!r} has nothing to detect it: give patterns, exit_codes/exit_signals, records_rule or stop_request")
        if (self.failure_class == "none") != (self.none_kind is not None):
            raise ValueError(f"signal {self.id!r}: none_kind is required for class none and only for it")
        if self.check is not None and self.failure_class != "environment":
            raise ValueError(f"signal {self.id!r}: only environment signals name a preflight check")
        return self


class MetricKeys(Strict):
    """Which logged keys (normalised: lower case, separators as spaces) carry which metric."""

    loss: list[str] = Field(min_length=1, description="keys of the training loss")
    eval_loss: list[str] = Field(min_length=1, description="keys of a validation loss (checked for NaN only)")
    grad_norm: list[str] = Field(min_length=1)
    lr: list[str] = Field(min_length=1)
    step: list[str] = Field(min_length=1)
    loss_scale: list[str] = Field(min_length=1)
    epoch: list[str] = Field(default_factory=list, description="keys of the epoch counter (a run logged again from the start goes back)")
    run_end: list[str] = Field(default_factory=list, description="keys only an end-of-training summary prints (one train() call ended)")

    @_model_validator(mode="after")
    def _disjoint(self):
        seen: dict[str, str] = {}
        for field in type(self).model_fields:  # every field is a list of keys
            for k in getattr(self, field):
                if k != k.strip().lower() or "_" in k or "/" in k:
                    raise ValueError(f"metric key {k!r} must be written normalised (lower case, spaces for _ / - .)")
                if k in seen:
                    raise ValueError(f"metric key {k!r} is listed under both {seen[k]} and {field}")
                seen[k] = field
        return self


class RecordRules(Strict):
    spike_factor: float = Field(gt=1, description="a loss above this x the rolling median is a spike")
    spike_min_history: int = Field(ge=1)
    spike_window: int = Field(ge=1)
    spike_abs_min: float = Field(0.0, ge=0, description="a spike must rise at least this much above the median (print noise near zero)")
    spike_recover_factor: float = Field(0.0, ge=0, description="a spike the loss comes back under this x the median from is one bad batch (0: never)")
    spike_recover_logs: int = Field(1, ge=1, description="... within this many logs")
    spike_settled_below: float = Field(0.0, ge=0, lt=1, description="a lasting spike does not count if the curve ends "
                                       "at or below this share of its first value: it learned again (0: always counts)")
    rise_window: int = Field(1, ge=1, description="a long curve is read for a rise by its rolling median over this many values")
    rise_smooth_after: int = Field(10**9, ge=1, description="a curve of at least this many values is a long one")
    went_on_records: int = Field(0, ge=0, description="metric records logged after the last error line that show the run went on (0: never)")
    cell_went_on_lines: int = Field(3, ge=1, description="non-blank lines a notebook printed after a later cell's error "
                                                         "(the cells after it ran) for the notebook to have gone on past it")
    went_on_lines: int = Field(0, ge=0, description="lines printed after the last failure line, when every failure line is a logger's "
                                                    "level line (no traceback, no exception), that show the program went on (0: never)")
    stop_echo_lines: int = Field(20, ge=0, description="a traceback starting within this many lines after a Ctrl-C is the stop's echo (workers, shutdown), not a failure of its own")
    rise_factor: float = Field(gt=1, description="the last loss at this x the minimum before it is a divergence")
    rl_rise_factor: float = Field(20.0, gt=1, description="rise_factor for a reinforcement-learning trainer's losses, which follow its returns")
    rise_abs: float = Field(0.0, ge=0, description="a long curve whose held level ends above its first value and this "
                            "much above its lowest is a divergence too, whatever the ratio (0: never)")
    rise_abs_first_max: float = Field(15.0, gt=0, description="... for a curve whose first value is at most this (a "
                                      "cross-entropy, counted in nats)")
    rise_min_history: int = Field(ge=1, description="losses needed before the minimum counts")
    rise_back_to: float = Field(gt=0, description="and the last loss is at least this fraction of the first: it climbed back, not a converged run's noise")
    flat_identical_run: int = Field(ge=2)
    flat_repeat_window: int = Field(ge=2)
    zero_loss_run: int = Field(ge=2, description="this many logged losses of exactly 0 in a row: nothing is trained")
    zero_print_floor: float = Field(0.0, ge=0, description="a run whose loss leaves 0 again for a value above 0 and at "
                                                          "most this prints its zeros rounded (0.000000 between 0.000001s)")
    flat_superseded_fall: float = Field(0.0, ge=0, lt=1, description="a flat loss of an earlier run is set aside when the "
                                                                  "log's last run fell to this share of its first loss or lower "
                                                                  "(0: never)")
    flat_converged_factor: float = Field(0.0, ge=0, description="a loss flat at the lowest value of its run, this x below "
                                         "its highest, is a converged run, not a stuck one (0: never)")
    flat_converged_near: float = Field(0.0, ge=0, lt=1, description="'at the lowest value' within this share of the value "
                                       "above it (a plateau's print noise around its floor)")
    flat_still_logs: int = Field(0, ge=0, description="a run whose loss stays within flat_still_band of itself for this "
                                 "many logs, from its first, and makes no progress is stuck (0: never)")
    flat_still_band: float = Field(0.0, ge=0, lt=1, description="... the band, as a share of the run's lowest loss")
    chance_logs: int = Field(0, ge=0, description="a run whose last this many losses sit at ln k, a uniform guess over k "
                             "classes, ends stuck at chance (0: never)")
    chance_classes: int = Field(10, ge=2, description="... for k up to this many classes")
    chance_near: float = Field(0.001, ge=0, lt=0.1, description="... each within this share of ln k")
    flat_window_spread: int = Field(0, ge=0, description="a recurring window counts only if its values are identical or "
                                    "span at least this many units of their last printed digit (not a plateau's rounding noise)")
    grad_norm_max: float = Field(gt=0)
    loss_scale_floor: float = Field(gt=0, description="a dynamic loss scale cut to this or below has collapsed")
    scale_halving_run: int = Field(3, ge=2, description="this many halvings of the loss scale in a row, once settled, is fp16 overflow")
    scale_settled_logs: int = Field(2, ge=1, description="logged scales without a cut before a halving run counts (not the scaler's start-up search)")
    kill_memory_fraction: float = Field(0.5, gt=0, le=1, description="a kill with memory in use below this fraction of the limit is not evidence of OOM")
    loss_abs_max: float = Field(1e8, gt=0, description="a logged loss of this size or more, either sign, is broken numbers")
    huge_fall_factor: float = Field(100.0, gt=1, description="a loss that starts at loss_abs_max or more and whose last value is "
                                                              "this many times smaller was on a scale of its own, not broken")
    loss_clamp: float = Field(0.0, ge=0, description="a loss exactly this value after full-precision prints of it is at a "
                                                     "library's clamp (BCELoss's 100): every prediction saturated; 0: off")
    kl_max: float = Field(1.0, gt=0, description="a logged KL at or above this, after small ones, is a policy collapse")
    kl_rise_factor: float = Field(20.0, gt=1, description="the KL before it was at most kl_max / this")
    rl_fit_explained_variance: float = Field(0.5, gt=0, le=1, description="a reinforcement-learning loss whose value head's "
                                             "explained variance has a median of this or more over its last rise_window records "
                                             "rose with the returns' spread: no rise or spike")
    kl_first_max: float = Field(10.0, gt=0, description="a PPO sampled KL (approx_kl) at or above this is a policy collapse "
                                "with no small one before it (the first update can blow up too)")
    adversarial_words: list[str] = Field(default_factory=list, description="words of a loss key that is one side of a GAN's game: no rise/spike rule")
    discriminator_words: list[str] = Field(default_factory=list, description="... of those, the words of the discriminator's side "
                                           "(the others name the generator's)")
    game_window: int = Field(10, ge=2, description="discriminator-won compares the median of each side's first and last this many values")
    game_d_zero: float = Field(0.01, gt=0, description="a discriminator loss whose last values' median is this or less (after a "
                               "first median at least 10x it) has won the game")
    game_g_rise: float = Field(2.5, gt=1, description="... while a generator loss's last median is this many times its first")
    game_critic_rise: float = Field(100.0, gt=1, description="critic-blowup: a WGAN critic's loss (negative among its first "
                                    "game_window values) whose last median is positive and this many times its first values' largest magnitude")
    nonfinite_ignore: list[str] = Field(default_factory=list, description="words of a metric key whose NaN is not the run's numbers (means over nothing yet, counts, timers)")
    nonfinite_recovered_logs: int = Field(0, ge=0, description="a metric printed finite this many times after its last NaN/inf had a transient, not a divergence (0: never)")


class FallbackRule(Strict):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    failure_class: Literal["environment", "divergence", "oom"] = Field(alias="class")
    match: str = Field(description="regex on the exception line (the last 'Name: message' line)")
    frames: str | None = Field(None, description="regex that must also match the log's last lines (the innermost frames "
                                                 "and their code) for the rule to apply")
    why: str
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @_field_validator("match", "frames")
    @classmethod
    def _valid(cls, v):
        return v if v is None else _compiles([v])[0]


# The log levels a failure_levels pattern names; triage looks for a level line only where one of them is.
LEVEL_WORDS = ("ERROR", "FATAL", "CRITICAL")


@table("dgx-spark-ops", "failure-signals")
class FailureSignalsTable(Strict):
    signals: list[FailureSignal] = Field(min_length=1)
    records: RecordRules
    metric_keys: MetricKeys
    failure_markers: list[str] = Field(min_length=1, description="lines that show the run failed, whatever the cause")
    finished_markers: list[str] = Field(default_factory=list, description="lines a trainer prints when training ran to its end: an error before one did not stop the run")
    failure_levels: list[str] = Field(default_factory=list, description="failure markers matched on the raw line, before prefixes (timestamps, log levels) are removed: a logger's ERROR / FATAL line")
    launch_markers: list[str] = Field(default_factory=list, description="lines a shell prints when it starts a new command "
                                      "(PowerShell's NativeCommandError header): failure lines before one belong to an earlier command")
    benign_lines: list[str] = Field(default_factory=list, description="lines a marker or a level would take for a failure line "
                                    "that tools print when nothing failed (a scheduler's clean-up after the job's last line)")
    fallback: list[FallbackRule] = Field(min_length=1, description="the class of a failure no signal names, by exception type")
    cut_traceback: list[FallbackRule] = Field(default_factory=list, description="read first on the innermost frames when the excerpt stops inside a traceback")
    fallback_priority: int = Field(ge=0, le=100, description="the weight a fallback class carries against other signals")

    @_field_validator("failure_markers", "finished_markers", "failure_levels", "benign_lines", "launch_markers")
    @classmethod
    def _valid(cls, v):
        return _compiles(v)

    @_field_validator("failure_levels")
    @classmethod
    def _level_word(cls, v):
        # triage tries these only on lines holding a level word
        for p in v:
            if not any(w in p for w in LEVEL_WORDS):
                raise ValueError(f"failure_levels pattern {p!r} names no level: it must hold one of {', '.join(LEVEL_WORDS)}")
        return v

    @_model_validator(mode="after")
    def _unique(self):
        seen: set[str] = set()
        for s in self.signals:
            if s.id in seen:
                raise ValueError(f"signal id {s.id!r} appears twice")
            seen.add(s.id)
        rules = [s.records_rule for s in self.signals if s.records_rule]
        if len(rules) != len(set(rules)):
            raise ValueError("each records_rule may belong to one signal only")
        return self


LADDER_RUNGS = ("flush", "reduce-batch-or-seq", "downgrade-method")
LADDER_ESCALATION = ("smaller-model", "multi-node")


class LadderStep(Strict):
    id: str
    action: str
    how: list[str] = Field(min_length=1)
    why: str
    source: list[str] = Field(min_length=1)


@table("dgx-spark-ops", "oom-ladder")
class OomLadderTable(Strict):
    name: Literal["spark-memory-thermal-ops"]
    rungs: list[LadderStep]
    escalation: list[LadderStep]
    method_downgrade: dict[Literal["full", "bf16-lora", "qlora"], Literal["bf16-lora", "qlora"]]

    @_model_validator(mode="after")
    def _fixed_order(self):
        # The order is the seed's, not a tunable: a table that reorders it (batch first) is refused.
        got = tuple(r.id for r in self.rungs)
        if got != LADDER_RUNGS:
            raise ValueError(f"rungs must be exactly {list(LADDER_RUNGS)} in this order, got {list(got)}")
        got = tuple(r.id for r in self.escalation)
        if got != LADDER_ESCALATION:
            raise ValueError(f"escalation must be exactly {list(LADDER_ESCALATION)} in this order, got {list(got)}")
        return self


# --- lora-qlora-recipes / preference-optimization / grpo-rlvr-training / vision-sft ---

from pydantic import model_validator as _recipe_validator  # noqa: E402  (section-local, as above)

RecipeMethod = Literal["sft-lora", "sft-qlora", "dpo", "orpo", "kto", "simpo", "grpo", "vlm-sft"]
RecipePlatform = Literal["cpu", "generic-nvidia", "dgx-spark"]
# Where a resolved value lands in train.py: the model load, the 4-bit quantization config (TRL only),
# the adapter (get_peft_model / LoraConfig), the trainer's *Config, or the script itself.
CallName = Literal["load", "quantization", "peft", "trainer", "script"]
_ANCHOR = r"^[a-z0-9-]+#[A-Za-z0-9_.-]+$"


class RecipeParam(Strict):
    """One knob of a recipe: its value, the settled range around it, and the section that explains it."""

    default: Any = Field(description="the value the recipe uses")
    kind: Literal["float", "int", "bool", "str", "list", "dict"]
    range: list[float] | None = Field(None, min_length=2, max_length=2, description="settled range [low, high]")
    choices: list[Any] | None = None
    nullable: bool = Field(False, description="null is an accepted value")
    cite: str = Field(pattern=_ANCHOR)
    note: str | None = None


class RecipeTrainer(Strict):
    module: str = Field(description="import path of the trainer, e.g. trl or trl.experimental.cpo")
    config: str = Field(description="the *Config class")
    trainer: str = Field(description="the *Trainer class")
    fixed: dict[str, Any] = Field(default_factory=dict, description="trainer-config arguments this method always sets")


class RecipeSignal(Strict):
    """The logged metric that shows the method learning, and which way it should move."""

    metric: str
    direction: Literal["falls", "rises"]


class Recipe(Strict):
    label: str
    cite: str = Field(pattern=_ANCHOR)
    inherits: str | None = Field(None, pattern=r"^[a-z0-9-]+/[a-z0-9-]+$", description="skill/method whose params this recipe starts from")
    drops: list[str] = Field(default_factory=list, description="inherited params that do not apply to this method")
    dataset_formats: list[str] = Field(min_length=1)
    trainer: RecipeTrainer
    signal: RecipeSignal
    params: dict[str, RecipeParam]

    @_recipe_validator(mode="after")
    def _ranges_hold_defaults(self):
        for k, p in self.params.items():
            if p.range and p.range[0] > p.range[1]:
                raise ValueError(f"param {k!r}: range low {p.range[0]} is above high {p.range[1]}")
            if p.choices is not None and p.default is not None and p.kind != "list" and p.default not in p.choices:
                raise ValueError(f"param {k!r}: default {p.default!r} is not one of its choices {p.choices}")
        return self


class RecipesTable(Strict):
    recipes: dict[RecipeMethod, Recipe] = Field(min_length=1)


for _skill in ("lora-qlora-recipes", "preference-optimization", "grpo-rlvr-training", "vision-sft"):
    TABLES[(_skill, "recipes")] = RecipesTable


class RuleWhen(Strict):
    """Conditions on the run's context; a list means any of its values. All given conditions must hold."""

    platform: list[RecipePlatform] | None = None
    method: list[RecipeMethod] | None = None
    backend: list[Literal["unsloth", "trl"]] | None = None
    model: list[str] | None = Field(None, description="base model names as the brief writes them")
    bf16: bool | None = Field(None, description="the preflight observed bf16 support")
    bitsandbytes: bool | None = Field(None, description="the preflight observed bitsandbytes importable")
    generation_template: bool | None = Field(None, description="the model's chat template marks assistant turns with {% generation %}")
    format: list[str] | None = Field(None, description="dataset formats (dataset-curation's names)")


class Rule(Strict):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    kind: Literal["platform", "model", "precision"]
    when: RuleWhen
    set: dict[str, Any] = Field(min_length=1, description="recipe params this rule sets (only those the method's recipe has)")
    why: str
    cite: str = Field(pattern=_ANCHOR)


class BudgetModel(Strict):
    """How generate_config fits a run into the brief's memory budget. The estimate itself is the
    preflight's (spark-preflight#memory-estimate), so both phases judge a config the same way."""

    headroom: float = Field(gt=0, le=1, description="share of the budget the estimate may fill")
    order: list[Literal["gradient-checkpointing", "halve-batch", "qlora"]] = Field(min_length=1)
    qlora_methods: list[RecipeMethod] = Field(description="methods whose 16-bit run may fall back to 4-bit weights")
    qlora_allowed_words: list[str] = Field(description="phrases in the brief's Memory Budget or Chosen Method sections that allow a QLoRA fallback")
    cite: str = Field(pattern=_ANCHOR)


class RulesTable(Strict):
    rules: list[Rule] = Field(min_length=1)
    budget: BudgetModel


TABLES[("lora-qlora-recipes", "rules")] = RulesTable


class BackendsTable(Strict):
    """Which methods Unsloth trains on which platform; everything else takes the TRL escape hatch."""

    unsloth_supports: dict[RecipePlatform, list[RecipeMethod]]
    preferred: Literal["unsloth", "trl"]
    cite: str = Field(pattern=_ANCHOR)
    note: str


TABLES[("lora-qlora-recipes", "backends")] = BackendsTable


class MapValue(Strict):
    value: Any
    becomes: Any


class MapTarget(Strict):
    call: CallName
    arg: str = Field(description="the keyword argument of that call")
    values: list[MapValue] = Field(default_factory=list, description="value translations; values not listed pass unchanged")
    methods: list[RecipeMethod] | None = Field(None, description="only for these methods")


class MappingRow(Strict):
    key: str = Field(description="the recipe param")
    unsloth: list[MapTarget] = Field(default_factory=list, description="where the Unsloth template passes it (empty: nowhere)")
    trl: list[MapTarget] = Field(default_factory=list, description="where the TRL + PEFT + transformers template passes it")
    unsloth_api: str = Field(description="the Unsloth argument as its docs write it")
    trl_api: str = Field(description="the TRL / PEFT / transformers equivalent")
    note: str | None = None


class MappingTable(Strict):
    """Every recipe param that the two templates pass differently; any other param goes to the trainer
    config under its own name in both."""

    rows: list[MappingRow] = Field(min_length=1)
    cite: str = Field(pattern=_ANCHOR)

    @_recipe_validator(mode="after")
    def _unique(self):
        keys = [r.key for r in self.rows]
        dup = {k for k in keys if keys.count(k) > 1}
        if dup:
            raise ValueError(f"mapping rows repeat keys {sorted(dup)}: one row per param")
        return self


TABLES[("lora-qlora-recipes", "unsloth-trl-mapping")] = MappingTable


class RewardFn(Strict):
    needs: list[str] = Field(default_factory=list, description="dataset columns the function reads")
    range: list[float] = Field(min_length=2, max_length=2)
    description: str
    cite: str = Field(pattern=_ANCHOR)


class RewardsTable(Strict):
    rewards: dict[str, RewardFn] = Field(min_length=1)


TABLES[("grpo-rlvr-training", "rewards")] = RewardsTable


# --- quantized-export ---

from pydantic import model_validator as _qe_model_validator  # noqa: E402  (section-local import)

_EXPORT_FORMATS = ("lora", "merged-16bit", "gguf-f16", "gguf-q8_0", "gguf-q4_k_m")
_EXPORT_RUNTIMES = ("transformers", "vllm", "llama.cpp", "ollama")


class ExportFormat(Strict):
    id: Literal["lora", "merged-16bit", "gguf-f16", "gguf-q8_0", "gguf-q4_k_m"]
    posture: Literal["lora", "merged"] = Field(description="adapter kept apart, or merged into the base weights")
    container: Literal["safetensors", "gguf"]
    lossless: bool = Field(description="true: the artifact computes exactly what was evaluated; the smoke test demands identical greedy outputs")
    max_tie_margin: float | None = Field(default=None, gt=0.0, description="16-bit downcasts: every token the artifact chooses is "
                                         "ranked by the float32 reference within this many nats of its own greedy choice")
    min_similarity: float | None = Field(default=None, ge=0.0, le=1.0, description="quantized formats: per-golden similarity floor")
    bits_per_weight: float | None = Field(default=None, gt=0)
    llama_ftype: str | None = Field(default=None, description="llama.cpp file type name for llama_model_quantize")
    trade_off: str
    cite: str = Field(description="SKILL.md anchor of the prose behind this row")

    @_qe_model_validator(mode="after")
    def _threshold(self):
        if self.lossless + (self.max_tie_margin is not None) + (self.min_similarity is not None) != 1:
            raise ValueError(f"{self.id}: name exactly one smoke criterion: lossless (identical outputs), max_tie_margin "
                             "(16-bit rounding) or min_similarity (quantization)")
        if (self.container == "gguf") != self.id.startswith("gguf-"):
            raise ValueError(f"{self.id}: container does not fit the id")
        return self


class ExportRuntime(Strict):
    id: Literal["transformers", "vllm", "llama.cpp", "ollama"]
    formats: list[Literal["lora", "merged-16bit", "gguf-f16", "gguf-q8_0", "gguf-q4_k_m"]] = Field(min_length=1)
    default_format: Literal["lora", "merged-16bit", "gguf-f16", "gguf-q8_0", "gguf-q4_k_m"]
    smoke_runtime: Literal["transformers", "vllm", "llama.cpp"]
    needs_gpu: bool
    modelfile: bool = Field(default=False, description="write an Ollama Modelfile beside the GGUF")
    note: str
    cite: str

    @_qe_model_validator(mode="after")
    def _default_listed(self):
        if self.default_format not in self.formats:
            raise ValueError(f"{self.id}: default_format {self.default_format!r} is not among its formats")
        return self


@table("quantized-export", "format-map")
class FormatMap(Strict):
    runtimes: list[ExportRuntime]
    formats: list[ExportFormat]
    sources: list[str] = Field(min_length=1)

    @_qe_model_validator(mode="after")
    def _complete(self):
        rt = [r.id for r in self.runtimes]
        fm = [f.id for f in self.formats]
        if sorted(rt) != sorted(_EXPORT_RUNTIMES) or len(set(rt)) != len(rt):
            raise ValueError(f"runtimes must list each of {', '.join(_EXPORT_RUNTIMES)} once")
        if sorted(fm) != sorted(_EXPORT_FORMATS) or len(set(fm)) != len(fm):
            raise ValueError(f"formats must list each of {', '.join(_EXPORT_FORMATS)} once")
        return self

    def runtime(self, rid: str) -> ExportRuntime:
        return next(r for r in self.runtimes if r.id == rid)

    def format(self, fid: str) -> ExportFormat:
        return next(f for f in self.formats if f.id == fid)
