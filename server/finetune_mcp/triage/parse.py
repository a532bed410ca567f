"""Metrics from a training log in any common format: step, loss, grad norm, learning rate, loss scale.

Each line that carries a known metric becomes one Metric. The formats read: Python-dict lines (HF
Trainer, ms-swift, Axolotl; also inside tqdm redraws and markdown quotes), JSON lines and a whole
trainer_state.json (log_history), `key=value` / `key: value` / `key value` pairs (Megatron, DeepSpeed,
verl, MLX, Keras, torchtune, plain prints), pipe-separated tables with a header row, and DeepSpeed /
apex loss-scale cuts. Which key means which metric is data: the `metric_keys` of the failure-signals
table. The parsers are the standard library's own (json, ast.literal_eval) plus one pair regex.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

FIELDS = ("step", "loss", "eval_loss", "grad_norm", "lr", "loss_scale")

_NUM = r"[-+]?(?:nan|inf(?:inity)?|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)"
# A key (letters first, may hold spaces, / . - and brackets), a separator (= or :, or only spaces),
# then a number not glued to more word characters. Separators between pairs (| , ; tabs, " - ") are
# split on first, so a key never spans two fields; a key that is not in metric_keys is ignored whole
# ("mtp 1 loss" is not the loss).
_PAIR = re.compile(r"(?P<key>[A-Za-z_\[][\w\[\]/.\- ]{0,48}?)['\"]?\s*(?:[:=]\s*['\"]?\[?|\s+)\[?(?P<val>" + _NUM + r")(?![\w.])", re.I)
_SPLIT = re.compile(r"\s*(?:\||│|,|;|\t| - )\s*")
_TQDM_STEP = re.compile(r"(?<![\w.])(\d+)/(\d+) \[")
# DeepSpeed "Attempted loss scale: 16, reducing to 8", "Reducing dynamic loss scale from 2 to 1", apex
# "reducing loss scale to 0.5": the scale after the cut.
_SCALE_CUT = re.compile(r"(?:reducing to|reducing loss scale to|dynamic loss scale from \S+ to)\s+(" + _NUM + r")", re.I)
_NONFINITE = re.compile(r"(?<![\w'\"])(-?(?:nan|inf(?:inity)?))(?![\w'\"])", re.I)


@dataclass
class Metric:
    """The known metrics one log line (or one record) carries; `line` is 1-based, `text` verbatim."""

    line: int
    text: str
    step: float | None = None
    loss: float | None = None
    eval_loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    loss_scale: float | None = None
    scale_cut: bool = False  # the loss scale was cut on this line (not merely reported)
    source: str = ""  # which reader found it: dict, json, pairs, table, scale-cut, tqdm

    def has(self, name: str) -> bool:
        return getattr(self, name) is not None


@dataclass
class KeyMap:
    """Normalised key -> metric field, from the failure-signals table's metric_keys."""

    fields: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_table(cls, metric_keys) -> "KeyMap":
        out: dict[str, str] = {}
        for name in FIELDS:
            for k in getattr(metric_keys, name):
                out[k] = name
        return cls(out)

    def field_of(self, key: str) -> str | None:
        return self.fields.get(normalise_key(key))


def normalise_key(key: str) -> str:
    """'train/loss' -> 'train loss', "'grad_norm'" -> 'grad norm', '[Loss]' -> 'loss'."""
    k = re.sub(r"[_/\-.\[\]'\"()]+", " ", str(key)).strip().lower()
    return re.sub(r"\s+", " ", k)


def to_number(value: Any) -> float | None:
    """A logged value as float: 'nan', '-inf', '7.1E-01', '1,024', 1e-5, or None when it is not a number."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    s = str(value).strip().strip("'\"[]").replace(",", "").lower()
    if s in ("nan", "+nan", "-nan"):
        return math.nan
    if s in ("inf", "+inf", "infinity", "+infinity"):
        return math.inf
    if s in ("-inf", "-infinity"):
        return -math.inf
    try:
        return float(s)
    except ValueError:
        return None


def _flatten(obj: Mapping, prefix: str = "") -> Iterable[tuple[str, Any]]:
    for k, v in obj.items():
        key = f"{prefix} {k}".strip()
        if isinstance(v, Mapping):
            yield from _flatten(v, key)
        else:
            yield key, v


def _objects_in(line: str) -> list[str]:
    """Balanced {...} substrings of a line, outermost first (a dict printed inside a tqdm redraw)."""
    out, depth, start = [], 0, -1
    for i, ch in enumerate(line):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                out.append(line[start:i + 1])
    return out


def _load_object(text: str) -> dict | None:
    try:
        obj = json.loads(text)
    except ValueError:
        # Python reprs: single quotes, nan/inf as bare words, which literal_eval cannot read as numbers.
        try:
            obj = ast.literal_eval(_NONFINITE.sub(lambda m: repr(m.group(1)), text))
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return None
    return obj if isinstance(obj, dict) else None


def _assign(m: Metric, keys: KeyMap, key: str, value: Any) -> bool:
    name = keys.field_of(key)
    if name is None or getattr(m, name) is not None:
        return False
    num = to_number(value)
    if num is None:
        return False
    setattr(m, name, num)
    return True


def _from_dicts(m: Metric, keys: KeyMap, line: str) -> bool:
    found = False
    for text in _objects_in(line):
        obj = _load_object(text)
        if obj is None:
            continue
        # Loggers that write {"name": "loss", "data": {"step": 1, "value": 3.9}} name the metric in a field.
        named = obj.get("name") if isinstance(obj.get("name"), str) else None
        for k, v in _flatten(obj):
            if named and normalise_key(k).endswith("value"):
                k = named
            found |= _assign(m, keys, normalise_key(k).removeprefix("data "), v)
    return found


def _from_pairs(m: Metric, keys: KeyMap, line: str) -> bool:
    found = False
    for part in _SPLIT.split(line):
        for pm in _PAIR.finditer(part):
            found |= _assign(m, keys, pm.group("key"), pm.group("val"))
    return found


class _Table:
    """A pipe- or tab-separated table: a header row of words, then rows of numbers."""

    def __init__(self, keys: KeyMap):
        self.keys = keys
        self.columns: list[str | None] | None = None

    def feed(self, m: Metric, line: str) -> bool:
        sep = "|" if line.count("|") >= 2 else "\t" if line.count("\t") >= 1 else None
        if sep is None:
            self.columns = None
            return False
        cells = [c.strip() for c in line.strip().strip("|").split(sep)]
        if all(to_number(c) is None for c in cells if c) and any(self.keys.field_of(c) for c in cells):
            self.columns = [self.keys.field_of(c) for c in cells]
            return False
        if self.columns is None or len(cells) != len(self.columns):
            return False
        found = False
        for name, cell in zip(self.columns, cells):
            num = to_number(cell)
            if name and num is not None and getattr(m, name) is None:
                setattr(m, name, num)
                found = True
        return found


def parse_line(m: Metric, keys: KeyMap, line: str, table: _Table | None = None) -> Metric:
    """Fill `m` from one line with every reader that applies; the first value found per field wins."""
    if _from_dicts(m, keys, line):
        m.source = "dict"
    if table is not None and table.feed(m, line):
        m.source = m.source or "table"
    cut = _SCALE_CUT.search(line)
    if cut and m.loss_scale is None:
        m.loss_scale, m.scale_cut, m.source = to_number(cut.group(1)), True, m.source or "scale-cut"
    if not m.source and _from_pairs(m, keys, line):
        m.source = "pairs"
    if m.step is None:
        t = _TQDM_STEP.search(line)
        if t and any(m.has(f) for f in ("loss", "grad_norm", "eval_loss")):
            m.step = float(t.group(1))
    return m


def parse_text(text: str, keys: KeyMap) -> list[Metric]:
    """Every line of a log that carries a known metric, in log order (a whole trainer_state.json too)."""
    whole = _load_object(text.strip()) if text.lstrip().startswith("{") else None
    if whole is not None and isinstance(whole.get("log_history"), list):
        return parse_records(whole["log_history"], keys)
    lines = split_lines(text)
    table = _Table(keys)
    out: list[Metric] = []
    for i, line in enumerate(lines, 1):
        m = parse_line(Metric(i, line), keys, line, table)
        if any(m.has(f) for f in FIELDS if f != "step"):
            out.append(m)
    return dedupe(out)


def parse_records(records: Iterable[Any], keys: KeyMap) -> list[Metric]:
    """Metrics from already-structured records (progress.jsonl, log_history); position is the 'line'."""
    out = []
    for i, rec in enumerate(records, 1):
        if not isinstance(rec, Mapping):
            continue
        m = Metric(i, json.dumps(rec, default=str), source="json")
        for k, v in _flatten(rec):
            # poll_progress writes a NaN loss as null: a present null loss is a non-finite one.
            if v is None and keys.field_of(k) in ("loss", "grad_norm"):
                v = "nan"
            _assign(m, keys, normalise_key(k), v)
        if any(m.has(f) for f in FIELDS if f != "step"):
            out.append(m)
    return out


def dedupe(metrics: list[Metric]) -> list[Metric]:
    """Drop a record that repeats the one before it (tqdm redraws print the same step's numbers twice)."""
    out: list[Metric] = []
    for m in metrics:
        prev = out[-1] if out else None
        if prev is not None and _same(prev, m):
            continue
        out.append(m)
    return out


def _same(a: Metric, b: Metric) -> bool:
    if a.step is None or b.step is None or a.step != b.step:
        return a.text == b.text
    return all(_eq(getattr(a, f), getattr(b, f)) for f in ("loss", "grad_norm", "eval_loss"))


def _eq(x: float | None, y: float | None) -> bool:
    if x is None or y is None:
        return x is y
    return x == y or (math.isnan(x) and math.isnan(y))


def split_lines(text: str) -> list[str]:
    """Lines as editors and grep -n number them: split on \\n only (tqdm redraws with bare \\r inside a line)."""
    out = text.split("\n")
    if out and out[-1] == "":
        out.pop()
    return [ln[:-1] if ln.endswith("\r") else ln for ln in out]
