"""Metrics from a training log in any common format: step, loss, grad norm, learning rate, loss scale.

Each line that carries a known metric becomes one Metric. The formats read: Python-dict lines (HF
Trainer, ms-swift, Axolotl; also inside tqdm redraws and markdown quotes), JSON lines and a whole
trainer_state.json (log_history), `key=value` / `key: value` / `key value` pairs (Megatron, DeepSpeed,
verl, MLX, Keras, torchtune, plain prints), pipe-, tab- and comma-separated tables with a header row
(Keras' CSVLogger, a log history saved as CSV), and DeepSpeed / apex loss-scale cuts. Which key means
which metric is data: the `metric_keys` of the failure-signals table. The parsers are the standard
library's own (json, ast.literal_eval) plus one pair regex.
"""

from __future__ import annotations

import ast
import codecs
import json
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterable, Iterator, Mapping

FIELDS = ("step", "loss", "eval_loss", "grad_norm", "lr", "loss_scale", "epoch", "run_end")

# MSVC's printf before VS 2015 wrote NaN and inf as `1.#QNAN`, `-1.#IND`, `1.#INF` (a Windows build of Caffe or
# darknet): read as numbers they would be 1.0.
_NUM = r"[-+]?(?:nan|inf(?:inity)?|1\.#(?:QNAN|SNAN|IND|INF)0*|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)"
_NUM_C = r"-?nan|" + _NUM  # a C printf's NaN: `-nan`
# A key (letters first, may hold spaces, / . - and brackets), a separator (= or :, or only spaces),
# then a number not glued to more word characters. Separators between pairs (| , ; tabs, " - ") are
# split on first, so a key never spans two fields; a key that is not in metric_keys is ignored whole
# ("mtp 1 loss" is not the loss).
# A torch tensor printed whole (`Loss: tensor(2.3456, device='cuda:0', grad_fn=<AddBackward0>)`, `tensor([nan])`)
# is its number: plain PyTorch loops print the loss that way.
_PAIR = re.compile(r"(?P<key>[A-Za-z_\[][\w\[\]/.\- ]{0,48}?)['\"]?(?:\s*\([\w .,%/=-]{1,40}\))?\s*(?:[:=]\s*['\"]?\[?|\s+)(?:tensor\(\[{0,2})?\[?(?P<val>" + _NUM + r")(?![\w.])", re.I)
_AT_STEP = re.compile(r"(?P<key>[A-Za-z][\w/.\- ]{0,48}?) (?:at|from|for) (?P<unit>step|iteration|iter|epoch|batch) (?:\d+ to )?"
                      r"(?P<n>\d+)(?:\s*[:=]|\s+is)\s*(?P<val>" + _NUM + r")(?![\w.])", re.I)
# A source file's name right before the pair's separator: the number after it is a line of that file.
_SOURCE_FILE = re.compile(r"\.(?:py|pyx|cc|cpp|cxx|c|h|hpp|cu|cuh|go|rs|java|js|ts)$", re.I)
_TUPLE_PAIR = re.compile(r"\(\s*'([\w/.\- ]{1,48})'\s*,\s*(" + _NUM + r")\s*\)")
_SPLIT = re.compile(r"\s*(?:\||│|,|;|\t| - )\s*")
_TQDM_STEP = re.compile(r"(?<![\w.])(\d+)/(\d+) \[")
# wandb refusing a record logged with a step behind its own: "(User provided step: 883 is less than current step:
# 884. Dropping entry: {...})" - the record's step is the one it names (often a record already printed).
_WANDB_DROPPED = re.compile(r"User provided step: (\d+) is less than current step")
# "Pre-training iteration 20/100", "Step [40/500]", "batch: 7/120": a count out of a total after a step word.
_COUNTED_STEP = re.compile(r"\b(?:step|iter|iteration|batch)\s*[:=]?\s*\[?\s*(\d+)\s*/\s*\d+", re.I)
# darknet's per-iteration line (src/detector.c): `%d: %f, %f avg loss, %f rate, %lf seconds, %d images` (AlexeyAB's
# fork; pjreddie's prints `avg,`): the iteration, the batch's loss, its running average, the learning rate. A NaN
# prints as `-nan` or `nan`.
_DARKNET = re.compile(r"^\s*(\d+): (" + _NUM_C + r"), (" + _NUM_C + r") avg(?: loss)?, (" + _NUM_C + r") rate,", re.I)
# DeepSpeed "Attempted loss scale: 16, reducing to 8", "Reducing dynamic loss scale from 2 to 1", apex
# "reducing loss scale to 0.5", ColossalAI "Overflow occurs, the loss scale is adjusted to 1.0": the scale after the cut.
_SCALE_CUT = re.compile(r"(?:reducing to|reducing loss scale to|dynamic loss scale from \S+ to|Overflow occurs, the loss scale is adjusted to)\s+("
                        + _NUM + r")", re.I)
_NONFINITE = re.compile(r"(?<![\w'\"])(-?(?:nan|inf(?:inity)?))(?![\w'\"])", re.I)
# A printout of settings, not a measurement: DeepSpeed's and Megatron's `key ........ value` listings and
# an options table's `key: value [default: x]`. (A pretty-printed JSON line is not one: the same shape holds
# trainer_state.json's log_history; a first loss scale of 0, DeepSpeed's "dynamic", is NumberRules' to skip.)
_SETTING = re.compile(r"\w \.{3,} \S|\[default: ")
# One `key: inf` alone on its line (after prefixes): an unbounded limit in an options or JSON config dump
# (max_dataset_size: inf, "steps_per_print": inf, a yacs config's `'DELTA_CLIPS_MIN': -inf,` pretty-printed one
# key a line); a metric that overflows is printed beside the step or other metrics.
_LONE_INF = re.compile(r"^\s*['\"]?[\w.\-]+['\"]?\s*[:=]\s*['\"]?[-+]?inf(?:inity)?['\"]?,?\s*$", re.I)


# wandb's end-of-run "Run summary:" block, `wandb:   train_loss 0.01375`: the last values restated, not a
# record (a stdout/stderr interleave can even print it before the first step).
_WANDB_SUMMARY = re.compile(r"^wandb:\s+[\w./\- ]+?\s+" + _NUM + r"\s*$", re.I)


def is_setting(clean: str) -> bool:
    """True for a (cleaned) line that prints a setting or a run's summary, not a measurement (see _SETTING)."""
    if clean.startswith("wandb:"):
        return bool(_WANDB_SUMMARY.match(clean))
    if "..." not in clean and "[default" not in clean and "inf" not in clean and "INF" not in clean and "Inf" not in clean:
        return False  # most lines: a few substring tests, no regex
    return bool(_SETTING.search(clean) or _LONE_INF.match(clean))

# Terminal escapes: CSI/OSC sequences with the ESC byte, in caret notation (^[[33m, as `cat -v` and
# many pastes show them) or spelled out (ESC[33m, as some viewers render them), and SGR colour codes
# whose ESC byte was lost on the way (`[33m(raylet)[0m`).
_ANSI = re.compile(r"(?:\x1b|\^\[|ESC(?=\[))(?:\[[0-9;?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])|\[(?:\d{1,3};)*\d{1,3}m")
# What launchers and loggers put before a line: timestamps (ISO, bracketed, glog, dmesg seconds),
# torchrun's [rank3]: / [default0]:, Ray's (pid=123) / (RayWorker pid=1, ip=10.0.0.1) / (raylet),
# pdsh-style host prefixes (10.0.0.1: , node-3: ), srun --label's task number (0: ), a logger's level and
# name (python logging's `- root - INFO -`, `- INFO - __main__ -` and `INFO:root:`, `[INFO]`, transformers' and
# LLaMA-Factory's `[INFO|trainer.py:1812] ... >>` / `[INFO|<time>] llamafactory.x:373 >>`,
# Hydra's `[__main__][INFO] -`, loguru's `| INFO | mod:fn:12 -`, a level right after a timestamp), syslog's
# `Dec  6 12:00:01 host python[123]:` (journald), a container runtime's stream tag (`stdout F`) and docker
# compose's service column (`trainer-1  |`).
# Stripped repeatedly from the start only.
_LEVEL = r"(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL|NOTICE|TRACE|SUCCESS)"
_NAME = r"[\w.<>]+"
# After a timestamp: python logging's ` - root - INFO - ` / ` - INFO - __main__ - `, a bare level (` INFO `), a
# name and a level (` ppdet.engine INFO: `); a bare `ERROR:` stays (pip's, under a CI runner's timestamp).
_LEVEL_AFTER_TIME = (r"(?:[ \t]+-[ \t]+(?:" + _NAME + r"[ \t]+-[ \t]+)?" + _LEVEL + r"[ \t]+-(?:[ \t]+" + _NAME + r"[ \t]+-)?(?=[ \t])"
                     r"|[ \t]+(?:[\w.]+[ \t]+)?" + _LEVEL + r"(?=[ \t])|[ \t]+[\w.]+[ \t]+" + _LEVEL + r":)?")
_DATE_TIME = r"\d{4}[-/]\d{2}[-/]\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?"
# The alternatives are grouped by what a line starts with, each group behind a literal or a lookahead, so the
# regex engine rejects a line that starts with none of them in a few steps: most lines of a big log
# (bench/bench_triage_big.py).
_PREFIX = re.compile(r"\s*(?:" + "|".join([
    r"\[(?:" + "|".join([
        r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}[.,]\d+ [DIWEFC] \d+ \d+\]",
        _DATE_TIME + r"\]?:?" + _LEVEL_AFTER_TIME,
        r"\d{2}:\d{2}:\d{2}(?:[.,]\d+)?\]" + _LEVEL_AFTER_TIME,
        r"\s*\d+\.\d+\]",
        r"(?:rank|default|Rank )\s?\d+\]:?",
        r"(?:[\w.<>-]+\]\[)?" + _LEVEL + r"(?:\|[^\]\n]*)?\](?:[ \t]*-(?=[ \t])"
        r"|(?:[ \t]+\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:[.,]\d+)?)?(?:[ \t]+[\w.]+:\d+)?[ \t]+>>(?=[ \t]))?",
    ]) + ")",
    r"(?=\d)(?:" + "|".join([
        _DATE_TIME + r":?" + _LEVEL_AFTER_TIME,
        r"\d{2}/\d{2}/\d{4} \d{2}:\d{2}:\d{2}" + _LEVEL_AFTER_TIME,
        r"\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?:(?=\s|$)",
        # a task number before a line (a timestamped one too), not `12: 0.5` nor darknet's `31: -nan, -nan avg`
        r"\d{1,4}:(?=[ \t]+(?!-?(?:nan|inf)\b)[^\d\s]|[ \t]+\d{4}-\d\d-\d\d[ T]|[ \t]{2}|[ \t]*$)",
    ]) + ")",
    r"\((?:(?:[\w.\-]+ )?pid=\d+(?:, ip=[\w.:\-]+)?|(?:raylet|gcs_server|dashboard|autoscaler|monitor)(?:, ip=[\w.:\-]+)?)\)",
    r"(?=[A-Z])(?:" + "|".join([
        r"[A-Z][a-z]{2} [ \d]\d \d{2}:\d{2}:\d{2} [\w.-]+ [\w.@/-]+(?:\[\d+\])?:(?=[ \t])",
        r"[IWEF]\d{4} \d{2}:\d{2}:\d{2}\.\d+\s+\d+ [\w./-]+:\d+\]",
        _LEVEL + r"(?:[ \t]+-(?:[ \t]+" + _NAME + r"[ \t]+-)?(?=[ \t])|:[\w.<>-]+:)",
    ]) + ")",
    r">>(?=[ \t])",
    r"\|[ \t]*" + _LEVEL + r"[ \t]*\|(?:[ \t]*[\w.<>]+:[\w.<>]+:\d+[ \t]+-(?=[ \t]))?",
    r"std(?:out|err) [FP](?= )",
    r"[A-Za-z0-9.]++[-_](?:[A-Za-z0-9.]++[-_])*?\d+ {2,}\|(?= )",
]) + ")")


def _last_segment(line: str) -> str:
    """What a terminal shows of a line redrawn with carriage returns: its last segment with text (one holding
    only escapes - a colour reset, tqdm's cursor-up - shows none)."""
    segs = [seg for seg in line.split("\r") if seg.strip()]
    while segs and ("\x1b" in segs[-1] or "[" in segs[-1]) and not _ANSI.sub("", segs[-1]).strip():
        segs.pop()
    return segs[-1] if segs else ""


# A progress line redrawn with carriage returns that a tool dropped (GitHub's file view, a copy from a web page, a
# notebook export) is its redraws glued end to end: `epoch 41/50, batch 1/2501, loss 0.0049epoch 41/50, batch 21/2501,
# loss 0.0185...` or tqdm's `Epoch 0:   0%|...| 0/100 [00:00<?, ?it/s]Epoch 0:   1%|...`. A line over GLUED_MIN
# characters whose first GLUED_NEEDLE characters recur at least GLUED_REPEATS times is read as those redraws.
GLUED_MIN, GLUED_NEEDLE, GLUED_REPEATS = 300, 12, 3


def _unglue(line: str) -> str:
    """The line with a carriage return before each redraw glued to the one before it (see GLUED_MIN), or as it is."""
    body = line.lstrip()
    needle = body[:GLUED_NEEDLE]
    if len(needle) < GLUED_NEEDLE or not any(ch.isalnum() for ch in needle) or body.count(needle) < GLUED_REPEATS:
        return line
    return line.replace(needle, "\r" + needle)


def _earlier_bar(line: str) -> str:
    """The last redraw, before the one a terminal shows, that names a metric (cleaned), or ''."""
    segs = line.split("\r")
    for seg in reversed(segs[:-1]):
        if _CARRY.search(seg.lower()):
            return clean_line(seg)
    return ""


def _after_prefix(line: str, pos: int) -> str:
    """The line after its prefix and the one space or tab that ends it: what is left keeps its own
    indentation, so a traceback's frames under `[rank0]: ` still read as frames."""
    return line[pos + 1:] if line[pos:pos + 1] in (" ", "\t") else line[pos:]


# Keras' progress bar erases itself with backspaces before each redraw (`\b` x the bar's width): a run of them is a
# carriage return, whether or not the `\r` after it survived (a copy that dropped the carriage returns).
_BACKSPACES = re.compile("\x08{2,}")


def clean_line(line: str) -> str:
    """One raw log line as the readers should see it (see the module docstring); never spans lines."""
    if "\x08" in line:
        line = _BACKSPACES.sub("\r", line)
    if "\r" in line:
        line = _last_segment(line)
    elif len(line) > GLUED_MIN and (redrawn := _unglue(line)) is not line:
        line = _last_segment(redrawn)
    if "\x1b" in line or "[" in line:
        line = _ANSI.sub("", line)
    pos = 0
    while True:
        m = _PREFIX.match(line, pos)
        if m is None or m.end() == pos:
            break
        pos = m.end()
    return _after_prefix(line, pos) if pos else line


def prefix_layers(line: str, most: int = 3) -> list[str]:
    """The line without colour escapes, then after each of its first `most` prefixes (a collector's logger before the
    program's own: `... - root - INFO - 2025-04-25 12:47:57,941 - finetune - ERROR - ...`), for what a prefix itself
    says (its level)."""
    if "\x1b" in line or "^[" in line:
        line = _ANSI.sub("", line)
    out, pos = [line], 0
    for _ in range(most):
        m = _PREFIX.match(line, pos)
        if m is None or m.end() == pos:
            break
        pos = m.end()
        out.append(line[pos:].lstrip(" \t"))
    return out


_PREFIXES_AT_START = re.compile(r"(?m)^(?:" + _PREFIX.pattern.replace(r"\s*(?:", r"[ \t]*(?:", 1) + r")+[ \t]?")


# A terminal's capture (tmux, screen, a copy from a terminal window) breaks every line longer than the window into
# pieces of exactly its width: the longest lines of such a log are many, all of one length, and most end inside a
# word. A log whose WRAP_MIN_COUNT or more longest lines (and WRAP_SHARE of its lines) share one length of WRAP_MIN_WIDTH or
# more, most of them ending in a character other than a space and holding more than two kinds of character (not a
# `=====` rule), and most of them followed by a line that does not start as they do, is read with each such line
# joined to the lines that continue it.
WRAP_MIN_WIDTH, WRAP_MAX_WIDTH, WRAP_MIN_COUNT, WRAP_SHARE = 60, 320, 3, 0.01
TERMINAL_WIDTHS = frozenset({80, 100, 120, 132, 160, 200})


def wrap_width(lines: list[str], lens: list[int] | None = None) -> int | None:
    """The width a terminal wrapped the log's lines at (see WRAP_MIN_WIDTH), or None when nothing says it was; `lens`,
    when given, are the lines' lengths."""
    if len(lines) < 2:
        return None
    lens = list(map(len, lines)) if lens is None else lens
    width = max(lens)
    count = lens.count(width)
    # A short capture: one or two lines at a common window's width, each followed by the rest of a word (a cut mid-word
    # or mid-path: no capital or indent where the next line starts).
    few = width in TERMINAL_WIDTHS and count < WRAP_MIN_COUNT
    if not WRAP_MIN_WIDTH <= width <= WRAP_MAX_WIDTH or (count < WRAP_MIN_COUNT and not few) or count < WRAP_SHARE * len(lines):
        return None
    at = [i for i, n in enumerate(lens) if n == width]
    at = [i for i in at[::max(1, len(at) // WRAP_SAMPLE)] if len(set(lines[i])) > 2]  # (an even sample of them on a long
    # log; not a `=====` rule, which is a banner's width)
    if len({lines[i] for i in at}) < (count if few else WRAP_MIN_COUNT):
        return None  # one long line printed again and again, not a window's width
    if few and not all(i + 1 < len(lines) and lines[i + 1][:1] and not lines[i + 1][0].isupper() and not lines[i + 1][0].isspace()
                       for i in at):
        return None  # a line that happens to be a window's width, then one that starts as a line does (`Traceback ...`)
    cut = sum(1 for i in at if not lines[i][-1].isspace())
    # Records printed to one width (a fixed-format line per step, a table's rows) are followed by more of the same: the
    # next line starts as they do. A wrapped line's continuation starts wherever the window cut it.
    alike = sum(1 for i in at if i + 1 < len(lines) and _start(lines[i + 1], 2) == _start(lines[i], 2))
    if cut * 2 <= len(at) or alike * 2 >= len(at):
        return None
    # Records printed to one width between other lines (`Ave Loss tensor(1.1198, ...)` then `Epoch 2 begin...`): the
    # line after each is blank or one that starts other lines of the log too. A continuation starts like no other line.
    after = set(i + 1 for i in at)
    step = max(1, len(lines) // WRAP_SAMPLE)  # (how lines start, from an even sample of a long log's lines)
    starts = {_start(lines[k], WRAP_START) for k in range(0, len(lines), step) if k not in after and lines[k].strip()}
    usual = sum(1 for i in after if i < len(lines) and (not lines[i].strip() or _start(lines[i], WRAP_START) in starts))
    return width if usual * 2 < len(after) else None


def _start(line: str, n: int) -> str:
    """How a line starts, its numbers as one digit (`10       1.70` starts as `1        2.42` does)."""
    return _WRAP_DIGITS.sub("0", line[:n + 12])[:n]


WRAP_START, WRAP_SAMPLE = 6, 400
_WRAP_DIGITS = re.compile(r"\d+")


def _unwrap(lines: list[str], width: int) -> list[str]:
    """Each line of exactly `width` characters joined with the lines that continue it, at the first line's place; the
    continuation lines left empty (the list keeps its length: line numbers stay the file's)."""
    out = list(lines)
    i = 0
    while i < len(out) - 1:
        if len(lines[i]) == width:
            j = i + 1
            while j < len(lines) - 1 and len(lines[j]) == width:
                j += 1
            out[i] = "".join(lines[i:j + 1])
            for k in range(i + 1, j + 1):
                out[k] = ""
            i = j + 1
        else:
            i += 1
    return out


def clean_lines(lines: list[str]) -> list[str]:
    """clean_line over many lines at once: the escapes and prefixes removed by whole-text substitutions
    (the same result, far faster on a big log); lines with a carriage return are cleaned one by one."""
    return clean_lines_at(lines)[0]


def clean_lines_at(lines: list[str], wrap: int | None | bool = True) -> tuple[list[str], int | None]:
    """clean_lines, and the width the lines were unwrapped at. `wrap` True finds it (wrap_width); an int or None says
    it - a log streamed in chunks keeps its first chunk's answer, as one read whole has one answer for all its lines
    (a later chunk of Keras bars all 97 characters wide is no terminal's wrap)."""
    text = "\n".join(lines)
    if "\x08" in text:
        lines = [_BACKSPACES.sub("\r", ln) if "\x08" in ln else ln for ln in lines]
        text = "\n".join(lines)
    if "\r" in text:
        lines = [_last_segment(ln) if "\r" in ln else ln for ln in lines]
        text = "\n".join(lines)
    lens = list(map(len, lines))
    if lens and max(lens) > GLUED_MIN:
        changed = False
        for i in [i for i, n in enumerate(lens) if n > GLUED_MIN]:
            if (redrawn := _unglue(lines[i])) is not lines[i]:
                if not changed:
                    lines, changed = list(lines), True
                lines[i] = _last_segment(redrawn)
        if changed:
            text = "\n".join(lines)
            lens = list(map(len, lines))
    width = wrap_width(lines, lens) if wrap is True else wrap
    if width is not None:
        lines = _unwrap(lines, width)
        text = "\n".join(lines)
    if "\x1b" in text or "[" in text:
        text = _ANSI.sub("", text)
    text = _PREFIXES_AT_START.sub("", text)
    out = text.split("\n")
    return (out if len(out) == len(lines) else [clean_line(ln) for ln in lines]), width


def key_kind(key: str) -> str | None:
    """What a key outside metric_keys carries, by its name: 'loss', 'eval_loss', 'grad_norm', 'loss_scale', 'kl', 'ppl',
    'reward', 'acc', 'q' or None (a reward or an accuracy only marks its record: see _assign; a Q value, like a
    perplexity, only tells weights that move from a loss print that does not).

    `mtp 1 loss`, `value loss`, `actor pg loss`, `loss a` are losses; `model grad norm`, `grad norm actor`
    grad norms; `grad scale`, `loss scaler`, `scaler`, `scale_g` loss scales; `kl`, `approx kl` a KL (checked for
    NaN only). Config-like names (`max grad norm`, `init loss scale`, `kl coef`, `loss weight`) are
    settings, not measurements (and a best-so-far tracker's starting +inf is no loss, see _assign); a statistic after the name (`actor loss median`) is still the metric.
    `ppl`, `valid perplexity`: exp(loss), printed with more digits than the loss beside it (read only to tell
    a loss rounded to the same print from weights that stopped moving).
    """
    toks = normalise_key(_CAMEL.sub(" ", str(key))).split()  # DecoderLoss -> decoder loss
    if not toks or toks[0] in _SETTING_FIRST or any(t in _SETTING_WORDS for t in toks) or len(toks) > 6:
        return None
    if toks[0] == "kl" or toks[-1] == "kl" or "kl" in toks[:2] and "div" in toks:
        return "kl"
    if any(t in _REWARD_WORDS for t in toks):
        return "reward"
    if "explained" in toks and ("variance" in toks or "var" in toks):
        return "ev"
    if any(t == "losses" or t.endswith("loss") or (t in _LOSS_NAMES and (t != "cost" or t == toks[-1])) for t in toks) or (
            "crossentropy" in toks or "cross" in toks and "entropy" in toks) or (  # MXNet's Train-cross-entropy
            toks[0] == "l" and (len(toks) == 1 or toks[1] not in ("r", "rate"))):  # `L=0.34 D=0.33`, BasicSR's l_pix, L_total
        if "scale" in toks or "scaler" in toks:
            return "loss_scale"
        return "eval_loss" if any(t in ("eval", "val", "valid", "validation", "test", "dev") for t in toks) else "loss"
    if "ppl" in toks or "perplexity" in toks:
        return "ppl"
    if "acc" in toks or "accuracy" in toks:
        return "acc"
    if "q" in toks and any(t in ("value", "values", "mean", "avg", "max", "taken") for t in toks):
        return "q"  # a value network's estimate (`Mean Q Value 4435.121`, pymarl's q_taken_mean): a model output
    if any(t.startswith("grad") for t in toks) and any(t.endswith("norm") for t in toks) or "gnorm" in toks:
        return "grad_norm"
    # scale_g / scale_d: a GAN's two AMP scalers, one per network
    if toks in (["scale"], ["scaler"]) or ("scale" in toks and len(toks) == 2 and any(len(t) == 1 for t in toks)) or (
            "scale" in toks and any(t in ("grad", "amp", "fp16", "scaler") for t in toks)):
        return "loss_scale"
    return None


_CAMEL = re.compile(r"(?<=[a-z])(?=[A-Z])")
# Objectives printed under their own names, not "loss": negative log-likelihood, binary cross-entropy,
# cross-entropy as `xent`, CTC, bits per dimension, a cost (the key's last word: "the cost of 6 cards", a math problem an
# RL run prints among its samples, is prose). MSE is left out: scripts print it as an evaluation
# score after training (`CNN - MSE: 0.0044`) as often as a training loss, and those prints would count as records.
_LOSS_NAMES = frozenset({"nll", "bce", "xent", "ctc", "bpd", "cost"})
# A reward or return beside a loss marks a reinforcement-learning trainer's record (SB3's rollout/ep_rew_mean, TRL's
# reward, verl's critic/rewards/mean, CleanRL's episodic_return). Its losses are a weaker measure of progress: a
# value loss tracks the returns, which grow as the policy improves, so a rise must reach rl_rise_factor, and a
# signed surrogate (a policy-gradient loss around 0) has no spikes or rise (signals.NumberRules.signed).
_REWARD_WORDS = frozenset({"reward", "rewards", "rew", "return", "returns", "eprewmean"})
# A policy-gradient or value loss marks a reinforcement-learning trainer's record as a reward does, when the record
# names no reward (`ploss=-0.0083 vloss=   11.3 ent=1.143`, SB3's train/value_loss, CleanRL's losses/value_loss).
_RL_LOSS_WORDS = frozenset({"vloss", "ploss", "pgloss"})
_RL_LOSS_BEFORE = frozenset({"value", "policy", "pg", "vf", "actor"})


@lru_cache(maxsize=4096)
def _rl_loss(key: str) -> bool:
    toks = key.split()
    return any(t in _RL_LOSS_WORDS for t in toks) or any(
        a in _RL_LOSS_BEFORE and b in ("loss", "losses") for a, b in zip(toks, toks[1:]))


_SETTING_FIRST = {"max", "min", "clip", "init", "initial", "target", "use", "enable"}
_SETTING_WORDS = {"clipping", "threshold", "coef", "coeff", "weight", "lr", "time", "ms", "sec", "window", "factor", "power"}


@dataclass(slots=True)
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
    epoch: float | None = None  # HF's fractional epoch, Lightning's "Epoch 3": a run that starts over goes back
    run_end: float | None = None  # a run ended here: HF's end-of-training summary (its train_runtime), or 0.0 for a KeyboardInterrupt
    scale_cut: bool = False  # the loss scale was cut on this line (not merely reported)
    source: str = ""  # which reader found it: dict, json, pairs, table, scale-cut, tqdm
    named: dict[str, float] = field(default_factory=dict)  # normalised key -> value, for keys key_kind names
    loss_key: str = ""  # the key the loss was logged under (normalised): 'loss' and 'avg loss' are two series
    seen_as: int | None = None  # hash of the line as the readers saw it (clean_line): a redraw repeats it under a new timestamp
    rl: bool = False  # the record also logs a reward or return: a reinforcement-learning trainer's (see key_kind)
    reward: float | None = None  # ... and the first such value it logs
    ev: float | None = None  # the explained variance of the trainer's value head (PPO's), also an RL record's mark
    acc_full: bool = False  # the record also logs an accuracy at its ceiling (100 or 1.0): the model fits what it is scored on
    redraw: bool = False  # a progress bar's running mean mid-epoch (Keras' `14/49 [===>...] - ETA: 9s - loss: ...`)

    def has(self, name: str) -> bool:
        return getattr(self, name) is not None


@dataclass
class KeyMap:
    """Normalised key -> metric field, from the failure-signals table's metric_keys."""

    fields: dict[str, str] = field(default_factory=dict)
    _slots: dict[str, str | None] = field(default_factory=dict, repr=False)

    @classmethod
    def from_table(cls, metric_keys) -> "KeyMap":
        out: dict[str, str] = {}
        for name in FIELDS:
            for k in getattr(metric_keys, name):
                out[k] = name
        return cls(out)

    def field_of(self, key: str) -> str | None:
        return self.fields.get(normalise_key(key))

    def slot_of(self, key: str) -> str | None:
        """The Metric field a key fills, "kind:normalised key" for a named one, or None (cached per key)."""
        try:
            return self._slots[key]
        except KeyError:
            pass
        name = self.field_of(key)
        if name is None:
            kind = self.kind_of(key)
            name = f"{kind}:{normalise_key(key)}" if kind else None
        if len(self._slots) < 65536:
            self._slots[key] = name
        return name

    def kind_of(self, key: str) -> str | None:
        k = normalise_key(key)
        if k in self.fields:
            return None
        # "lm loss avg" / "train loss smoothed": a listed key with a statistic or suffix is a named series of it.
        # CamelCase is split before the case is folded: `LossTrajs` is `loss trajs`, `DecoderLoss` `decoder loss`.
        return _kind_cached(normalise_key(_CAMEL.sub(" ", key)) if _CAMEL.search(key) else k)


@lru_cache(maxsize=4096)
def _kind_cached(k: str) -> str | None:
    return key_kind(k)


def normalise_key(key: str) -> str:
    """'train/loss' -> 'train loss', "'grad_norm'" -> 'grad norm', '[Loss]' -> 'loss'."""
    return _normalise(str(key))


@lru_cache(maxsize=65536)
def _normalise(key: str) -> str:
    return _SPACES.sub(" ", _SEPARATORS.sub(" ", key).strip().lower())


_SEPARATORS = re.compile(r"[_/\-.\[\]'\"()]+")
_SPACES = re.compile(r"\s+")


_MSVC = re.compile(r"([-+]?)1\.#(qnan|snan|ind|inf)0*")


def to_number(value: Any) -> float | None:
    """A logged value as float: 'nan', '-inf', '7.1E-01', '1,024', 1e-5, or None when it is not a number."""
    if value.__class__ is str:
        try:
            return float(value)  # "0.71", "1e-05", "nan", "-inf", "Infinity": the common case, in C
        except ValueError:
            pass
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    s = str(value).strip().strip("'\"[]").replace(",", "").lower()
    if s in ("nan", "+nan", "-nan"):
        return math.nan
    if "#" in s and (msvc := _MSVC.fullmatch(s)):  # MSVC's 1.#QNAN, -1.#IND (NaN), 1.#INF, -1.#INF
        return math.nan if msvc.group(2) != "inf" else -math.inf if msvc.group(1) == "-" else math.inf
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
        key = f"{prefix} {k}".strip() if prefix else str(k)
        if isinstance(v, dict) or (not isinstance(v, (str, int, float)) and isinstance(v, Mapping)):
            yield from _flatten(v, key)
        else:
            yield key, v


def _objects_in(line: str) -> list[str]:
    """Balanced {...} substrings of a line, outermost first (a dict printed inside a tqdm redraw)."""
    if "{" not in line:
        return []
    if line.count("{") == 1 and line.count("}") == 1:
        a, b = line.index("{"), line.index("}")
        return [line[a:b + 1]] if a < b else []
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


# A flat Python-repr dict of numbers and strings (HF Trainer's log lines): read by one regex, not literal_eval.
_FLAT_VALUE = r"(?:" + _NUM + r"|'[^'\\]*'|None|True|False)"
_FLAT_DICT = re.compile(r"\{\s*(?:'[^'\\]*'\s*:\s*" + _FLAT_VALUE + r"\s*(?:,\s*|(?=\})))*\}", re.I)
_FLAT_ITEM = re.compile(r"'([^'\\]*)'\s*:\s*(" + _FLAT_VALUE + r")", re.I)


def _load_object(text: str) -> dict | None:
    if _FLAT_DICT.fullmatch(text):
        return {k: (v.strip("'") if v.startswith("'") else v) for k, v in _FLAT_ITEM.findall(text)}
    try:
        obj = json.loads(text)
    except ValueError:
        # Python reprs: single quotes, nan/inf as bare words, which literal_eval cannot read as numbers.
        try:
            obj = ast.literal_eval(_NONFINITE.sub(lambda m: repr(m.group(1)), text))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            # TypeError: a set of sets, as a Go panic's argument list prints (`stream.NewStream({{0x55fd1476, 0x28}, ...})`).
            return None
    return obj if isinstance(obj, dict) else None


def _assign(m: Metric, keys: KeyMap, key: str, value: Any) -> bool:
    name = keys.slot_of(key)
    if name is None:
        return False
    if ":" in name:
        if name.startswith("reward:"):
            m.rl = True
            if m.reward is None:
                m.reward = to_number(value)
            return False
        if name.startswith("ev:"):  # how well the value head predicts the returns (1 - Var(returns - values) / Var(returns))
            m.rl = True
            if m.ev is None:
                m.ev = to_number(value)
            return False
        if name.startswith("acc:"):  # not a metric of its own: it only tells a fitted zero loss from a broken one
            m.acc_full = m.acc_full or to_number(value) in (1.0, 100.0)
            return False
        num = to_number(value)
        if num is None or (num == math.inf and name.partition(":")[2].startswith(("best ", "lowest "))):
            return False  # a best-so-far tracker starts at +inf before any loss was computed
        if name.startswith("loss:") and _rl_loss(name[5:]):
            m.rl = True
        m.named.setdefault(name, num)
        return True
    if getattr(m, name) is not None:
        return False
    num = to_number(value)
    if num is None:
        return False
    setattr(m, name, num)
    if name == "loss":
        m.loss_key = normalise_key(key)
    return True


def _from_dicts(m: Metric, keys: KeyMap, line: str) -> bool:
    found = False
    if line.count("{") == 1:
        a, b = line.index("{"), line.find("}")
        if a < b and _FLAT_DICT.fullmatch(line, a, b + 1) and "'name'" not in line:
            # The common case, HF Trainer's flat dict of numbers: straight to the fields.
            for k, v in _FLAT_ITEM.findall(line, a, b + 1):
                found |= _assign(m, keys, k, v)
            return found
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


# A change report whose old value is +inf is a best-so-far tracker's first improvement (`loss decreases: inf -> 9.78`,
# Keras' `val_loss improved from inf to 0.52`): the inf is its start value, not a loss.
_FROM_INF = re.compile(r"\binf(?:inity)?\s*(?:->|→|=>|to\b)\s*[-+]?\.?\d", re.I)


# A key whose value is a list of different numbers (`{'loss': [2.3796, 2.3124, ...` - Keras' History.history printed
# after fit, on one line or many): every epoch's value at once, a summary; its first number is no loss of this step. A
# list of one value repeated is one value per parameter group (DeepSpeed's `lr=[0.001, 0.001]`) and stays.
_LIST_VALUE = re.compile(r"([:=]\s*)(\[\s*" + _NUM + r"(?:\s*,\s*" + _NUM + r")*\s*(?:,|\]))", re.I)


def _drop_history(m: re.Match) -> str:
    closed_one = m.group(2).endswith("]") and len(set(re.findall(_NUM, m.group(2), re.I))) == 1
    return m.group(0) if closed_one else m.group(1) + "[]"


def _from_pairs(m: Metric, keys: KeyMap, line: str) -> bool:
    found = False
    best = None
    if "[" in line:
        line = _LIST_VALUE.sub(_drop_history, line)
    for part in _SPLIT.split(line):
        for pm in _PAIR.finditer(part):
            if _SOURCE_FILE.search(pm.group("key")):
                continue  # `/home/u/E2DTC/losses.py:49: UserWarning`, glog's `cost_estimator.cc:699]`: a file and line
            val = pm.group("val")
            if val[-1] in "fFyY" and val[0] != "-":  # +inf: on a best-so-far report, the tracker's start value
                if best is None:
                    best = "best" in line.lower() or _FROM_INF.search(line) is not None
                if best:
                    continue  # `Best model found at epoch 0, Val Loss: inf` (no epoch ran): no loss was computed
            found |= _assign(m, keys, pair_key(pm.group("key")), val)
    return found


# Where a line is in the run, printed before a key with no separator of its own (TransReID's `Epoch[1]
# Iteration[50/186] Loss: 5.660`, MXNet's `Epoch[3] Train-SmoothL1=nan`): not part of the metric's name.
INDEX_HEAD = re.compile(r"^(?:[A-Za-z]+\s?\[\d+(?:/\d+)?\]\s*)+")


def pair_key(key: str) -> str:
    """A key as the pair reader found it, without the index head before it: `Epoch[1] Iteration[50/186] Loss`
    -> `Loss`, and after one, the last sentence of what is left (`Epoch[2] done. Loss` -> `Loss`)."""
    if "]" not in key:
        return key
    bare = INDEX_HEAD.sub("", key) if "[" in key else key
    if bare != key and bare:
        return bare.rsplit(". ", 1)[-1]
    if "] " in key and (after := key.rsplit("] ", 1)[1].strip()):
        return after  # a bracket closed before the name: `[ep 0 step 0 t= 5s vram= 5790MB] L=0.3462` -> `L`
    return key


_NUMBER_CELL = re.compile(r"(?:^|[|│\t])\s*[-+]?\.?\d")
# The pair reader runs only on lines that name a metric the table or key_kind can know.
_METRIC_WORD = re.compile("|".join(["loss", "norm", "scal", r"lr\b", "learning", "kl", "perplexity", "ppl", "step", "iter",
                                     "entropy", *sorted(_LOSS_NAMES)]), re.I)


# A CSV file's header (Keras' CSVLogger `epoch,loss,val_loss`, Lightning's metrics.csv, a trainer's log history
# exported by pandas, whose index column has no name): names and commas, no spaces.
_CSV_HEADER = re.compile(r"[A-Za-z_]?[\w/.\-]*(?:,[\w/.\-]*)+")


# srun --label's task number before a CSV row (`0: 3,0.52,0.61`): the prefix cleaner leaves a number before a
# number (`12: 0.5` may be a key and its value), but under a CSV header a row is one cell list, no spaces.
_TASK_LABEL = re.compile(r"^\s*\d{1,4}:[ \t]+(?=\S+$)")


# A space-aligned table's header (fastai's `epoch     train_loss  valid_loss  accuracy  time`): 3 to 12 names, two of
# them metrics the table knows; its rows are numbers, as many as the names, the first one a number.
_SPACED_HEADER = re.compile(r"(?:[A-Za-z_][\w/.\-]*[ \t]+){2,11}[A-Za-z_][\w/.\-]*")


class MetricTable:
    """A pipe-, tab- or comma-separated table: a header row of words, then rows of numbers; or a key | value
    table, one metric per row (Stable-Baselines3's and OpenAI baselines' logger), which is one record. It is the
    line readers' state across lines (and across a streamed log's chunks), so it also keeps the epoch the last
    `Epoch 3/10` line announced (see line_metrics)."""

    def __init__(self, keys: KeyMap):
        self.keys = keys
        self.columns: list[str | None] | None = None
        self.csv = False  # the header read was a CSV one: its rows have commas and no other separator
        self.epoch: float | None = None  # the epoch the last `Epoch 3/10` line announced
        self.evaluating = False  # the last progress line was an evaluation loop's (`Test: [10/242]`), not a training one's
        self.fit_closed = False  # Keras: the epoch the last `Epoch 3/10` announced printed its closing bar (see line_metrics)
        self.setting_indent: int | None = None  # inside a config dump's settings block (`LOSS_WEIGHTS:`): its header's indent
        self.spaced = False  # the header read was a space-aligned one (fastai's): its rows are split on whitespace
        self.vertical: Metric | None = None  # the open key | value table's record, given out when the table ends
        self._rows, self._quoted_bad = 0, False

    def _vertical_row(self, m: Metric, cells: list[str]) -> bool:
        """`|    value_loss   | nan   |`: the row's metric goes to the open key | value table's record, whose
        line and text are its first row's, or its first non-finite one's (what evidence should quote)."""
        key, cell = cells[0].strip(), cells[1]
        num = to_number(cell)
        if num is None or not key or to_number(key) is not None:
            return False
        rec = self.vertical
        if rec is None:
            rec = self.vertical = Metric(m.line, m.text, source="table")
            self._rows, self._quoted_bad = 0, False
        if _assign(rec, self.keys, key, cell):
            self._rows += 1
            if not math.isfinite(num) and not self._quoted_bad:
                rec.line, rec.text, self._quoted_bad = m.line, m.text, True
        return True

    def flush(self) -> Metric | None:
        """The open key | value table's record, when it carries a metric; the table is closed."""
        rec, self.vertical = self.vertical, None
        if rec is None or not carries(rec):
            return None
        rec.seen_as = hash((rec.text, self._rows, tuple(rec.named.items()), rec.loss, rec.grad_norm, rec.step))
        return rec

    def _sep(self, line: str) -> str | None:
        if line.count("|") >= 2:
            return "|"
        if "\t" in line:
            return "\t"
        if "," in line and " " not in line.strip() and ((self.csv and self.columns is not None) or _CSV_HEADER.fullmatch(line.strip())):
            return ","
        return None

    def feed(self, m: Metric, line: str) -> bool:
        if self.csv and self.columns is not None:
            line = _TASK_LABEL.sub("", line)
        if self.spaced:
            cells = line.split()
            if self.columns is not None and len(cells) == len(self.columns) and to_number(cells[0]) is not None:
                return self._row(m, cells)
            if cells and not any(c.isdigit() for c in line) and self._known(cells).count(None) > len(cells) - 2:
                return False  # a message between rows (DomainBed's "Best model upto now"), no new header: the table goes on
            self.columns, self.spaced = None, False  # the space-aligned table ended
        sep = self._sep(line)
        if sep is None:
            self.columns = None
            if ":" not in line and "=" not in line and _SPACED_HEADER.fullmatch(line.strip()):
                known = self._known(line.split())
                if known.count(None) <= len(known) - 2:
                    self.columns, self.spaced = known, True  # fastai's `epoch  train_loss  valid_loss  accuracy  time`
            return False
        cells = [c.strip() for c in line.strip().strip("|").split(sep)]
        if sep == "|" and self.columns is None and len(cells) == 2 and self._vertical_row(m, cells):
            return False  # the row went to the table's one record (see flush)
        if not _NUMBER_CELL.search(line) and all(to_number(c) is None for c in cells if c) and any(
                self.keys.field_of(c) or self.keys.kind_of(c) for c in cells):
            self.columns = self._known(cells)
            self.csv = sep == ","
            return False
        if self.columns is None or len(cells) != len(self.columns):
            return False
        return self._row(m, cells)

    def _known(self, cells: list[str]) -> list[str | None]:
        """A header's cells, each kept where the table's keys know it as a metric or a field, None where not."""
        return [c if (self.keys.field_of(c) or self.keys.kind_of(c)) else None for c in cells]

    def _row(self, m: Metric, cells: list[str]) -> bool:
        found = False
        for key, cell in zip(self.columns, cells):
            if key and to_number(cell) is not None:
                found |= _assign(m, self.keys, key, cell)
        return found


def parse_line(m: Metric, keys: KeyMap, line: str, table: MetricTable | None = None) -> Metric:
    """Fill `m` from one (cleaned) line with every reader that applies; the first value found per field wins."""
    if "KeyboardInterrupt" in line and _INTERRUPTED.search(line):
        m.run_end = 0.0  # the run was stopped by hand: what a notebook logs after it is a resumed or new run
        return m
    if _from_dicts(m, keys, line):
        m.source = "dict"
        if m.epoch is None and m.step is None and 0 < (brace := line.find("{")) <= 40:
            _from_pairs(m, keys, line[:brace])  # `Epoch 3: {'loss': 1.17}`: the index is printed before the dict
    if table is not None and table.feed(m, line):
        m.source = m.source or "table"
    cut = _SCALE_CUT.search(line) if ("educ" in line or "EDUC" in line or "adjusted to" in line) else None
    if cut and m.loss_scale is None:
        m.loss_scale, m.scale_cut, m.source = to_number(cut.group(1)), True, m.source or "scale-cut"
    if not m.source and " rate," in line and (dn := _DARKNET.match(line)):
        m.step, m.loss, m.lr, m.source = float(dn.group(1)), to_number(dn.group(3)), to_number(dn.group(4)), "darknet"
        return m
    if not m.source and "('" in line:
        # An OrderedDict or a list of (name, value) tuples printed whole: `OrderedDict([('loss', 0.0377)])`.
        found = False
        for k, v in _TUPLE_PAIR.findall(line):
            found |= _assign(m, keys, normalise_key(k), v)
        if found:
            m.source = "tuples"
    if not m.source and (" at " in line or " from " in line or " for " in line) and (at := _AT_STEP.search(line)) and _assign(
            m, keys, at.group("key"), at.group("val")):
        # `Training average loss at step 15000: 0.091801` (KGE trainers, RotatE's logging), `Average loss from batch
        # 51 to 100 is 8.84` (DuReader's baselines), `Loss on train for epoch 3: 0.99`: the number after the step word
        # is where the run is, the one after the colon or "is" the metric (the pair reader would take the step).
        setattr(m, "epoch" if at.group("unit").lower() == "epoch" else "step", float(at.group("n")))
        m.source = "pairs"
    if not m.source and _METRIC_WORD.search(line) and _from_pairs(m, keys, line):
        m.source = "pairs"
    if m.step is None and (m.loss is not None or m.grad_norm is not None or m.eval_loss is not None or m.named):
        t = (_TQDM_STEP.search(line) or _COUNTED_STEP.search(line)) if "/" in line else None
        if t is None and "Dropping entry" in line:
            t = _WANDB_DROPPED.search(line)
        if t:
            m.step = float(t.group(1))
    return m


def carries(m: Metric) -> bool:
    return bool(m.named or m.loss is not None or m.eval_loss is not None or m.grad_norm is not None or m.lr is not None
                or m.loss_scale is not None or m.run_end is not None)


def parse_text(text: str, keys: KeyMap, *, lines: list[str] | None = None, cleaned: list[str] | None = None,
               code: set[int] | None = None) -> list[Metric]:
    """Every line of a log that carries a known metric, in log order (a whole trainer_state.json too).
    A caller that already split and cleaned the text passes its lines, their clean_lines and their code_lines."""
    whole = _load_object(text.strip()) if text.lstrip().startswith("{") else None
    if whole is not None and isinstance(whole.get("log_history"), list):
        return parse_records(whole["log_history"], keys)
    lines = split_lines(text) if lines is None else lines
    cleaned = clean_lines(lines) if cleaned is None else cleaned
    code = code_lines(cleaned) if code is None else code
    return dedupe(list(line_metrics(lines, cleaned, code, keys, MetricTable(keys), end=True)))


def line_metrics(lines: list[str], cleaned: list[str], code: set[int], keys: KeyMap, table: MetricTable,
                 first_line: int = 1, end: bool = True) -> Iterator[Metric]:
    """The Metric of each line that carries one, in order, not yet deduplicated: `cleaned` are the lines as
    clean_lines gives them, `code` the indices IPython printed as source (skipped), `table` the table reader's
    state (kept across the chunks of a streamed log), `first_line` the number of lines[0] in the whole log,
    `end` whether these are the log's last lines (a key | value table still open there is given out)."""
    for i, clean in enumerate(cleaned):
        if table.vertical is not None and "|" not in clean and (rec := table.flush()) is not None:
            yield rec  # a key | value table ends at its closing rule
        if len(clean) < 40 and "poch" in clean and (head := _EPOCH_HEADER.match(clean)) and i not in code:
            table.epoch = float(head.group(2))  # Keras' `Epoch 3/10`: the records under it are that epoch's
            table.fit_closed = False
            continue
        if i in code or (not clean and lines[i]):
            continue  # (a line the cleaner emptied - a wrapped line's continuation, joined to the line before - is no gap)
        if table.setting_indent is not None:
            if len(clean) - len(clean.lstrip()) > table.setting_indent:
                continue  # a value under a settings block's header (`  LOSS_WEIGHTS:` / `    loss_jloc: 8.0`)
            table.setting_indent = None
        if ":" in clean[-2:] and (head := _SETTING_HEADER.match(clean)) and any(
                w in _SETTING_WORDS or w[:-1] in _SETTING_WORDS for w in normalise_key(head.group(2)).split()):
            table.setting_indent = len(head.group(1))
            continue
        if not may_carry(clean, table):
            # A line of carriage-return redraws shows its last bar (`Validating: 100%|...|`); the training bar
            # before it, whose postfix held the epoch's last loss (`Training: 100%|...| 293/294 [..., loss=0.0687]`),
            # is a record all the same.
            raw = lines[i]
            if ("\r" not in raw or ("loss" not in raw and "Loss" not in raw)  # (cheap tests first: most bars log no loss)
                    or not (clean := _earlier_bar(raw)) or not may_carry(clean, table)):
                continue
        if clean[:1] in "TtVvEe[" and (phase := _PHASE.match(clean)):
            table.evaluating = phase.group(1) is not None or phase.group(2) is not None
        keras_eval, bar = False, None
        if clean[:8].lstrip()[:1].isdigit() and (bar := KERAS_BAR.match(clean)) and table.epoch is not None:
            # Keras: a progress bar after the epoch's closing bar (`49/49 [====] - 35s 719ms/step - loss: ...`) with
            # no `Epoch N/M` line between is a model.evaluate() or predict() after fit, not a training step.
            keras_eval = table.fit_closed
            if bar.group(1) == bar.group(2) and "/step" in clean:
                table.fit_closed = True
        m = parse_line(Metric(i + first_line, lines[i], seen_as=hash(clean)), keys, clean, table)
        if bar is not None and (" ETA: " in clean or bar.group(1) != bar.group(2)):
            m.redraw = True  # a bar before its epoch's last batch: Keras 2 says ETA, Keras 3 the time left (`36s`)
        if carries(m):
            if m.epoch is None:
                m.epoch = table.epoch
            if table.evaluating or keras_eval or _CAFFE_TEST.match(clean):
                _as_evaluation(m)
            yield m
    if end and (rec := table.flush()) is not None:
        yield rec  # the log ended inside a key | value table


# The progress lines of the loops pytorch/examples' ImageNet script made common (MoCo, DeiT, timm's, many forks): a
# training step's `Epoch: [77][180/250]  Time ...  Loss 0.5166`, an evaluation step's `Test: [10/242]  ...  Loss 5.85`.
# The records printed from an evaluation line until the next training line (the test loop's other meters, on lines
# of their own) are the evaluation's: a test loss on other data is no point of the training curve.
# A YAML config dump's mapping header with no value whose name is a setting's (`LOSS_WEIGHTS:`, `loss_coefs:`): the
# `loss_jloc: 8.0` lines indented under it are the weights of the losses, not losses.
_SETTING_HEADER = re.compile(r"([ \t]*)([A-Za-z_][\w.\-]*)[ \t]*:[ \t]*$")
_PHASE = re.compile(r"(?:(Test|Val|Validation|Eval|Evaluation)|Epoch)\s*:\s*\[\s*\d+"
                    r"|\[(?:(Eval|Evaluation|Test|Val|Valid|Validation)|Train|Training)\]\[", re.I)


# Caffe's solver prints each test net's outputs on a line of their own (`Test net output #1: softmax_loss = 1.13505 (* 1 =
# 1.13505 loss)`), under the same names as the train net's (`Train net output #0: softmax_loss = 5.56`): a test loss.
_CAFFE_TEST = re.compile(r"\s*Test net output #\d+:")


def _as_evaluation(m: Metric) -> None:
    """An evaluation loop's record: its losses are evaluation losses (checked for NaN/inf, not read as a curve)."""
    if m.loss is not None:
        if m.eval_loss is None:
            m.eval_loss = m.loss
        m.loss, m.loss_key = None, ""
    if m.named:
        m.named = {("eval_loss:" + k.partition(":")[2] if k.startswith("loss:") else k): v for k, v in m.named.items()}


# A line that only announces the epoch its next records belong to (Keras' model.fit, many plain loops).
_EPOCH_HEADER = re.compile(r"\s*(\[)?Epoch\s*:?\s*(\d+)\s*/\s*\d+(?(1)\])\s*:?\s*$", re.I)  # bracketed or not
# Keras' progress bar: `14/49 [=====>.....] - ETA: 9s - loss: ...` (Keras 2), `14/49 ━━━━━━━━━━ 9s ...` (Keras 3; drawn
# with `=` where the console cannot show ━, a Windows PowerShell capture), with srun's task label before it
# (`0: 19/19 [====...`: the label stays on a line that starts with a number).
KERAS_BAR = re.compile(r"\s*(?:\d{1,4}:\s+)?(\d+)/(\d+) (?:\[[=>.]+\]|[━─]+|=+ )")


# IPython's traceback frame header: IPython 8's `File /x/trainer.py:2555, in Trainer._inner_training_loop(...)` and
# `Cell In[5], line 12`, IPython 7's `/x/module.py in _call_impl(...)` and `<ipython-input-5-1a2b> in <module>`.
# Under one, IPython prints the lines around the one running, numbered, and marks that one with an arrow
# (`-> 2556`, `---> 2556`). Its neighbours were not running: HF Trainer's `# if loss is nan or inf ...` comment,
# printed beside an interrupted training step, is no NaN loss. (Python's own traceback prints only the line
# that ran - a `raise ...("NaN loss")` there is evidence - and the arrow line is kept too.)
_FRAME_HEAD = re.compile(r"[ \t]*(?:File \S[^\n]*?:\d+, in .*|Cell In ?\[\d*\], line \d+.*"
                         r"|\S[^\n]*?(?:\.py|<ipython-input-[\w-]*>) in [\w<>.]+\(.*)")
_NUMBERED = re.compile(r"[ \t]*(-+>)?[ \t]*\d+[ \t]")
_FRAME_LINES = 30


def code_lines(clean: list[str], text: str | None = None) -> set[int]:
    """The 0-based indices of the lines IPython shows around a frame's running line (see _FRAME_HEAD)."""
    text = "\n".join(clean) if text is None else text
    out: set[int] = set()
    at: set[int] = set()  # the starts of the lines that may be a header: found by two scans in C
    pos = text.find(" in ")
    while pos >= 0:
        if text[pos - 1] == "," or text[pos - 1] == ">" or text[pos - 3:pos] == ".py":
            at.add(text.rfind("\n", 0, pos) + 1)
        pos = text.find(" in ", pos + 4)
    pos = text.find("Cell In")
    while pos >= 0:
        at.add(text.rfind("\n", 0, pos) + 1)
        pos = text.find("Cell In", pos + 7)
    line, last = 0, 0
    for start in sorted(at):
        line += text.count("\n", last, start)
        last = start
        if not _FRAME_HEAD.fullmatch(clean[line]):
            continue
        for j in range(line + 1, min(line + 1 + _FRAME_LINES, len(clean))):
            n = _NUMBERED.match(clean[j])
            if n is None:
                break
            if n.group(1) is None:
                out.add(j)
    return out


# Outside a table, a line carries a metric only if it names one, holds a dict or cuts the loss scale
# (the words of _METRIC_WORD, as plain substrings).
_CARRY_WORDS = ("loss", "norm", "scal", "lr", "learning", "kl", "perplexity", "ppl", "step", "iter", "entropy", *sorted(_LOSS_NAMES),
                "{", "educ", "keyboardinterrupt", " rate,")
# Python's exception line for Ctrl-C (or a notebook's stop button), as the traceback ends it, and Lightning's
# warning when it catches one.
_INTERRUPTED = re.compile(r"^\W*(?:\[rank\d+\]:\s*)?KeyboardInterrupt\b|Detected KeyboardInterrupt, attempting graceful shutdown")


_CARRY = re.compile("|".join(re.escape(w) for w in _CARRY_WORDS))


def may_carry(clean: str, table: "MetricTable") -> bool:
    """False for a line no reader can take a metric from (most lines of a big log), or one that prints a
    setting (is_setting); a line with no separator ends a table."""
    if table.spaced and table.columns is not None:
        return True  # a row of a space-aligned table, or the line that ends it (MetricTable.feed decides)
    if "|" not in clean and "\t" not in clean and "│" not in clean and not (table.csv and "," in clean):
        table.columns = None
    elif table.columns is not None:
        return not is_setting(clean)  # a row of the table whose header was read
    elif clean.count("|") == 3 and clean.lstrip().startswith("|"):
        return True  # a key | value table's row: a reward row marks the record, whatever its key
    # One search of the lowered line for an alternation of literals: cheaper than a case-insensitive regex, and
    # than one `in` per word, on every line of a big log.
    return _CARRY.search(clean.lower()) is not None and not is_setting(clean)  # a header names a metric too


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
        if carries(m):
            out.append(m)
    return out


def dedupe(metrics: list[Metric]) -> list[Metric]:
    """Drop a record that repeats the one before it (tqdm redraws print the same step's numbers twice)."""
    out: list[Metric] = []
    for m in metrics:
        prev = out[-1] if out else None
        if prev is not None and same_record(prev, m):
            continue
        out.append(m)
    return out


def same_record(a: Metric, b: Metric) -> bool:
    """Whether b repeats a (the same step's numbers, as a tqdm redraw prints them twice); Keras' last batch of
    each epoch (`211/211 ... loss: inf`) is another record when the epoch differs, and so is the same line under
    another epoch's header (`[Epoch 4/50]` then `Train Loss: nan, Train Acc: 0.1`, as under `[Epoch 3/50]`)."""
    if a.epoch is not None and b.epoch is not None and a.epoch != b.epoch:
        return False
    if a.step is None or b.step is None or a.step != b.step:
        if a.step is not None and b.step is not None and "%|" in a.text and "%|" in b.text and _same_numbers(a, b):
            # tqdm redraws its bar on a timer and its postfix only when the loop sets it: with the carriage returns
            # turned into line ends (a CI runner's log, a notebook export), one postfix shows on many steps' redraws.
            return True
        return _seen(a) == _seen(b)
    return _same_numbers(a, b)


def _same_numbers(a: Metric, b: Metric) -> bool:
    return all(_eq(getattr(a, f), getattr(b, f)) for f in ("loss", "grad_norm", "eval_loss", "epoch")) and (
        a.named.keys() == b.named.keys() and all(_eq(a.named[k], b.named[k]) for k in a.named))


def _seen(m: Metric) -> int:
    """The line as the readers saw it (a record built without one: its text)."""
    return hash(m.text) if m.seen_as is None else m.seen_as


def _eq(x: float | None, y: float | None) -> bool:
    if x is None or y is None:
        return x is y
    return x == y or (math.isnan(x) and math.isnan(y))


def log_encoding(head: bytes) -> str:
    """The encoding of a log from its first bytes: a BOM says it (PowerShell's `>` and Out-File write UTF-16 LE
    with one; Notepad may add UTF-8's), and so do NULs in every other byte of a UTF-16 log that lost its BOM;
    anything else is UTF-8, where a byte that is not UTF-8 is replaced (a GBK table stays readable around it)."""
    if head.startswith(codecs.BOM_UTF8):
        return "utf-8-sig"
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "utf-16"
    pairs = len(head) // 2
    if pairs >= 8:
        odd, even = head[1:2 * pairs:2].count(0), head[0:2 * pairs:2].count(0)
        if odd >= 0.4 * pairs and even <= 0.05 * pairs:
            return "utf-16-le"
        if even >= 0.4 * pairs and odd <= 0.05 * pairs:
            return "utf-16-be"
    return "utf-8"


def decode_log(data: bytes) -> str:
    """A whole log's bytes as text, in the encoding log_encoding reads off its start."""
    return data.decode(log_encoding(data[:4096]), errors="replace")


def split_lines(text: str) -> list[str]:
    """Lines as editors and grep -n number them: split on \\n only (tqdm redraws with bare \\r inside a line), without
    the carriage returns that end them (Python on Windows writing "\\r\\n" through a text-mode file ends a line "\\r\\r\\n")."""
    out = text.split("\n")
    if out and out[-1] == "":
        out.pop()
    return [ln.rstrip("\r") if ln.endswith("\r") else ln for ln in out]
