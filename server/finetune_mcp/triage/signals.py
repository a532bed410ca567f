"""What a log shows: the failure-signals table's word signals, the numeric rules over parsed metrics, exit status and failure markers.

Everything this module knows comes from skills/dgx-spark-ops/tables/failure-signals.yaml (validated by
skilltables.FailureSignalsTable); it finds, it does not decide - classify weighs what it finds.
"""

from __future__ import annotations

import bisect
import math
import re
import signal as _signal
import statistics
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from finetune_mcp.errors import BadInput, NotFound
from finetune_mcp.triage.parse import KeyMap, Metric, parse_records, parse_text, split_lines

SKILL = "dgx-spark-ops"
MAX_LINES_PER_HIT = 12
# The last "Name: message" line of a traceback, with the rank prefix torchrun adds and the wrapper
# form Ray prints (RayTaskError(OutOfMemoryError): ...).
_EXCEPTION = re.compile(r"^\W*(?:\[rank\d+\]:\s*)?(?:[\w]+\.)*((?:[A-Z]\w*)?(?:Error|Exception|Interrupt|Exit))(?:\([\w.]*\))?(?::|\s*$)")


# --- the table ---------------------------------------------------------------------------------


def table_path(name: str) -> Path:
    from finetune_mcp.shipped import shipped_dir

    return shipped_dir("skills") / SKILL / "tables" / f"{name}.yaml"


def load_table(name: str, path: Path | None = None):
    """One of this skill's tables, validated by its registered model (only this skill's, so triage
    does not depend on every other skill being valid at the moment)."""
    return _cached(name, str(path) if path else None)


@lru_cache(maxsize=8)
def _cached(name: str, path: str | None):
    from pydantic import ValidationError

    from finetune_mcp.skills import explain
    from finetune_mcp.skilltables import TABLES

    p = Path(path) if path else table_path(name)
    model = TABLES[(SKILL, name)]
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
        return model.model_validate(raw)
    except FileNotFoundError:
        raise NotFound(f"skill table {p} is missing", where=str(p), fix="restore skills/dgx-spark-ops/tables") from None
    except yaml.YAMLError as e:
        raise BadInput(f"{p}: not valid YAML: {e}", where=str(p), fix="fix the YAML syntax") from None
    except ValidationError as e:
        raise BadInput(f"{p}: {explain(e, model)}", where=str(p), fix="correct the table entries named above") from None


def load_signal_table(path: Path | None = None):
    """The validated failure-signals table (FailureSignalsTable)."""
    return load_table("failure-signals", path)


class Compiled:
    """The signal table turned into regexes once (multi-line mode, for whole-text scans)."""

    def __init__(self, table):
        self.table = table
        self.keys = KeyMap.from_table(table.metric_keys)
        self.line_signals: list[tuple[Any, list[re.Pattern]]] = []
        for s in table.signals:
            if s.patterns:
                flags = re.M | (re.I if s.ignore_case else 0)
                self.line_signals.append((s, [re.compile(p, flags) for p in s.patterns]))
        self.markers = [re.compile(p, re.M) for p in table.failure_markers]
        self.fallback = [(r, re.compile(r.match)) for r in table.fallback]
        self.by_rule = {s.records_rule: s for s in table.signals if s.records_rule}


_COMPILED: dict[int, Compiled] = {}


def compiled(table=None) -> Compiled:
    table = table or load_signal_table()
    c = _COMPILED.get(id(table))
    if c is None or c.table is not table:
        c = _COMPILED[id(table)] = Compiled(table)
    return c


# --- one log -----------------------------------------------------------------------------------


class Log:
    """One log: its lines (verbatim, 1-based) and a per-pattern scan that runs in C over the whole text.

    Searching the joined text once per pattern is far faster than calling every regex on every line
    of a big log; each hit is then confirmed on its own line, so a match never spans two.
    """

    def __init__(self, text: str):
        self.lines = split_lines(text)
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
                found.setdefault(first, m)
            else:
                for i in range(first, self.line_of(m.end() - 1) + 1):
                    if i not in found and (lm := pattern.search(self.lines[i])):
                        found[i] = lm
            if first + 1 >= len(self.starts):
                break
            pos = self.starts[first + 1]
        return found


@dataclass
class Hit:
    """One signal seen: the table entry (or a fallback rule), the verbatim (line, text) pairs, a detail."""

    signal: Any
    lines: list[tuple[int, str]] = field(default_factory=list)
    detail: str = ""

    @property
    def id(self) -> str:
        return self.signal.id

    @property
    def failure_class(self) -> str:
        return self.signal.failure_class

    @property
    def first(self) -> int:
        return self.lines[0][0] if self.lines else 10**12


@dataclass
class Findings:
    """Everything one log (or one record list) shows, before any verdict."""

    hits: list[Hit]
    metrics: list[Metric]
    markers: list[tuple[int, str]]  # failure-marker lines
    exception: tuple[int, str] | None  # the last exception line
    traceback_cut: bool  # a traceback whose exception line is missing (an excerpt cut short)
    exit_code: int | None = None
    exit_signal: int | None = None
    stopped_by: str | None = None
    dropped: list[Hit] = field(default_factory=list)  # SIGKILL signs set aside because stop_run sent the kill
    table: Any = None  # the signal table these were found with

    @property
    def failed(self) -> bool:
        """The run shows it failed: a traceback, an exception, a kill, a non-zero exit. A run known to
        have exited 0 did not fail, whatever error lines it printed on the way."""
        if self.exit_code == 0 and not self.exit_signal:
            return False
        kill = any(h.signal.failure_class == "oom" and getattr(h.signal, "explained_by_stop", False) for h in self.hits)
        return bool(self.markers or self.exception or kill or (self.exit_code not in (None, 0)) or self.exit_signal)


# --- word signals ------------------------------------------------------------------------------


def word_hits(log: Log, comp: Compiled) -> dict[str, Hit]:
    out: dict[str, Hit] = {}
    for s, pats in comp.line_signals:
        matched: set[int] = set()
        for p in pats:
            matched |= set(log.scan(p))
        if matched:
            out[s.id] = Hit(s, [(i + 1, log.lines[i]) for i in sorted(matched)])
    return out


def exit_fields(exit_info: dict | None) -> tuple[int | None, int | None, str | None]:
    """(returncode, signal number, stopped_by) from exit.json-like info; a returncode of -N means signal N."""
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
        sig = -code
    return code, sig, exit_info.get("stopped_by")


def exit_hits(comp: Compiled, code: int | None, sig_no: int | None, stopped_by: str | None) -> dict[str, Hit]:
    out: dict[str, Hit] = {}
    for s in comp.table.signals:
        if (s.exit_codes and code in s.exit_codes) or (s.exit_signals and sig_no in s.exit_signals):
            detail = f"exit status {code}" if code is not None else f"signal {sig_no}"
            out[s.id] = Hit(s, detail=detail + ("" if stopped_by else " with no stop request"))
        if s.stop_request and stopped_by:
            out[s.id] = Hit(s, detail=f"stopped by {stopped_by}")
    return out


# --- numeric rules -----------------------------------------------------------------------------


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def number_hits(metrics: list[Metric], comp: Compiled) -> list[Hit]:
    """The records rules of the table applied to parsed metrics; each hit quotes the lines it rests on."""
    rules = comp.table.records
    hits: list[Hit] = []

    def add(rule: str, ms: list[Metric], detail: str):
        sig = comp.by_rule.get(rule)
        if sig is not None and ms:
            hits.append(Hit(sig, [(m.line, m.text) for m in ms][:MAX_LINES_PER_HIT], detail))

    bad = [m for m in metrics if (m.loss is not None and not math.isfinite(m.loss)) or (m.eval_loss is not None and not math.isfinite(m.eval_loss))]
    add("nonfinite-loss", bad, f"{len(bad)} logged loss value(s) are NaN or infinite")
    bad = [m for m in metrics if m.grad_norm is not None and not math.isfinite(m.grad_norm)]
    add("nonfinite-grad-norm", bad, f"{len(bad)} logged grad norm(s) are NaN or infinite")
    zero = [m for m in metrics if m.loss == 0 and m.grad_norm is not None and math.isnan(m.grad_norm)]
    add("loss-zero-grad-nan", zero, f"{len(zero)} log(s) show loss exactly 0 with a NaN grad norm")

    finite = [m for m in metrics if _finite(m.loss)]
    spikes, history = [], []
    for m in finite:
        window = history[-rules.spike_window:]
        if len(window) >= rules.spike_min_history:
            med = statistics.median(window)
            if med > 0 and m.loss > rules.spike_factor * med:
                spikes.append((m, med))
        history.append(m.loss)
    if spikes:
        m, med = spikes[0]
        add("loss-spike", [s for s, _ in spikes], f"loss {m.loss:g} at line {m.line} is {m.loss / med:.0f}x the running median {med:g}")

    if len(finite) > rules.rise_min_history:
        last = finite[-1]
        low = min(finite[:-1], key=lambda m: m.loss)
        if low.loss > 0 and last.loss >= rules.rise_factor * low.loss and last.loss >= rules.rise_back_to * finite[0].loss:
            add("loss-rise", [low, last], f"the loss rose from its minimum {low.loss:g} (line {low.line}) to {last.loss:g} "
                                          f"(line {last.line}), {last.loss / low.loss:.1f}x")

    big = [m for m in metrics if _finite(m.grad_norm) and m.grad_norm >= rules.grad_norm_max]
    if big:
        add("grad-norm-explosion", big, f"grad norm reached {max(m.grad_norm for m in big):.3g} (limit {rules.grad_norm_max:g})")

    scales = [m for m in metrics if _finite(m.loss_scale)]
    floor = [m for i, m in enumerate(scales)
             if m.loss_scale <= rules.loss_scale_floor and (m.scale_cut or any(p.loss_scale > m.loss_scale for p in scales[:i]))]
    if floor:
        add("loss-scale-collapse", floor, f"the loss scale was cut to {min(m.loss_scale for m in floor):g} "
                                          f"(floor {rules.loss_scale_floor:g}): every step overflows")

    flat = _flat(finite, rules.flat_identical_run, rules.flat_repeat_window, rules.zero_loss_run)
    if flat:
        add("flat-loss", flat[0], flat[1])
    return hits


def _flat(finite: list[Metric], run_len: int, window: int, zero_run: int) -> tuple[list[Metric], str] | None:
    vals = [m.loss for m in finite]
    start = 0
    for i in range(1, len(vals) + 1):
        if i == len(vals) or vals[i] != vals[start]:
            if i - start >= (zero_run if vals[start] == 0 else run_len):
                return finite[start:i], f"the loss stays at exactly {vals[start]:g} for {i - start} consecutive logs"
            start = i
    seen: dict[tuple[float, ...], int] = {}
    for i in range(len(vals) - window + 1):
        key = tuple(vals[i:i + window])
        j = seen.get(key)
        if j is not None and i >= j + window:
            return finite[j:j + window] + finite[i:i + window], (
                f"the same {window} losses recur exactly (from line {finite[j].line} and again from {finite[i].line}): the weights are not changing")
        seen.setdefault(key, i)
    return None


# --- failure evidence --------------------------------------------------------------------------


def last_exception(log: Log) -> tuple[int, str] | None:
    for i in range(len(log.lines) - 1, -1, -1):
        if _EXCEPTION.match(log.lines[i]):
            return i + 1, log.lines[i]
    return None


def traceback_cut(log: Log, exception: tuple[int, str] | None) -> bool:
    """A traceback header with no exception line after it: the excerpt stops inside the traceback."""
    heads = [i for i, ln in enumerate(log.lines, 1) if "Traceback (most recent call last)" in ln]
    return bool(heads) and (exception is None or exception[0] < heads[-1])


def fallback_rule(comp: Compiled, exception: tuple[int, str] | None, markers: list[tuple[int, str]]):
    """The fallback rule for a failure no signal names: by the exception line, else the last markers
    (the innermost traceback frames, where an excerpt cut before the exception line stops)."""
    text = exception[1] if exception else "\n".join(t for _, t in markers[-3:])
    for rule, rx in comp.fallback:
        if rx.search(text):
            return rule
    return comp.fallback[-1][0]


# --- all of it ---------------------------------------------------------------------------------


def find(text: str, *, exit_info: dict | None = None, table=None) -> Findings:
    """Everything a log shows: word signals, numeric signals over its parsed metrics, exit status, markers."""
    if not isinstance(text, str):
        raise BadInput(f"log text must be a string, got {type(text).__name__}", fix="read the log file as text first")
    comp = compiled(table)
    log = Log(text)
    code, sig_no, stopped_by = exit_fields(exit_info)
    by_id = word_hits(log, comp)
    for k, h in exit_hits(comp, code, sig_no, stopped_by).items():
        have = by_id.setdefault(k, h)
        have.detail = have.detail or h.detail
    metrics = parse_text(text, comp.keys)
    for h in number_hits(metrics, comp):
        have = by_id.get(h.id)
        if have is None:
            by_id[h.id] = h
        else:
            have.lines = sorted(set(have.lines) | set(h.lines))
            have.detail = have.detail or h.detail
    marked: set[int] = set()
    for m in comp.markers:
        marked |= set(log.scan(m))
    markers = [(i + 1, log.lines[i]) for i in sorted(marked)]
    exc = last_exception(log)
    dropped: list[Hit] = []
    if stopped_by:
        dropped = [h for h in by_id.values() if h.signal.explained_by_stop]
        by_id = {k: h for k, h in by_id.items() if not h.signal.explained_by_stop}
    return Findings(list(by_id.values()), metrics, markers, exc, traceback_cut(log, exc), code, sig_no, stopped_by, dropped, comp.table)


def find_in_records(records: list, *, table=None) -> Findings:
    """The numeric signals of a list of progress records ({"step", "loss", ...}); a null loss is NaN."""
    if not isinstance(records, list):
        raise BadInput("records must be a list of dicts", fix="pass poll_progress's records list")
    comp = compiled(table)
    for i, rec in enumerate(records, 1):
        if not isinstance(rec, dict):
            raise BadInput(f"progress record {i} is not an object: {rec!r}", where=f"record {i}", fix="pass dicts like {'step': 1, 'loss': 2.3}")
        for key in ("loss", "grad_norm"):
            v = rec.get(key)
            if v is not None and not isinstance(v, (int, float)) and (not isinstance(v, str) or _bad_number(v)):
                raise BadInput(f"progress record {i}: {key} {v!r} is not a number", where=f"record {i}.{key}", fix="log numbers (or null for NaN)")
    metrics = parse_records(records, comp.keys)
    return Findings(number_hits(metrics, comp), metrics, [], None, False, table=comp.table)


def _bad_number(v: str) -> bool:
    from finetune_mcp.triage.parse import to_number

    return to_number(v) is None
