"""Failure triage: classify a training log as environment / divergence / oom / none, order the divergence causes, climb the OOM ladder.

Everything it knows comes from two tables of skills/dgx-spark-ops (failure-signals, oom-ladder);
this module only applies them. Light on purpose: stdlib + yaml + the table models, no torch.
"""

from __future__ import annotations

import bisect
import json
import math
import re
import signal as _signal
import statistics
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

from finetune_mcp.errors import BadInput, NotFound

SKILL = "dgx-spark-ops"
# The seed fixes this order; triage stops at the first cause that explains the divergence.
CAUSE_ORDER = ("precision", "learning-rate", "packing")
MAX_EVIDENCE = 12


# --- tables ------------------------------------------------------------------------------------


def _table_path(name: str) -> Path:
    from finetune_mcp.shipped import shipped_dir

    return shipped_dir("skills") / SKILL / "tables" / f"{name}.yaml"


def _load_table(name: str, path: Path | None):
    # Only this skill's own table is read, validated by its registered model, so triage does not
    # depend on every other skill being valid at the moment.
    from pydantic import ValidationError

    from finetune_mcp.skills import explain
    from finetune_mcp.skilltables import TABLES

    path = path or _table_path(name)
    model = TABLES[(SKILL, name)]
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        return model.model_validate(raw)
    except FileNotFoundError:
        raise NotFound(f"skill table {path} is missing", where=str(path), fix="restore skills/dgx-spark-ops/tables") from None
    except yaml.YAMLError as e:
        raise BadInput(f"{path}: not valid YAML: {e}", where=str(path), fix="fix the YAML syntax") from None
    except ValidationError as e:
        raise BadInput(f"{path}: {explain(e, model)}", where=str(path), fix="correct the table entries named above") from None


@lru_cache(maxsize=8)
def _cached(name: str, path: str | None):
    return _load_table(name, Path(path) if path else None)


def load_signal_table(path: Path | None = None):
    """The validated failure-signals table (FailureSignalsTable)."""
    return _cached("failure-signals", str(path) if path else None)


def load_ladder_table(path: Path | None = None):
    """The validated oom-ladder table (OomLadderTable)."""
    return _cached("oom-ladder", str(path) if path else None)


class _Compiled:
    """The signal table turned into regexes once (multi-line mode, for whole-text scans)."""

    def __init__(self, table):
        self.table = table
        self.line_signals: list[tuple[Any, list[re.Pattern]]] = []
        for s in table.signals:
            if s.patterns:
                flags = re.M | (re.I if s.ignore_case else 0)
                self.line_signals.append((s, [re.compile(p, flags) for p in s.patterns]))
        self.markers = [re.compile(p, re.M) for p in table.unrecognised_markers]
        self.loss_res = [re.compile(p, re.M) for p in table.records.loss_patterns]
        self.grad_res = [re.compile(p, re.M) for p in table.records.grad_norm_patterns]
        self.by_rule = {s.records_rule: s for s in table.signals if s.records_rule}


class _Log:
    """One log: its lines (verbatim, 1-based) and a per-pattern scan that runs in C over the whole text.

    Searching the joined text once per pattern is far faster than calling every regex on every
    line of a big log; each hit is then confirmed on its own line, so a match can never span two.
    """

    def __init__(self, text: str):
        self.lines = _lines(text)
        self.text = "\n".join(self.lines)
        self.starts = [0]
        for ln in self.lines[:-1]:
            self.starts.append(self.starts[-1] + len(ln) + 1)

    def line_of(self, pos: int) -> int:
        return bisect.bisect_right(self.starts, pos) - 1

    def scan(self, pattern: re.Pattern) -> dict[int, re.Match]:
        """{0-based line index: the match on that line} for every line the pattern matches."""
        found: dict[int, re.Match] = {}
        pos = 0
        while pos <= len(self.text):
            m = pattern.search(self.text, pos)
            if m is None:
                break
            first = self.line_of(m.start())
            if "\n" not in m.group(0):
                # Inside one line a multi-line-mode match is a per-line match: ^/$ sit at the line's
                # ends and a look-around that peeks past them only ever sees "\n".
                found.setdefault(first, m)
            else:
                for i in range(first, self.line_of(m.end() - 1) + 1):
                    if i not in found:
                        lm = pattern.search(self.lines[i])
                        if lm:
                            found[i] = lm
            # Resume at the next line: any line not yet confirmed is searched again from its start.
            if first + 1 >= len(self.starts):
                break
            pos = self.starts[first + 1]
        return found


_COMPILED: dict[int, _Compiled] = {}


def _compiled(table) -> _Compiled:
    c = _COMPILED.get(id(table))
    if c is None or c.table is not table:
        c = _COMPILED[id(table)] = _Compiled(table)
    return c


# --- results -----------------------------------------------------------------------------------


@dataclass
class Classification:
    """What triage concluded about one log (or one list of progress records).

    evidence: (line number, line) pairs copied verbatim from the log, 1-based; for records, the
    record's position in the list and the record as JSON. signals: every signal id that matched,
    the deciding one first. check_id: the preflight check to re-run (environment only).
    healthy_or_unrecognised: for class none, "healthy", "unrecognised" (an error no signal
    explains) or "stopped" (a stop someone asked for).
    """

    failure_class: str
    reason: str
    evidence: list[tuple[int, str]] = field(default_factory=list)
    signals: list[str] = field(default_factory=list)
    check_id: str | None = None
    healthy_or_unrecognised: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["evidence"] = [{"line": n, "text": t} for n, t in self.evidence]
        return d


@dataclass
class _Hit:
    signal: Any
    lines: list[tuple[int, str]] = field(default_factory=list)
    detail: str = ""

    @property
    def first(self) -> int:
        return self.lines[0][0] if self.lines else 10**12


@dataclass
class _Point:
    where: int  # log line (1-based) or record position (1-based)
    text: str
    loss: float | None = None
    grad_norm: float | None = None
    has_loss: bool = False
    has_grad: bool = False


# --- numbers from logs and records -------------------------------------------------------------


def _num(s: str) -> float:
    s = s.strip().strip("'\"").lower()
    if s == "nan":
        return math.nan
    if s in ("inf", "+inf", "infinity"):
        return math.inf
    if s in ("-inf", "-infinity"):
        return -math.inf
    return float(s)


def _points_from_log(log: "_Log", comp: _Compiled) -> list[_Point]:
    # One value per line: the first pattern that matches it wins.
    def values(res):
        out: dict[int, float | None] = {}
        for r in res:
            for i, m in log.scan(r).items():
                if i not in out:
                    try:
                        out[i] = _num(m.group(1))
                    except ValueError:
                        out[i] = None
        return {i: v for i, v in out.items() if v is not None}

    losses, grads = values(comp.loss_res), values(comp.grad_res)
    pts = []
    for i in sorted(set(losses) | set(grads)):
        pts.append(_Point(i + 1, log.lines[i], losses.get(i), grads.get(i), i in losses, i in grads))
    return pts


def _record_value(v, i: int, key: str) -> float:
    if v is None:
        return math.nan
    try:
        return _num(v) if isinstance(v, str) else float(v)
    except (TypeError, ValueError):
        raise BadInput(f"progress record {i}: {key} {v!r} is not a number", where=f"record {i}.{key}", fix="log numbers (or null for NaN)") from None


def _points_from_records(records: Iterable[dict]) -> list[_Point]:
    pts = []
    for i, rec in enumerate(records, 1):
        if not isinstance(rec, dict):
            raise BadInput(f"progress record {i} is not an object: {rec!r}", where=f"record {i}", fix="pass dicts like {'step': 1, 'loss': 2.3}")
        text = json.dumps(rec, sort_keys=False, default=str)
        p = _Point(i, text)
        # ProgressRecord serialises a NaN/inf loss as null, so a present null is non-finite.
        if "loss" in rec:
            p.loss, p.has_loss = _record_value(rec["loss"], i, "loss"), True
        if "grad_norm" in rec:
            p.grad_norm, p.has_grad = _record_value(rec["grad_norm"], i, "grad_norm"), True
        pts.append(p)
    return pts


def _record_findings(points: list[_Point], comp: _Compiled) -> list[_Hit]:
    rules = comp.table.records
    hits: list[_Hit] = []

    def add(rule: str, pts: list[_Point], detail: str):
        sig = comp.by_rule.get(rule)
        if sig is not None and pts:
            hits.append(_Hit(sig, [(p.where, p.text) for p in pts], detail))

    bad_loss = [p for p in points if p.has_loss and not math.isfinite(p.loss)]
    add("nonfinite-loss", bad_loss, f"{len(bad_loss)} logged loss value(s) are NaN or infinite")
    bad_grad = [p for p in points if p.has_grad and not math.isfinite(p.grad_norm)]
    add("nonfinite-grad-norm", bad_grad, f"{len(bad_grad)} logged grad norm(s) are NaN or infinite")

    finite = [p for p in points if p.has_loss and math.isfinite(p.loss)]
    spikes, history = [], []
    for p in finite:
        window = history[-rules.spike_window:]
        if len(window) >= rules.spike_min_history:
            med = statistics.median(window)
            if med > 0 and p.loss > rules.spike_factor * med:
                spikes.append((p, med))
        history.append(p.loss)
    if spikes:
        p, med = spikes[0]
        add("loss-spike", [s for s, _ in spikes], f"loss {p.loss:g} at line/record {p.where} is {p.loss / med:.0f}x the running median {med:g}")

    big = [p for p in points if p.has_grad and math.isfinite(p.grad_norm) and p.grad_norm >= rules.grad_norm_max]
    if big:
        add("grad-norm-explosion", big, f"grad norm reached {max(p.grad_norm for p in big):.3g} (limit {rules.grad_norm_max:g})")

    flat = _flat(finite, rules.flat_identical_run, rules.flat_repeat_window)
    if flat:
        add("flat-loss", flat[0], flat[1])
    return hits


def _flat(finite: list[_Point], run_len: int, window: int) -> tuple[list[_Point], str] | None:
    vals = [p.loss for p in finite]
    start = 0
    for i in range(1, len(vals) + 1):
        if i == len(vals) or vals[i] != vals[start]:
            if i - start >= run_len:
                return finite[start:i], f"the loss stays at exactly {vals[start]:g} for {i - start} consecutive logs"
            start = i
    seen: dict[tuple[float, ...], int] = {}
    for i in range(len(vals) - window + 1):
        key = tuple(vals[i:i + window])
        j = seen.get(key)
        if j is not None and i >= j + window:
            return finite[j:j + window] + finite[i:i + window], (
                f"the same {window} losses recur exactly (from line/record {finite[j].where} and again from {finite[i].where}): the weights are not changing")
        seen.setdefault(key, i)
    return None


# --- classification ----------------------------------------------------------------------------


def _exit_fields(exit_info: dict | None) -> tuple[int | None, int | None, str | None]:
    if not exit_info:
        return None, None, None
    code = exit_info.get("returncode", exit_info.get("exit_code"))
    sig = exit_info.get("signal")
    if isinstance(sig, str):
        name = sig.strip().upper()
        if name.isdigit():
            sig = int(name)
        else:
            try:
                sig = _signal.Signals[name if name.startswith("SIG") else "SIG" + name].value
            except (KeyError, ValueError):
                raise BadInput(f"exit_info signal {exit_info.get('signal')!r} is not a signal name", where="exit_info.signal", fix="use e.g. 9 or 'SIGKILL'") from None
    if code is not None and not isinstance(code, int):
        raise BadInput(f"exit_info returncode {code!r} is not an integer", where="exit_info.returncode", fix="pass the process exit status")
    if code is not None and code < 0 and sig is None:
        sig = -code  # subprocess reports death by signal N as -N
    return code, sig, exit_info.get("stopped_by")


def _lines(text: str) -> list[str]:
    # Split on newlines only: tqdm redraws with bare \r inside one line, and editors count that way.
    out = text.split("\n")
    if out and out[-1] == "":
        out.pop()
    return [ln[:-1] if ln.endswith("\r") else ln for ln in out]


def _check_for(sig, platform: str | None) -> str | None:
    if sig.check is None:
        return None
    return sig.check.spark if platform == "dgx-spark" else sig.check.generic


def _pick(hits: list[_Hit]) -> _Hit:
    # Highest priority wins; on a tie the earliest line, since later errors are usually its cascade.
    return sorted(hits, key=lambda h: (-h.signal.priority, h.first))[0]


def _evidence(hits: list[_Hit]) -> list[tuple[int, str]]:
    seen: dict[int, str] = {}
    for h in hits:
        for n, t in h.lines:
            seen.setdefault(n, t)
    return sorted(seen.items())[:MAX_EVIDENCE]


def _decide(hits: list[_Hit], *, platform: str | None, markers: list[tuple[int, str]], n_points: int,
            exit_code: int | None, dropped: list[_Hit]) -> Classification:
    dropped_note = ""
    if dropped:
        ids = ", ".join(sorted({h.signal.id for h in dropped}))
        dropped_note = f" The SIGKILL signs ({ids}) were set aside: stop_run asked for this stop, so the kill is ours, not the OOM killer's."
    if not hits:
        if exit_code == 0 and markers:
            return Classification("none", f"No failure: the run exited 0; the {len(markers)} error-looking line(s) did not stop it." + dropped_note,
                                  [], [], None, "healthy")
        if markers or (exit_code not in (None, 0)):
            where = f"line {markers[0][0]}" if markers else f"exit status {exit_code}"
            return Classification(
                "none",
                f"The run failed ({where}) but no known failure signal matches: triage does not guess a class. Read the error lines shown." + dropped_note,
                markers[:MAX_EVIDENCE], [], None, "unrecognised")
        what = f"{n_points} logged loss values look healthy" if n_points else "no error lines and no failure signal"
        return Classification("none", f"No failure: {what}." + dropped_note, [], [], None, "healthy")

    win = _pick(hits)
    sig = win.signal
    ordered = [win] + sorted((h for h in hits if h is not win), key=lambda h: (-h.signal.priority, h.first))
    ids = [h.signal.id for h in ordered]
    same = [h for h in ordered if h.signal.failure_class == sig.failure_class]
    outranked = [h for h in ordered if h.signal.failure_class != sig.failure_class]
    where = f"line {win.first}" if win.lines else "the exit status"
    reason = f"{sig.note.strip()} ({sig.id}, {where})"
    if win.detail:
        reason += f": {win.detail}"
    reason += "."
    if outranked:
        names = ", ".join(f"{h.signal.id} ({h.signal.failure_class}, line {h.first})" if h.lines else f"{h.signal.id} ({h.signal.failure_class})" for h in outranked)
        reason += f" Also seen and outranked by it: {names}."
    reason += dropped_note

    if sig.failure_class == "none":
        return Classification("none", reason, _evidence(same), ids, None, sig.none_kind)
    check = _check_for(sig, platform) if sig.failure_class == "environment" else None
    if sig.failure_class == "environment" and check is None:
        reason += " No preflight check covers this; fix it where the note says, then relaunch."
    return Classification(sig.failure_class, reason, _evidence(same), ids, check, None)


def classify_text(text: str, *, exit_info: dict | None = None, platform: str | None = None, table=None) -> Classification:
    """Classify one training log.

    exit_info: {"returncode": int, "signal": int | "SIGKILL", "stopped_by": "stop_run" | None}
    (any key optional). platform: "dgx-spark" picks G-numbered checks, anything else the generic
    N-numbered ones.
    """
    if not isinstance(text, str):
        raise BadInput(f"log text must be a string, got {type(text).__name__}", fix="read the log file as text first")
    comp = _compiled(table or load_signal_table())
    log = _Log(text)
    code, sig_no, stopped_by = _exit_fields(exit_info)

    by_id: dict[str, _Hit] = {}
    for s, pats in comp.line_signals:
        matched: set[int] = set()
        for p in pats:
            matched |= set(log.scan(p))
        if matched:
            by_id[s.id] = _Hit(s, [(i + 1, log.lines[i]) for i in sorted(matched)])
    marked: set[int] = set()
    for m in comp.markers:
        marked |= set(log.scan(m))
    markers = [(i + 1, log.lines[i]) for i in sorted(marked)]

    for s in comp.table.signals:
        if (s.exit_codes and code in s.exit_codes) or (s.exit_signals and sig_no in s.exit_signals):
            detail = f"exit status {code}" if code is not None else f"signal {sig_no}"
            by_id.setdefault(s.id, _Hit(s)).detail = detail + (" with no stop request" if not stopped_by else "")
        if s.stop_request and stopped_by:
            by_id.setdefault(s.id, _Hit(s)).detail = f"stopped by {stopped_by}"

    points = _points_from_log(log, comp)
    for h in _record_findings(points, comp):
        have = by_id.get(h.signal.id)
        if have is None:
            by_id[h.signal.id] = h
        else:
            have.lines = sorted(set(have.lines) | set(h.lines))
            have.detail = have.detail or h.detail

    dropped = []
    if stopped_by:
        dropped = [h for h in by_id.values() if h.signal.explained_by_stop]
        by_id = {k: h for k, h in by_id.items() if not h.signal.explained_by_stop}
    return _decide(list(by_id.values()), platform=platform, markers=markers,
                   n_points=sum(p.has_loss for p in points), exit_code=code, dropped=dropped)


def classify_records(records: list[dict], *, table=None) -> Classification:
    """Divergence seen in progress records ({"step", "loss", ...}): NaN/inf, a spike, a flat loss.

    Evidence lines are (position in the list, the record as JSON). A loss of null counts as
    non-finite, as poll_progress writes NaN that way.
    """
    if not isinstance(records, list):
        raise BadInput("records must be a list of dicts", fix="pass poll_progress's records list")
    comp = _compiled(table or load_signal_table())
    points = _points_from_records(records)
    hits = _record_findings(points, comp)
    return _decide(hits, platform=None, markers=[], n_points=sum(p.has_loss for p in points), exit_code=None, dropped=[])


# --- divergence causes -------------------------------------------------------------------------


def _find(config: dict, *keys: str):
    """A config value by any of its spellings, at top level or one section down."""
    for k in keys:
        if k in config and config[k] is not None:
            return config[k]
    for v in config.values():
        if isinstance(v, dict):
            for k in keys:
                if k in v and v[k] is not None:
                    return v[k]
    return None


def _precision(config: dict) -> str | None:
    if _find(config, "fp16") is True:
        return "fp16"
    if _find(config, "bf16") is True:
        return "bf16"
    p = _find(config, "precision", "mixed_precision", "dtype", "torch_dtype")
    if isinstance(p, str):
        p = p.lower().replace("torch.", "")
        if p in ("fp16", "float16", "half", "16-mixed"):
            return "fp16"
        if p in ("bf16", "bfloat16", "bf16-mixed"):
            return "bf16"
        if p in ("fp32", "float32", "32", "no"):
            return "fp32"
    if _find(config, "fp16") is False and _find(config, "bf16") is False:
        return "fp32"
    return None


def _bf16_support(env_report: dict | None) -> tuple[bool | None, str]:
    """(supported?, how we know). None when the env-report does not say."""
    if not env_report:
        return None, "no env-report"
    for key in ("bf16_supported", "bf16"):
        v = env_report.get(key)
        if isinstance(v, bool):
            return v, f"env-report {key}={v}"
    checks = env_report.get("checks")
    items = checks.items() if isinstance(checks, dict) else ((c.get("id"), c) for c in checks or [] if isinstance(c, dict))
    for cid, c in items:
        if cid in ("G7", "N5") and isinstance(c, dict):
            status = str(c.get("status", "")).lower()
            if status in ("pass", "ok", "ready"):
                return True, f"preflight {cid} {status}"
            if status in ("fail", "failed", "blocked", "warn", "warning"):
                # A warning means bf16 is not solid there - the seed's silent-divergence case.
                return False, f"preflight {cid} {status}"
    if str(env_report.get("platform", "")).lower() == "cpu":
        return False, "platform cpu"
    return None, "env-report has no bf16 check"


def _range(spec) -> tuple[float, float] | None:
    if spec is None:
        return None
    if isinstance(spec, (list, tuple)) and len(spec) == 2:
        return float(spec[0]), float(spec[1])
    if isinstance(spec, dict):
        for lo, hi in (("min", "max"), ("lr_min", "lr_max"), ("low", "high")):
            if lo in spec and hi in spec:
                return float(spec[lo]), float(spec[hi])
        if "lr" in spec:
            return _range(spec["lr"])
        if "learning_rate" in spec:
            return _range(spec["learning_rate"])
    raise BadInput(f"learning-rate range {spec!r} is not [low, high] or {{min, max}}", where="method_ranges", fix="give each method a [low, high] pair from its method skill")


def _cause_precision(config: dict, env_report: dict | None) -> tuple[str, str]:
    prec = _precision(config)
    support, how = _bf16_support(env_report)
    if prec == "fp16":
        fix = "switch to bf16" if support else "use fp32 (this hardware has no solid bf16)" if support is False else "switch to bf16 if preflight shows support, else fp32"
        return "explains", f"the run trains in fp16 ({how}); fp16's narrow range is a known silent divergence source: {fix}"
    if prec == "bf16":
        if support is True:
            return "cleared", f"bf16 on hardware that supports it ({how})"
        if support is False:
            return "explains", f"bf16 requested but the hardware lacks solid bf16 support ({how}): use fp32 or move to bf16-capable hardware"
        return "not-checked", f"bf16 is requested but hardware support is unknown ({how}); run preflight to confirm"
    if prec == "fp32":
        return "cleared", "the run trains in fp32, so half-precision overflow cannot be the cause"
    return "not-checked", "the config names no precision (fp16/bf16/precision)"


def _cause_lr(config: dict, method_ranges: dict) -> tuple[str, str]:
    method = _find(config, "method", "method_id")
    lr = _find(config, "learning_rate", "lr")
    if method is None or lr is None:
        return "not-checked", "the config names no " + ("method" if method is None else "learning_rate")
    try:
        lr = float(lr)
    except (TypeError, ValueError):
        raise BadInput(f"learning_rate {lr!r} is not a number", where="config.learning_rate", fix="give the learning rate as a number") from None
    rng = _range(method_ranges.get(method))
    if rng is None:
        return "not-checked", f"no settled learning-rate range is known for method {method!r}"
    lo, hi = rng
    if lo <= lr <= hi:
        return "cleared", f"learning_rate {lr:g} is inside {method}'s settled range {lo:g}-{hi:g}"
    others = [m for m, spec in method_ranges.items() if m != method and (r := _range(spec)) and r[0] <= lr <= r[1]]
    ported = f"; it sits in the range of {', '.join(sorted(others))} - a rate ported from another method" if others else ""
    side = f"above the top ({lr / hi:.1f}x {hi:g})" if lr > hi else f"below the bottom ({lo:g}), which stalls the curve"
    return "explains", f"learning_rate {lr:g} is {side} of {method}'s settled range {lo:g}-{hi:g}{ported}"


def _cause_packing(config: dict, packing_check: Callable | None) -> tuple[str, str]:
    packing = _find(config, "packing", "sample_packing")
    if packing is False:
        return "cleared", "packing is off, so packed-sequence corruption cannot occur"
    if packing_check is None:
        return "not-checked", "no packing check was supplied: decode packed samples as dataset-curation does and check boundaries and masks"
    res = packing_check()
    if isinstance(res, dict):
        ok, why = res.get("ok"), res.get("why", "")
    elif isinstance(res, tuple) and len(res) == 2:
        ok, why = res
    else:
        ok, why = res, ""
    if not isinstance(ok, bool):
        raise BadInput(f"packing_check returned {res!r}", where="packing_check", fix="return True/False, (ok, why) or {'ok': bool, 'why': str}")
    if ok:
        return "cleared", why or "re-decoded packed samples keep their boundaries and loss masks"
    return "explains", why or "re-decoded packed samples show broken boundaries or masks"


def divergence_causes(config: dict, env_report: dict | None, method_ranges: dict,
                      packing_check: Callable[[], Any] | None) -> list[dict]:
    """The divergence causes in the seed's order, stopping at the first that explains it.

    Returns one {cause, verdict: explains|cleared|not-checked, why} per cause; the causes after
    the explaining one are not-checked. method_ranges maps a method id to its settled
    learning-rate range ([low, high] or {min, max}) from the method skill.
    packing_check() returns True/False, (ok, why) or {"ok", "why"}.
    """
    if not isinstance(config, dict):
        raise BadInput("config must be a mapping (the run's resolved config)", where="config", fix="pass config.yaml as a dict")
    out: list[dict] = []
    explained: str | None = None
    for cause in CAUSE_ORDER:
        if explained:
            out.append({"cause": cause, "verdict": "not-checked", "why": f"stopped at {explained}, which explains the divergence"})
            continue
        if cause == "precision":
            verdict, why = _cause_precision(config, env_report)
        elif cause == "learning-rate":
            verdict, why = _cause_lr(config, method_ranges or {})
        else:
            verdict, why = _cause_packing(config, packing_check)
        out.append({"cause": cause, "verdict": verdict, "why": why})
        if verdict == "explains":
            explained = cause
    return out


# --- OOM ladder --------------------------------------------------------------------------------


@dataclass
class Rung:
    """The step to take next: a ladder rung, an escalation, or "exhausted"."""

    id: str
    kind: str  # "rung" | "escalation" | "exhausted"
    action: str
    how: list[str]
    why: str
    detail: str = ""
    cite: str = f"{SKILL}#oom-ladder"


def oom_next_rung(tried: list[str], *, current_method: str | None = None, table=None) -> Rung:
    """The next step of the spark-memory-thermal-ops OOM ladder given the rungs already tried.

    Rungs go flush -> reduce-batch-or-seq -> downgrade-method, each taken once and none skipped, so
    a batch reduction is never first. Escalation (smaller-model, multi-node) comes only after every
    rung. current_method ("full", "bf16-lora", "qlora") names where the downgrade rung leads; a
    QLoRA run has nothing left to downgrade to, so that rung counts as spent.
    """
    t = table or load_ladder_table()
    steps = {s.id: s for s in (*t.rungs, *t.escalation)}
    tried = list(tried or [])
    unknown = [x for x in tried if x not in steps]
    if unknown:
        raise BadInput(f"unknown OOM ladder step(s) {unknown}", where="tried", fix=f"use ids from {list(steps)}")
    if current_method is not None and current_method not in ("full", "bf16-lora", "qlora"):
        raise BadInput(f"current_method {current_method!r} is not full, bf16-lora or qlora", where="current_method", fix="map the method: sft-qlora -> qlora, LoRA methods -> bf16-lora")
    notes = []
    for s in t.rungs:
        if s.id in tried:
            continue
        if s.id == "downgrade-method" and current_method is not None:
            target = t.method_downgrade.get(current_method)
            if target is None:
                notes.append(f"downgrade-method is spent: the run is already {current_method}, the last downgrade")
                continue
            return Rung(s.id, "rung", s.action, list(s.how), s.why, f"move from {current_method} to {target}")
        return Rung(s.id, "rung", s.action, list(s.how), s.why, "; ".join(notes))
    for s in t.escalation:
        if s.id not in tried:
            return Rung(s.id, "escalation", s.action, list(s.how), s.why,
                        "; ".join(notes + ["every rung of the ladder has been tried"]))
    return Rung("exhausted", "exhausted", "Report the OOM with the ladder climbed; nothing is left to try on this hardware.",
                [], "Every rung and escalation has been tried.", "; ".join(notes))


def rungs_tried(history: list[dict]) -> list[str]:
    """The ladder rungs an experiment's config history shows, oldest config first.

    A config may name the rung it applied (`oom_rung`); otherwise a drop in batch size or
    max_length reads as reduce-batch-or-seq and a move full -> LoRA -> QLoRA as downgrade-method.
    A flush leaves no trace in a config, so it counts only when recorded as oom_rung.
    """
    tried: list[str] = []

    def add(r):
        if r not in tried:
            tried.append(r)

    def lvl(c):
        m = str(_find(c, "method") or "").lower()
        if "qlora" in m or _find(c, "load_in_4bit") is True:
            return 2
        if "lora" in m or _find(c, "lora_r", "r") is not None:
            return 1
        return 0 if m in ("full", "sft-full") else None

    for i, c in enumerate(history):
        if not isinstance(c, dict):
            raise BadInput(f"config history entry {i} is not a mapping", where=f"history[{i}]", fix="pass the resolved configs as dicts")
        if c.get("oom_rung"):
            add(str(c["oom_rung"]))
        if i == 0:
            continue
        prev = history[i - 1]
        for key in (("per_device_train_batch_size", "batch_size"), ("max_length", "max_seq_length", "seq_length")):
            a, b = _find(prev, *key), _find(c, *key)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b < a:
                add("reduce-batch-or-seq")
        la, lb = lvl(prev), lvl(c)
        if la is not None and lb is not None and lb > la:
            add("downgrade-method")
    return tried


# --- the CLI entry: one log file ---------------------------------------------------------------


def _next_step(c: Classification, rung: Rung | None) -> str:
    if c.failure_class == "environment":
        if c.check_id:
            return f"Re-run preflight for check {c.check_id} and fix what it reports before any relaunch; never relaunch blind."
        return "Fix the platform problem named above (no preflight check covers it), then relaunch once."
    if c.failure_class == "oom":
        return f"Climb the OOM ladder of spark-memory-thermal-ops ({SKILL}#oom-ladder): next rung {rung.id} - {rung.action}"
    if c.failure_class == "divergence":
        return "Halt the run; check the causes in order - precision, learning rate, packing - and fix the first that explains it."
    if c.healthy_or_unrecognised == "unrecognised":
        return "No known failure class: read the error lines shown and fix that error; triage does not guess."
    if c.healthy_or_unrecognised == "stopped":
        return "The run was stopped on request; nothing to fix."
    return "Nothing to fix: the log shows no failure."


def triage_log_file(path: Path, *, platform: str | None = None):
    """Triage one log file a user hands in (the `finetune-mcp triage LOG` command)."""
    from finetune_mcp.schemas import CauseCheck, EvidenceLine, TriageResult

    path = Path(path)
    if not path.is_file():
        raise NotFound(f"no log file at {path}", where=str(path), fix="pass the path of a training log (stdout.log or similar)")
    text = path.read_bytes().decode("utf-8", errors="replace")
    c = classify_text(text, platform=platform)
    rung = oom_next_rung([]) if c.failure_class == "oom" else None
    causes = divergence_causes({}, None, {}, None) if c.failure_class == "divergence" else []
    for cc in causes:
        cc["why"] = "a bare log carries no config: triage the run to check this cause (" + cc["why"] + ")"
    cites = [f"{SKILL}#failure-signals"] + ([f"{SKILL}#oom-ladder"] if rung else []) + ([f"{SKILL}#divergence-causes"] if causes else [])
    kind = c.healthy_or_unrecognised
    return TriageResult(
        summary=f"{c.failure_class}" + (f" ({kind})" if kind else "") + (f", check {c.check_id}" if c.check_id else "") + f": {c.reason}",
        citations=cites,
        failure_class=c.failure_class,
        none_reason=kind,
        evidence=[EvidenceLine(file=str(path), line=n, text=t) for n, t in c.evidence],
        check_id=c.check_id,
        causes=[CauseCheck(**cc) for cc in causes],
        next_rung=rung.id if rung else None,
        tried_rungs=[],
        next_step=_next_step(c, rung),
        halt_run=c.failure_class == "divergence",
    )


# --- the tool: a run of ours, or any log ---------------------------------------------------------


def _method_ranges(skills) -> dict:
    """method -> settled learning-rate range, from every recipe skill (what the divergence check compares to)."""
    from finetune_mcp.phases.config import all_recipes, recipe_params

    out = {}
    for method in all_recipes(skills):
        lr = recipe_params(skills, method).get("learning_rate")
        rng = getattr(lr, "range", None)
        if rng:
            out[method] = list(rng)
    return out


def _method_level(config: dict) -> str | None:
    m = str(_find(config, "method", "method_id") or "")
    if not m:
        return None
    if "qlora" in m or _find(config, "load_in_4bit") is True:
        return "qlora"
    return "full" if m.endswith("full") else "bf16-lora"


def _config_history(run_dir: Path) -> list[dict]:
    """The experiment's config history: every run's resolved config.yaml up to this one, oldest first."""
    from finetune_mcp.phases.run import run_config

    runs = sorted(p for p in run_dir.parent.iterdir() if p.is_dir() and p.name <= run_dir.name)
    return [c for c in map(run_config, runs) if c]


def _packing_check(pc, config: dict, run_dir: Path):
    """Re-decode packed samples of the run's dataset with the run's tokenizer and TRL packing (in the worker)."""

    def check():
        from finetune_mcp.worker import run_job

        res = run_job("packing_check", {"config": config, "run_dir": str(run_dir)}, timeout=600)
        return {"ok": bool(res.get("ok")), "why": str(res.get("why", ""))}

    return check


def triage_failure(pc, run_id: str | None = None, log_path: str | None = None):
    """The triage_failure tool: exactly one of run_id (a run of ours) or log_path (any training log)."""
    from finetune_mcp.schemas import CauseCheck, EvidenceLine, TriageResult

    if bool(run_id) == bool(log_path):
        raise BadInput("give exactly one of run_id or log_path", where="run_id / log_path",
                       fix="run_id for a run launched here (<experiment>/<YYYYMMDD-HHMM-tag>); log_path for any other training log")
    if log_path:
        real = pc.guard.check_read(log_path, "log_path")
        return triage_log_file(real)

    from finetune_mcp.phases.run import read_json_file, run_config

    run_dir = pc.ws.run_dir(run_id)
    config = run_config(run_dir)
    env_report = read_json_file(run_dir / "env-report.json")
    platform = (env_report or {}).get("platform")
    exit_info = read_json_file(run_dir / "exit.json")
    log = run_dir / "logs" / "stdout.log"
    text = log.read_bytes().decode("utf-8", errors="replace") if log.is_file() else ""
    c = classify_text(text, exit_info=exit_info, platform=platform)
    evidence = [EvidenceLine(file=str(log), line=n, text=t) for n, t in c.evidence]

    # A run that never raised can still have diverged: the progress records show it.
    progress = run_dir / "logs" / "progress.jsonl"
    if c.failure_class == "none" and progress.is_file():
        import json

        recs, lines = [], []
        for i, raw in enumerate(progress.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            try:
                d = json.loads(raw.replace("NaN", "null").replace("Infinity", "null"))
            except ValueError:
                continue
            if isinstance(d, dict):
                recs.append(d)
                lines.append((i, raw))
        rc = classify_records(recs)
        if rc.failure_class == "divergence":
            by_step = {str(d.get("step")): (n, raw) for (n, raw), d in zip(lines, recs)}
            ev = []
            for n, t in rc.evidence:
                # record evidence refers to records; map it back to verbatim lines of progress.jsonl
                step = re.search(r'"step":\s*(\d+)', t)
                n2, raw = by_step.get(step.group(1), (n, t)) if step else (n, t)
                ev.append(EvidenceLine(file=str(progress), line=n2, text=raw))
            c, evidence = rc, ev

    cites = [f"{SKILL}#failure-signals"]
    causes: list[dict] = []
    rung = None
    tried: list[str] = []
    if c.failure_class == "divergence":
        causes = divergence_causes(config, env_report, _method_ranges(pc.skills), _packing_check(pc, config, run_dir))
        cites.append(f"{SKILL}#divergence-causes")
        method = _find(config, "method", "method_id")
        for skill in ("lora-qlora-recipes", "preference-optimization", "grpo-rlvr-training", "vision-sft"):
            if skill in pc.skills.skills and method and any(method == m for m in pc.skills.table(skill, "recipes").recipes):
                cites.append(f"{skill}#learning-rate" if "learning-rate" in pc.skills.get(skill).anchors else f"{skill}#{method}")
    elif c.failure_class == "oom":
        tried = rungs_tried(_config_history(run_dir))
        rung = oom_next_rung(tried, current_method=_method_level(config))
        cites.append(f"{SKILL}#oom-ladder")
    elif c.failure_class == "environment" and c.check_id:
        cites.append(f"spark-preflight#{c.check_id.lower()}")

    kind = c.healthy_or_unrecognised
    explains = next((x["cause"] for x in causes if x["verdict"] == "explains"), None)
    summary = f"{c.failure_class}" + (f" ({kind})" if kind else "") + (f", check {c.check_id}" if c.check_id else "")
    summary += f" in {run_id}: {c.reason}" + (f"; cause: {explains}" if explains else "") + (f"; next rung: {rung.id}" if rung else "")
    next_step = _next_step(c, rung)
    if explains:
        fix = {"precision": "switch to bf16 where the hardware supports it (or fp32), not fp16",
               "learning-rate": "bring the learning rate back inside the method's settled range",
               "packing": "re-run prepare_dataset and inspect the decoded packed samples"}[explains]
        next_step = f"Halt the run (stop_run if it is still going). The first cause that explains it is {explains}: {fix}."
    return TriageResult(
        summary=summary, citations=list(dict.fromkeys(cites)), failure_class=c.failure_class, none_reason=kind,
        evidence=evidence, check_id=c.check_id, causes=[CauseCheck(**x) for x in causes],
        next_rung=rung.id if rung else None, tried_rungs=tried, next_step=next_step,
        halt_run=c.failure_class == "divergence",
    )
