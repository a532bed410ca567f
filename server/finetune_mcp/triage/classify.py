"""The verdict: weigh what signals found into a class with a confidence, the runner-up, verbatim evidence and what evidence is missing.

Rules (SKILL.md#failure-signals): the highest-priority signal decides its class, ties to the earliest
line; a log that failed (traceback, exception, kill, non-zero exit) never reads `none` unless the only
stop is one someone asked for - a failure no signal names gets the table's fallback class by its
exception type, at low confidence; a log with no failure and no failure signal is healthy. A verdict
of oom that rests on a kill alone (SIGKILL, exit 137) is weak when memory in use was far below the
limit: its confidence is capped and it says what is missing.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace

from finetune_mcp.skilltables import CURVE_RULES
from finetune_mcp.triage.signals import Findings, Hit, compiled, fallback_rule, find, find_file, find_in_records

FAILURE_CLASSES = ("environment", "divergence", "oom")
# The runner-up when no other class has any evidence: the nearest alternative, with what would make it so.
ALTERNATIVE = {
    "oom": ("environment", "no other class has evidence; a kill or allocator failure can also come from the platform "
                           "(another process holding the memory, a driver fault)"),
    "environment": ("oom", "no other class has evidence; setup errors often surface while loading a model, when memory is also tightest"),
    "divergence": ("environment", "no other class has evidence; broken numbers can come from a library or kernel bug rather than the config"),
    "none": ("divergence", "no other class has evidence; a slowly drifting curve fires no rule"),
}
MAX_EVIDENCE = 12
# A class with several distinct signals is a little surer than with one; capped so that many weak
# signals never outrank one strong one of another class.
EXTRA_SIGNAL_BONUS, EXTRA_SIGNAL_CAP = 2, 6
# A kill with memory far below the limit still reads oom (nothing else names a cause), but no surer than this.
KILL_FAR_BELOW_CONFIDENCE = 0.35


@dataclass
class RunnerUp:
    failure_class: str
    confidence: float
    why: str


@dataclass
class Classification:
    """What triage concluded about one log (or one list of progress records).

    evidence: (line number, line) pairs copied verbatim from the log, 1-based; for records, the
    record's position and the record as JSON. signals: every signal id that matched, the deciding
    one first. check_id: the preflight check to re-run (environment only). healthy_or_unrecognised:
    for class none, "healthy" or "stopped" (a stop someone asked for). confidence: 0-1, how far the
    deciding evidence stands above the rest (a ranking heuristic, not a calibrated probability).
    """

    failure_class: str
    reason: str
    evidence: list[tuple[int, str]] = field(default_factory=list)
    signals: list[str] = field(default_factory=list)
    check_id: str | None = None
    healthy_or_unrecognised: str | None = None
    confidence: float = 0.0
    runner_up: RunnerUp | None = None
    missing_evidence: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["evidence"] = [{"line": n, "text": t} for n, t in self.evidence]
        return d


def _score(hits: list[Hit]) -> int:
    top = max(h.signal.priority for h in hits)
    return top + min(EXTRA_SIGNAL_CAP, EXTRA_SIGNAL_BONUS * (len({h.id for h in hits}) - 1))


def _confidence(win: int, runner: int) -> float:
    c = 0.3 + 0.6 * win / 100 + 0.3 * max(0, win - runner) / 100
    return round(min(0.99, max(0.05, c)), 2)


def _order(hits: list[Hit]) -> list[Hit]:
    return sorted(hits, key=lambda h: (-h.signal.priority, h.first))


def _evidence(hits: list[Hit], extra: list[tuple[int, str]] = ()) -> list[tuple[int, str]]:
    seen: dict[int, str] = {}
    for h in hits:
        for n, t in h.lines:
            seen.setdefault(n, t)
    for n, t in extra:
        seen.setdefault(n, t)
    return sorted(seen.items())[:MAX_EVIDENCE]


def _check_for(sig, platform: str | None) -> str | None:
    check = getattr(sig, "check", None)
    if check is None:
        return None
    return check.spark if platform == "dgx-spark" else check.generic


def _metrics_summary(f: Findings) -> dict:
    if f.summary is not None:
        return dict(f.summary)
    losses = [m.loss for m in f.metrics if m.loss is not None and math.isfinite(m.loss)]
    grads = [m.grad_norm for m in f.metrics if m.grad_norm is not None and math.isfinite(m.grad_norm)]
    scales = [m.loss_scale for m in f.metrics if m.loss_scale is not None and math.isfinite(m.loss_scale)]
    out: dict = {"records": len(f.metrics), "losses": sum(m.loss is not None for m in f.metrics)}
    tail = 0
    for m in f.metrics:
        if m.loss is not None:
            tail = 0 if math.isfinite(m.loss) else tail + 1
    if tail:
        out["loss_nonfinite_at_end"] = tail
    if losses:
        out.update(loss_first=losses[0], loss_min=min(losses), loss_last=losses[-1])
    if grads:
        out["grad_norm_max"] = max(grads)
    if scales:
        out["loss_scale_last"] = scales[-1]
    return out


def _has_metrics(f: Findings) -> bool:
    return bool(f.summary["records"]) if f.summary is not None else bool(f.metrics)


def _missing(cls: str, deciding: list[Hit], f: Findings, fallback: bool) -> list[str]:
    out: list[str] = []
    if fallback:
        out.append("no line names the failing component (a package, driver, file, memory or the numbers); "
                   "the exception type alone decides - read the error lines shown")
    if f.traceback_cut:
        out.append("the traceback ends before its exception line - the log (or the excerpt) is cut short")
    if len({h.id for h in deciding}) == 1 and getattr(deciding[0].signal, "confirm", None):
        out.append(deciding[0].signal.confirm)
    if cls == "divergence" and not _has_metrics(f):
        out.append("no loss or grad-norm values were parsed; the verdict rests on words, not on the curve")
    if cls == "divergence" and all(h.signal.records_rule for h in deciding) and not (f.markers or f.exception):
        out.append("no error line - the verdict rests on the logged numbers; the run's config (precision, learning rate) names the cause")
    if cls == "none" and not _has_metrics(f):
        out.append("no loss values were found to check the curve; only the absence of failure lines says healthy")
    if f.exit_code is None and f.exit_signal is None and cls == "oom":
        out.append("the run's exit status is not known (a bare log): exit 137 / -9 would confirm a kill")
    if f.exit_code is None and f.exit_signal is None and cls == "none":
        out.append("the run's exit status is not known (a bare log): a kill or non-zero exit would change the verdict")
    return out


def _kill_only(deciding: list[Hit]) -> bool:
    """The oom verdict rests on a kill alone (a SIGKILL, exit 137), no allocator or OOM-killer record."""
    return all(getattr(h.signal, "explained_by_stop", False) for h in deciding)


def _memory_note(memory: dict | None, table) -> tuple[str, bool]:
    """(what the memory reading says about a kill, whether it rules the OOM killer out as the likely sender)."""
    used, limit = (memory or {}).get("used_gb"), (memory or {}).get("limit_gb")
    if not isinstance(used, (int, float)) or not isinstance(limit, (int, float)) or limit <= 0:
        return ("the memory in use when the run was killed is not known (progress mem_gb, dmesg, sacct MaxRSS): "
                "a kill with memory far below the limit is not an OOM", False)
    frac = used / limit
    far = frac < table.records.kill_memory_fraction
    return (f"memory in use near the kill was {used:g} of {limit:g} GB ({frac:.0%})"
            + (f", far below the limit (under {table.records.kill_memory_fraction:.0%}): nothing shows the OOM killer sent the kill - "
               "no kernel or scheduler OOM record, no allocator error; a user's kill -9, a scheduler preemption or a watchdog "
               "fit as well" if far else ""), far)


# A launcher's report that the child it ran failed (torchrun's ChildFailedError, subprocess's CalledProcessError,
# torch.multiprocessing's ProcessExitedException): after a Ctrl-C it echoes the stop, not a new failure.
_LAUNCHER_ECHO = re.compile(r"ChildFailedError|CalledProcessError|ProcessExitedException|ProcessRaisedException")


# A traceback's frames (its innermost lines, signals.TAIL_LINES) in a call that writes the model or a checkpoint:
# `torch.save(...)`, `save_checkpoint(...)`, `model.save_pretrained(...)`, a frame `in save` / `in _save_checkpoint`.
_SAVE_FRAMES = re.compile(r"\b(?:torch\.save|save_pretrained|save_model|save_checkpoint|save_weights|save_state)\s*\("
                          r"|, in _?save\w*\s*$", re.M)


def _failed_saving(f: Findings, hits: list[Hit]) -> bool:
    """The job ended on an exception raised while saving the model (its traceback's frames are a save call), and the
    divergence found rests only on the curve's shape: what ended the job is the save, and the curve is the runner-up."""
    return (bool(hits) and f.failed and f.exception is not None and not f.traceback_cut
            and all(h.signal.records_rule in CURVE_RULES for h in hits)
            and bool(_SAVE_FRAMES.search("\n".join(f.tail))))


def _failed_after_stop(f: Findings, stop: Hit) -> bool:
    """A stop the log went on past is not how it ends: a traceback of its own began more than stop_echo_lines after
    the Ctrl-C (a notebook's later cell failed). One sooner is the stop's echo - DataLoader workers and shutdown
    hooks interrupted with it -, and so is a launcher reporting the stopped child (ChildFailedError)."""
    if f.exception is None or f.last_traceback_at is None or _LAUNCHER_ECHO.search(f.exception[1]):
        return False
    gap = f.table.records.stop_echo_lines if f.table is not None else 0
    return f.exception[0] > stop.last_line and f.last_traceback_at > stop.last_line + gap


def decide(f: Findings, *, platform: str | None = None, memory: dict | None = None) -> Classification:
    """Weigh findings into a Classification (see the module docstring for the rules).

    memory: {"used_gb", "limit_gb"} near the end of the run (a run's progress records and env report);
    a kill with memory far below the limit is not evidence of OOM, so the verdict's confidence drops.
    """
    comp = compiled(f.table)
    summary = _metrics_summary(f)
    dropped_note = ""
    if f.dropped:
        ids = ", ".join(sorted({h.id for h in f.dropped}))
        dropped_note = f" The SIGKILL signs ({ids}) were set aside: stop_run asked for this stop, so the kill is ours, not the OOM killer's."

    by_class: dict[str, list[Hit]] = {}
    outlived: list[Hit] = []
    for h in f.hits:
        if h.failure_class in ("environment", "oom") and f.outlived(h):
            outlived.append(h)  # training went on past it: not what ended the run
            continue
        by_class.setdefault(h.failure_class, []).append(h)
    if outlived:
        ids = ", ".join(f"{h.id} (last at line {h.last_line})" for h in _order(outlived))
        dropped_note += (f" Set aside, training went on past them ({f.table.records.went_on_records} or more records, a trainer's "
                         f"finished line or a later command's start after them): {ids}.")
    if f.transient:
        ids = ", ".join(f"{h.id} (last at line {h.last_line})" for h in _order(f.transient))
        dropped_note += (f" Set aside as a transient the run came back from (steps the fp16 loss scaler skipped: NaN/inf "
                         f"or huge grad norms followed by finite ones, with the loss finite throughout): {ids}.")
    stopped = [h for h in by_class.get("none", []) if h.signal.none_kind == "stopped" and not f.outlived(h)
               and not _failed_after_stop(f, h)]
    interrupted = f.interrupted_failing
    if stopped and interrupted and not (by_class.keys() & FAILURE_CLASSES):
        # The Ctrl-C was raised while handling an exception (Python chains them): the process had already failed and
        # hung in its clean-up; the exception decides, by its type, and the stop is the runner-up.
        stopped = []
        f = replace(f, exception=interrupted, traceback_cut=False)
        dropped_note += (f" A KeyboardInterrupt was raised while handling the exception at line {interrupted[0]}: someone "
                         f"stopped a process that had already failed, so that exception decides.")
    scores = {c: _score(hs) for c, hs in by_class.items() if c in FAILURE_CLASSES}
    fallback = None
    if f.failed and not scores and not stopped:
        # Never silent on a failure: the exception type picks a class, weakly.
        fallback = fallback_rule(comp, f.exception, f.markers, f.traceback_cut, f.tail)
        scores[fallback.failure_class] = comp.table.fallback_priority
    nan_end = summary.get("loss_nonfinite_at_end", 0)
    if ("oom" in scores and "divergence" in scores and _kill_only(by_class["oom"]) and f.table is not None
            and nan_end >= max(1, f.table.records.nonfinite_recovered_logs) and scores["oom"] >= scores["divergence"]):
        # A bare kill (no allocator error, no OOM-killer record) after the loss had been NaN/inf for its last logs
        # ended a run that had already diverged: a user's kill -9, a watchdog, or torchrun tearing its ranks down.
        scores["oom"] = scores["divergence"] - 1
        dropped_note += (f" The kill came after the loss was NaN/inf for its last {nan_end} logs, with no finite one "
                         f"after: it ended a run that had already diverged, so the numbers decide.")
    if stopped:
        scores.setdefault("none", _score(stopped))
    top = max(scores.values(), default=0)
    if scores.get("divergence") == top and _failed_saving(f, by_class.get("divergence", [])):
        # The job died writing the model: the exception decides (by its type, as for a failure no signal names), and
        # the curve's shape is the runner-up.
        saving = fallback_rule(comp, f.exception, f.markers, f.traceback_cut, f.tail)
        if saving.failure_class != "divergence":
            scores[saving.failure_class] = max(scores.get(saving.failure_class, 0), scores["divergence"] + 1)
            fallback = saving
            shape = ", ".join(sorted({h.id for h in by_class["divergence"]}))
            dropped_note += (f" The job ended on an exception raised while saving the model (line {f.exception[0]}), "
                             f"after the logged curve; the curve's shape ({shape}) is the runner-up.")
    if not scores:
        return _healthy(f, by_class.get("none", []), summary, dropped_note)

    ranked = sorted(scores.items(), key=lambda kv: (-kv[1], min((h.first for h in by_class.get(kv[0], [])), default=10**12)))
    cls, win = ranked[0]
    runner_cls, runner = ranked[1] if len(ranked) > 1 else (None, 0)
    conf = _confidence(win, runner)
    runner_up = RunnerUp(runner_cls, _confidence(runner, win), _why_runner(runner_cls, by_class)) if runner_cls else _alternative(cls, conf)
    if cls == "none":
        hits = _order(stopped)
        reason = f"{hits[0].signal.note.strip()} ({hits[0].id}{', line ' + str(hits[0].first) if hits[0].lines else ''})." + dropped_note
        return Classification("none", reason, _evidence(hits), [h.id for h in _order(f.hits)], None, "stopped", conf, runner_up,
                              _missing("none", hits, f, False), summary)
    if fallback is not None and f.cell_traceback_after(f.finished_at):
        return _later_cell(f, cls, fallback, conf, runner_up, by_class.get("none", []), summary, dropped_note)
    if fallback is not None:
        return _by_fallback(f, cls, fallback, conf, runner_up, summary, dropped_note)
    return _by_signals(f, cls, by_class[cls], conf, runner_up, summary, dropped_note, comp, platform, memory)


def _later_cell(f: Findings, cls: str, fallback, conf: float, runner_up: RunnerUp | None, benign: list[Hit], summary: dict,
                dropped_note: str) -> Classification:
    """A notebook's last traceback is a cell's, begun after training ran to its end, and no signal names a cause."""
    first = f.exception[0] if f.exception else f.last_traceback_at
    went_on = f.table.records.cell_went_on_lines if f.table is not None else 1
    if f.printed_after(first) < went_on:
        # The notebook's last output is that cell's error (a save, an export): the job's last step failed -
        # environment by the fallback, healthy training the runner-up.
        failed = _by_fallback(f, cls, fallback, conf, runner_up, summary, dropped_note)
        failed.reason += (f" Training itself ran to its end at line {f.finished_at}; the error came from a later notebook "
                          f"cell, the last thing the notebook shows.")
        failed.runner_up = RunnerUp("none", 0.35, f"training finished at line {f.finished_at}, if what that cell did "
                                                  f"(saving, exporting, plotting) is not part of the job")
        return failed
    # Later cells ran on after it (a plot failed): the training finished and the notebook went on - healthy, with the
    # error named and environment the runner-up.
    healthy = _healthy(f, benign, summary, dropped_note)
    healthy.reason += (f" Training ran to its end at line {f.finished_at}; the error at line {first} came from a later "
                       f"notebook cell (an IPython cell traceback), not from training.")
    healthy.evidence = _evidence([], [f.finished] + ([f.exception] if f.exception else []))
    healthy.confidence = min(healthy.confidence, 0.6)
    healthy.runner_up = RunnerUp("environment", 0.35, f"the error at line {first} if what that cell did (saving, exporting, "
                                                      f"evaluating) is part of the job")
    return healthy


def _why_not_fatal(f: Findings, first: int) -> str:
    """Why the error at line `first` did not end the run (f.went_on, or f.threads.only_threads_failed)."""
    if f.went_on:
        return (f" The run went on past the error at line {first} ({f.table.records.went_on_records} or more logged "
                f"records, a progress bar run to its total, the trainer's end-of-training line, a later command's start, "
                f"or - after a logger's error line - {f.table.records.went_on_lines} or more lines of output, after it), "
                f"so it was caught, not fatal.")
    if f.threads.thread_headers:
        return (f" The error at line {first} was raised in a thread other than the main one (\"Exception in thread\"), "
                f"which Python reports and the program outlives, and the program printed on after it.")
    return (f" Python reported the error at line {first} as ignored (\"Exception ignored in\": raised in a finaliser "
            f"or callback, where it cannot stop the program), so the run did not end on it.")


def _healthy(f: Findings, benign: list[Hit], summary: dict, dropped_note: str) -> Classification:
    what = (f"{summary['losses']} logged loss values look healthy" if summary.get("losses")
            else "no failure lines and no failure signal")
    reason = f"No failure: {what}." + (f" Known benign lines: {', '.join(sorted({h.id for h in benign}))}." if benign else "") + dropped_note
    conf = 0.8 if summary.get("losses") else 0.6
    runner_up, extra = _alternative("none", conf), []
    if (f.went_on or f.threads.only_threads_failed) and (f.exception or f.markers):
        # Never silent: the error lines the run went on past are named, with the class they would suggest.
        extra = ([f.exception] if f.exception else []) + f.markers[-2:]
        first = f.exception[0] if f.exception else min(n for n, _ in extra)
        reason += _why_not_fatal(f, first)
        conf = min(conf, 0.7)
        runner_up = RunnerUp("environment", 0.25, f"the error at line {first} if it did stop part of the run (a worker, an "
                                                  f"upload, a callback) - check what it belonged to")
    elif f.transient:
        # Never silent: the NaN grad-norm lines are shown, and divergence is what they would mean if they were not skips.
        extra = [ln for h in _order(f.transient) for ln in h.lines[:2]]
        conf = min(conf, 0.7)
        runner_up = RunnerUp("divergence", 0.25, f"the NaN/inf grad norm at line {extra[0][0]} if the run does not use fp16 "
                                                 f"loss scaling (bf16/fp32 never skip a step) - then the gradients broke")
    return Classification("none", reason, _evidence(benign, extra), [h.id for h in _order(benign)], None, "healthy", conf,
                          runner_up, _missing("none", benign, f, False), summary)


def _by_fallback(f: Findings, cls: str, fallback, conf: float, runner_up: RunnerUp | None, summary: dict,
                 dropped_note: str) -> Classification:
    """A failed run no signal explains: the fallback rule's class, weakly, with the exception line as evidence."""
    where = f"line {f.exception[0]}" if f.exception else (f"line {f.markers[0][0]}" if f.markers else f"exit status {f.exit_code}")
    if not f.exception and len(f.markers) > 1:
        where += f", last at line {f.markers[-1][0]}"  # several failure lines (relaunches): the first may be an earlier try
    reason = (f"The run failed ({where}) and no known signal names the cause; {fallback.why}, so the likeliest class is "
              f"{cls} ({fallback.id}), weakly.") + dropped_note
    evidence = _evidence([], ([f.exception] if f.exception else []) + f.markers)
    ids = [fallback.id] + [h.id for h in _order(f.hits)]
    return Classification(cls, reason, evidence, ids, None, None, conf, runner_up, _missing(cls, [], f, True), summary)


def _by_signals(f: Findings, cls: str, hits: list[Hit], conf: float, runner_up: RunnerUp | None, summary: dict,
                dropped_note: str, comp, platform: str | None, memory: dict | None) -> Classification:
    """The winning class's signals, the first of them named in the reason, the outranked others listed after."""
    deciding = _order(hits)
    win_hit = deciding[0]
    others = [h for h in _order(f.hits) if h.failure_class != cls]
    where = f"line {win_hit.first}" if win_hit.lines else "the exit status"
    reason = f"{win_hit.signal.note.strip()} ({win_hit.id}, {where})"
    if win_hit.detail:
        reason += f": {win_hit.detail}"
    reason += "."
    if len(deciding) > 1:
        reason += f" Also for {cls}: {', '.join(h.id for h in deciding[1:])}."
    if others:
        names = ", ".join(f"{h.id} ({h.failure_class}, line {h.first})" if h.lines else f"{h.id} ({h.failure_class})" for h in others)
        reason += f" Also seen and outranked: {names}."
    reason += dropped_note
    check = _check_for(win_hit.signal, platform) if cls == "environment" else None
    if cls == "environment" and check is None:
        reason += " No preflight check covers this; fix it where the note says, then relaunch."
    extra = [f.exception] if f.exception else []
    exc_extra = extra if cls != "divergence" or not all(h.signal.records_rule for h in deciding) else []
    missing = _missing(cls, deciding, f, False)
    if cls == "oom" and _kill_only(deciding):
        note, far = _memory_note(memory, comp.table)
        missing.append(note)
        if far:
            conf = min(conf, KILL_FAR_BELOW_CONFIDENCE)
            reason += f" But {note.split(': ')[0]}, so the kill alone is weak evidence of OOM."
            if runner_up is None or runner_up.confidence < conf - 0.1:
                runner_up = RunnerUp("environment", round(conf - 0.05, 2), "a kill with memory far below the limit: something other "
                                     "than the OOM killer may have sent it (a user's kill -9, a preemption, a watchdog)")
    return Classification(cls, reason, _evidence(deciding, exc_extra), [h.id for h in deciding] + [h.id for h in others], check, None,
                          conf, runner_up, missing, summary)


def _alternative(cls: str, conf: float) -> RunnerUp:
    alt, why = ALTERNATIVE[cls]
    return RunnerUp(alt, round(max(0.01, (1 - conf) / 2), 2), why)


def _why_runner(cls: str, by_class: dict[str, list[Hit]]) -> str:
    hits = _order(by_class.get(cls, []))
    if not hits:
        return "the exception type alone points there"
    h = hits[0]
    return f"{h.id}" + (f" (line {h.first})" if h.lines else "") + f": {h.signal.note.strip().split('. ')[0]}"


def classify_text(text: str, *, exit_info: dict | None = None, platform: str | None = None, table=None,
                  memory: dict | None = None) -> Classification:
    """Classify one training log.

    exit_info: {"returncode": int, "signal": int | "SIGKILL", "stopped_by": "stop_run" | None}
    (any key optional). platform: "dgx-spark" picks G-numbered checks, anything else the generic
    N-numbered ones. memory: {"used_gb", "limit_gb"} near the end of the run, when known.
    """
    return decide(find(text, exit_info=exit_info, table=table), platform=platform, memory=memory)


def classify_file(path, *, exit_info: dict | None = None, platform: str | None = None, table=None,
                  memory: dict | None = None) -> Classification:
    """Classify a log file of any size: read whole up to signals.WHOLE_BYTES, streamed in one pass above (find_file)."""
    return decide(find_file(path, exit_info=exit_info, table=table), platform=platform, memory=memory)


def classify_records(records: list, *, table=None) -> Classification:
    """Divergence seen in progress records ({"step", "loss", ...}): the numeric rules only.

    Evidence lines are (position in the list, the record as JSON). A loss of null counts as
    non-finite, as poll_progress writes NaN that way.
    """
    return decide(find_in_records(records, table=table))
