"""Scorers that judge a model's free-text answer against the accepted answers: their specs, validation and scoring.

Stdlib only, so both sides use it: the server validates eval suites with it, the eval job (training
Python) scores with it. `rouge_l` imports `rouge-score` (the `train` extra) only when it scores.

The text scorers follow inspect_ai's (`inspect_ai/scorer/_match.py`, `_common.py`, `_pattern.py`):
several accepted answers, any of which counts (inspect's multi-value Target); `contains` is
`includes()`; `numeric` is `match(numeric=True)` (currency signs and thousands separators dropped, the
last number by default, a percentage is not a plain number) plus a tolerance; `regex` is
`pattern()` (the first capture group that equals an accepted answer, case-insensitive by default).
"""

from __future__ import annotations

import difflib
import math
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

from finetune_mcp.common.errors import BadInput

# name -> {option: default}; None marks an option that must be given.
SCORERS: dict[str, dict[str, Any]] = {
    "exact": {},
    "first_line": {},
    "contains": {"ignore_case": True},
    "regex": {"pattern": None, "ignore_case": True},
    "normalized": {},
    "numeric": {"tolerance": 0.0, "rel_tolerance": 0.0, "location": "end"},
    "rouge_l": {"threshold": 0.5, "use_stemmer": False},
}
DEFAULT_SCORER = "exact"
LOCATIONS = ("begin", "end", "any")

WHAT = {
    "exact": "the whole output equals an accepted answer (whitespace collapsed)",
    "first_line": "the first non-empty line of the output equals an accepted answer (whitespace collapsed)",
    "contains": "an accepted answer occurs anywhere in the output (case-insensitive unless ignore_case: false)",
    "regex": "`pattern` is searched in the output; with capture groups, a group must equal an accepted answer",
    "normalized": "equal after case folding, dropping punctuation and collapsing whitespace",
    "numeric": "the last number in the output (location: begin | end | any) is within tolerance of the accepted number",
    "rouge_l": "ROUGE-L F-measure (rouge-score) against the best accepted answer reaches `threshold`",
}


@dataclass(frozen=True)
class ScorerSpec:
    name: str
    options: dict[str, Any] = field(default_factory=dict)

    def label(self) -> str:
        """`rouge_l(threshold=0.4)`: the name and the options that differ from the defaults."""
        changed = {k: v for k, v in self.options.items() if v != SCORERS[self.name].get(k)}
        # Strings as written (a regex stays readable), not repr'd with doubled backslashes.
        shown = [f"{k}='{v}'" if isinstance(v, str) else f"{k}={v!r}" for k, v in changed.items()]
        return self.name + (f"({', '.join(shown)})" if shown else "")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, **self.options}


@dataclass(frozen=True)
class Score:
    correct: bool
    value: float  # 1.0 / 0.0, or the ROUGE-L F-measure
    answer: str | None  # what the scorer took from the output (inspect's Score.answer)


# ---------------------------------------------------------------- specs


def did_you_mean(word: str, options) -> str:
    m = difflib.get_close_matches(str(word), list(options), n=1)
    return f" (did you mean {m[0]!r}?)" if m else ""


def parse_spec(value: Any, where: str, inherit: ScorerSpec | None = None, complete: bool = True) -> ScorerSpec:
    """A scorer given as a name or as {"name": ..., option: value}; options not given come from
    `inherit` when it is the same scorer (the suite default), else from the scorer's defaults. With
    complete=False a required option may still be missing (a suite line checked before its default is known)."""
    if isinstance(value, str):
        raw: dict[str, Any] = {"name": value}
    elif isinstance(value, dict):
        raw = dict(value)
    else:
        raise BadInput(f"scorer must be a name or a mapping with a name, got {type(value).__name__}", where=where,
                       fix=f"one of {', '.join(SCORERS)}, or e.g. {{\"name\": \"rouge_l\", \"threshold\": 0.4}}")
    name = raw.pop("name", None)
    if name not in SCORERS:
        raise BadInput(f"unknown scorer {name!r}{did_you_mean(name, SCORERS)}", where=f"{where}.name" if isinstance(value, dict) else where,
                       fix=f"scorers: {', '.join(SCORERS)}")
    base = dict(inherit.options) if inherit is not None and inherit.name == name else dict(SCORERS[name])
    for k, v in raw.items():
        if k not in SCORERS[name]:
            allowed = ", ".join(SCORERS[name]) or "none"
            raise BadInput(f"scorer {name} has no option {k!r}{did_you_mean(k, SCORERS[name])}", where=f"{where}.{k}",
                           fix=f"options of {name}: {allowed}")
        base[k] = _check_option(name, k, v, f"{where}.{k}")
    missing = [k for k, v in base.items() if v is None]
    if missing and complete:
        raise BadInput(f"scorer {name} needs {', '.join(missing)}", where=f"{where}.{missing[0]}",
                       fix='e.g. {"name": "regex", "pattern": "answer is (\\\\w+)"}' if name == "regex" else None)
    return ScorerSpec(name, base)


def _check_option(name: str, key: str, v: Any, where: str) -> Any:
    def number(lo: float, hi: float, lo_open: bool = False) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
            raise BadInput(f"{key} must be a number {'>' if lo_open else '>='} {lo:g}{'' if hi == math.inf else f' and <= {hi:g}'}, got {v!r}", where=where)
        return float(v)

    if key in ("ignore_case", "use_stemmer"):
        if not isinstance(v, bool):
            raise BadInput(f"{key} must be true or false, got {v!r}", where=where)
        return v
    if key == "pattern":
        if not isinstance(v, str) or not v:
            raise BadInput("pattern must be a non-empty regular expression", where=where)
        try:
            re.compile(v)
        except re.error as e:
            raise BadInput(f"pattern is not a valid regular expression: {e}", where=where,
                           fix="Python `re` syntax; in JSON a backslash is written \\\\") from None
        return v
    if key in ("tolerance", "rel_tolerance"):
        return number(0.0, math.inf)
    if key == "threshold":
        return number(0.0, 1.0, lo_open=True)
    if key == "location":
        if v not in LOCATIONS:
            raise BadInput(f"location must be one of {', '.join(LOCATIONS)}, got {v!r}", where=where)
        return v
    raise AssertionError(f"option {key} of {name} has no check")  # SCORERS and this function go together


def check_expected(spec: ScorerSpec, expected: list[str], where: str) -> None:
    """Accepted answers the scorer can use: numbers for `numeric`."""
    if spec.name == "numeric":
        for i, e in enumerate(expected):
            if parse_number(e) is None:
                raise BadInput(f"the numeric scorer needs numbers as accepted answers, got {e!r}",
                               where=where if len(expected) == 1 else f"{where}[{i}]", fix='e.g. "expected": "144" or "3.5"')


def accepted(expected: Any) -> list[str]:
    return [expected] if isinstance(expected, str) else list(expected)


# ---------------------------------------------------------------- text helpers


def collapse(text: str) -> str:
    return " ".join(text.split())


def first_line(text: str) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return collapse(line)
    return ""


def normalized(text: str) -> str:
    """Case folded, every Unicode punctuation character dropped, whitespace collapsed."""
    text = "".join(" " if unicodedata.category(c).startswith("P") else c for c in text.casefold())
    return collapse(text)


# A number token: sign, digits with optional thousands separators, decimals, exponent. Currency signs
# are dropped first; a number followed by "%" is a percentage and not taken (as inspect_ai does).
_NUMBER = re.compile(r"(?<![\w.])[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w%])")


def parse_number(text: str) -> float | None:
    t = text.strip().replace("−", "-")
    t = re.sub(r"[$€£,]", "", t)
    try:
        v = float(t)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def numbers_in(text: str) -> list[float]:
    text = re.sub(r"[$€£]", "", text.replace("*", " ").replace("_", " "))
    out = []
    for m in _NUMBER.finditer(text):
        s = m.group(0)
        if not any(c.isdigit() for c in s):
            continue
        v = parse_number(s.rstrip("."))
        if v is not None:
            out.append(v)
    return out


# ---------------------------------------------------------------- scoring


_ROUGE: dict[bool, Any] = {}


def rouge_l(output: str, references: list[str], use_stemmer: bool = False) -> float:
    """ROUGE-L F-measure from Google's rouge-score against the best of the references (its `score_multi`).
    Its tokenizer lower-cases and keeps runs of [a-z0-9] only: text in other scripts scores 0."""
    if use_stemmer not in _ROUGE:
        try:
            from rouge_score import rouge_scorer
        except ModuleNotFoundError:
            raise ModuleNotFoundError("the rouge_l scorer needs the rouge-score package in the training Python: "
                                      "pip install rouge-score (the train and unsloth extras include it)") from None

        _ROUGE[use_stemmer] = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=use_stemmer)
    return float(_ROUGE[use_stemmer].score_multi(references, output)["rougeL"].fmeasure)


def score(spec: ScorerSpec, output: str, expected: Any) -> Score:
    answers = accepted(expected)
    o = spec.options
    name = spec.name
    if name == "exact":
        got = collapse(output)
        return _hit(got, any(got == collapse(a) for a in answers))
    if name == "first_line":
        got = first_line(output)
        return _hit(got, any(got == collapse(a) for a in answers))
    if name == "normalized":
        got = normalized(output)
        return _hit(got, any(got == normalized(a) for a in answers))
    if name == "contains":
        fold = (lambda s: s.casefold()) if o["ignore_case"] else (lambda s: s)
        hay = fold(output)
        found = next((a for a in answers if fold(a.strip()) and fold(a.strip()) in hay), None)
        return _hit(found if found is not None else collapse(output), found is not None)
    if name == "regex":
        flags = re.IGNORECASE if o["ignore_case"] else 0
        m = re.search(o["pattern"], output, flags)
        if m is None:
            return Score(False, 0.0, None)
        groups = [g for g in m.groups() if isinstance(g, str)]
        if not m.re.groups:
            return _hit(m.group(0), True)
        fold = (lambda s: s.strip().casefold()) if o["ignore_case"] else (lambda s: s.strip())
        targets = {fold(a) for a in answers}
        hit = next((g for g in groups if fold(g) in targets), None)
        return _hit(hit if hit is not None else (groups[0] if groups else None), hit is not None)
    if name == "numeric":
        nums = numbers_in(output)
        want = [v for v in (parse_number(a) for a in answers) if v is not None]
        if o["location"] == "begin":
            nums = nums[:1]
        elif o["location"] == "end":
            nums = nums[-1:]

        def close(a: float, b: float) -> bool:
            return math.isclose(a, b, rel_tol=o["rel_tolerance"], abs_tol=o["tolerance"]) or a == b

        hit = next((n for n in nums if any(close(n, w) for w in want)), None)
        shown = hit if hit is not None else (nums[0] if nums else None)
        return Score(hit is not None, 1.0 if hit is not None else 0.0, None if shown is None else f"{shown:g}")
    if name == "rouge_l":
        best = rouge_l(output, answers, o["use_stemmer"])
        return Score(best >= o["threshold"], best, collapse(output))
    raise AssertionError(f"scorer {name} has no rule")


def _hit(answer: str | None, ok: bool) -> Score:
    return Score(ok, 1.0 if ok else 0.0, answer)
