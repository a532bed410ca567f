"""Parses a training brief (markdown) into a Brief: the one place that knows its sections and accepted values.

Free of side effects and light (stdlib, common/ and workspace only), so every tool can import it. The brief format:

    # Training brief: <title>
    ## Task                 "<slug> — prose"                      (required)
    ## Base Model           embedded name, base-models/ folder, HF id in the cache, or a model folder's path in a data dir (required)
    ## Chosen Method        one of METHODS, aliases tolerated     (required)
    ## Dataset Expectation  prose + "key: value" lines: format, max_seq_length, packing, examples,
                         provenance, fill, placeholders, long_records, license (required; every key optional)
    ## Memory Budget        "4 GB", "96 GiB", "0.5 TB"              (required)
    ## Deployment Target    "<runtime> [(<format>)]"              (required)
    ## Evaluation           "key: value" lines                    (optional)
    ## Reward               reward function names                 (GRPO: required)
    ## Tracking             "report_to: <tracker>" [+ "project: <name>"] (optional; TRACKERS)

Headings match whatever their case, spacing, punctuation and level (##, ###); HTML comments
(<!-- ... -->) are ignored. Every problem is collected and raised as one BadInput that names each
section and lists the accepted values. templates/training-brief.md is a complete example.

Public API (other phases depend on it): Brief, parse_brief(text, path), load_brief(path),
load_experiment_brief(ws, experiment), METHODS, METHOD_LABELS, FORMATS, DEFAULT_FORMAT,
RUNTIMES, DEPLOY_FORMATS, PROVENANCES, canonical_method(text), slugify(text), example_brief().
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune_mcp.common.errors import BadInput, NotFound
from finetune_mcp.workspace import experiment_name

# ---------------------------------------------------------------- accepted values

METHODS = ("sft-lora", "sft-qlora", "dpo", "orpo", "kto", "simpo", "grpo", "vlm-sft")

# The spelling used in experiment names and shown to people.
METHOD_LABELS = {
    "sft-lora": "SFT-LoRA",
    "sft-qlora": "SFT-QLoRA",
    "dpo": "DPO",
    "orpo": "ORPO",
    "kto": "KTO",
    "simpo": "SimPO",
    "grpo": "GRPO",
    "vlm-sft": "VLM-SFT",
}

# Aliases are compared after _key(): lowercase, letters and digits only.
_METHOD_ALIASES = {
    "sft-lora": ("sftlora", "lora", "sft", "lorasft", "sftwithlora", "supervisedfinetuning", "supervisedfinetuninglora"),
    "sft-qlora": ("sftqlora", "qlora", "qlorasft", "sftwithqlora", "supervisedfinetuningqlora"),
    "dpo": ("dpo", "directpreferenceoptimization", "directpreferenceoptimisation"),
    "orpo": ("orpo",),
    "kto": ("kto", "kahnemantversky", "kahnemantverskyoptimization"),
    "simpo": ("simpo", "cposimpo"),
    "grpo": ("grpo", "grporlvr", "rlvr", "grpowithrlvr", "grpowithverifiablerewards"),
    "vlm-sft": ("vlmsft", "vlm", "visionsft", "sftvlm", "vlmlora", "visionlanguagesft", "visionfinetuning"),
}
_ALIAS_TO_METHOD = {alias: m for m, aliases in _METHOD_ALIASES.items() for alias in aliases}

# Dataset formats (the dataset-curation skill's format table names the fields of each).
FORMATS = ("messages", "text", "prompt-completion", "preference", "kto", "grpo", "vision")
_FORMAT_ALIASES = {
    "messages": ("messages", "conversational", "conversation", "conversations", "chat", "chatml", "sharegpt", "openai", "alpaca"),
    "text": ("text", "languagemodeling", "languagemodelling", "plaintext", "pretraining", "continuedpretraining", "raw"),
    "prompt-completion": ("promptcompletion", "prompt-completion", "completion", "instruction"),
    "preference": ("preference", "pairwise", "paired", "pairs", "chosenrejected", "promptchosenrejected", "dpo"),
    "kto": ("kto", "unpaired", "unpairedpreference", "promptcompletionlabel", "binary"),
    "grpo": ("grpo", "promptonly", "promptanswer", "promptreference", "rlvr", "verifiable"),
    "vision": ("vision", "vlm", "image", "images", "imagetext", "multimodal", "messageswithimages"),
}
_ALIAS_TO_FORMAT = {re.sub(r"[^a-z0-9]", "", a): f for f, aliases in _FORMAT_ALIASES.items() for a in aliases}

# Format used when the brief names none.
DEFAULT_FORMAT = {
    "sft-lora": "messages",
    "sft-qlora": "messages",
    "dpo": "preference",
    "orpo": "preference",
    "simpo": "preference",
    "kto": "kto",
    "grpo": "grpo",
    "vlm-sft": "vision",
}

# Formats a method can train on at all; the dataset-curation skill's table is the fuller statement
# (which conversions apply), this only catches a brief that contradicts itself.
METHOD_FORMATS = {
    "sft-lora": ("messages", "text", "prompt-completion"),
    "sft-qlora": ("messages", "text", "prompt-completion"),
    "dpo": ("preference",),
    "orpo": ("preference",),
    "simpo": ("preference",),
    "kto": ("kto", "preference"),  # paired rows are unpaired losslessly
    "grpo": ("grpo",),
    "vlm-sft": ("vision",),
}

# Experiment trackers a run can report to, each writing to a local store under the run's logs/.
TRACKERS = ("tensorboard", "trackio", "mlflow", "wandb", "none")
DEFAULT_TRACKER = "tensorboard"
# Where the records came from; the collapse guard fails only synthetic (and mixed) sets, and warns on curated ones.
PROVENANCES = ("synthetic", "curated", "mixed")
_PROVENANCE_ALIASES = {
    "synthetic": ("synthetic", "generated", "modelgenerated", "llmgenerated", "distilled", "machinegenerated"),
    "curated": ("curated", "human", "humanwritten", "handwritten", "manual", "written", "handpicked", "collected"),
    "mixed": ("mixed", "both", "partlysynthetic", "partsynthetic"),
}
_ALIAS_TO_PROVENANCE = {a: p for p, aliases in _PROVENANCE_ALIASES.items() for a in aliases}
# What to do with {{name}} placeholders left in the records: refuse them (the default) or train them as written.
PLACEHOLDER_POLICIES = ("fail", "keep")
# What to do with records longer than max_seq_length: drop them (the default, as Axolotl does), cut them
# (prompts from the start, answers by the trainer's keep_start cut) or refuse the set.
LONG_RECORD_POLICIES = ("drop", "truncate", "refuse")
_LONG_ALIASES = {"drop": "drop", "skip": "drop", "filter": "drop", "truncate": "truncate", "cut": "truncate",
                 "trim": "truncate", "refuse": "refuse", "fail": "refuse", "error": "refuse"}
_FILL_PAIR = re.compile(r"""\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*("(?:[^"\\]|\\.)*"|'[^']*'|[^,]*)\s*(?:,|$)""")

RUNTIMES = ("transformers", "vllm", "llama.cpp", "ollama")
_RUNTIME_ALIASES = {
    "transformers": ("transformers", "hf", "huggingface", "hftransformers", "peft", "safetensors"),
    "vllm": ("vllm",),
    "llama.cpp": ("llamacpp", "llamacppserver", "llamaserver", "gguf"),
    "ollama": ("ollama",),
}
_ALIAS_TO_RUNTIME = {a: r for r, aliases in _RUNTIME_ALIASES.items() for a in aliases}

# Artifact formats the export phase knows; "lora" is the adapter alone.
DEPLOY_FORMATS = (
    "lora", "merged-16bit", "merged-4bit",
    "gguf-f16", "gguf-bf16", "gguf-q8_0", "gguf-q6_k", "gguf-q5_k_m", "gguf-q4_k_m",
)
_GGUF_RUNTIMES = ("llama.cpp", "ollama")

# Canonical section keys -> heading spellings (after _key()).
_SECTIONS = {
    "task": ("task", "thetask", "taskdescription"),
    "base_model": ("basemodel", "model", "basemodelname"),
    "chosen_method": ("chosenmethod", "method", "trainingmethod"),
    "dataset_expectation": ("datasetexpectation", "datasetexpectations", "dataset", "data", "datasetexpectation"),
    "memory_budget": ("memorybudget", "memory", "budget"),
    "deployment_target": ("deploymenttarget", "deployment", "target", "deploytarget"),
    "evaluation": ("evaluation", "eval", "evaluationcriteria", "gate", "successcriteria"),
    "reward": ("reward", "rewards", "rewardfunction", "rewardfunctions"),
    "tracking": ("tracking", "experimenttracking", "tracker", "reportto", "logging"),
    "time_budget": ("timebudget", "time", "walltime", "timelimit", "deadline"),
}
_HEADING_TO_SECTION = {h: s for s, hs in _SECTIONS.items() for h in hs}
SECTION_TITLES = {
    "task": "Task",
    "base_model": "Base Model",
    "chosen_method": "Chosen Method",
    "dataset_expectation": "Dataset Expectation",
    "memory_budget": "Memory Budget",
    "deployment_target": "Deployment Target",
    "evaluation": "Evaluation",
    "reward": "Reward",
    "tracking": "Tracking",
    "time_budget": "Time Budget",
}
REQUIRED_SECTIONS = ("task", "base_model", "chosen_method", "dataset_expectation", "memory_budget", "deployment_target")

_SEQ_KEYS = ("max_seq_length", "max_length", "seq_length", "sequence_length", "max_seq_len", "seq_len", "context_length")
_TRUE = ("true", "yes", "on", "1", "enabled", "enable")
_FALSE = ("false", "no", "off", "0", "disabled", "disable", "none")


# ---------------------------------------------------------------- the brief


@dataclass(frozen=True)
class Brief:
    """A parsed training brief. Values are normalised; `sections` keeps each section's raw text."""

    path: str
    title: str
    task: str  # the Task section's text
    task_slug: str  # e.g. "repeat-words"
    base_model: str  # as written, e.g. "finetune-mcp-tiny" or "Qwen/Qwen3-4B"
    method: str  # canonical id, one of METHODS
    method_label: str  # METHOD_LABELS[method], used in the experiment name
    dataset_format: str  # one of FORMATS (from dataset_expectation["format"], else DEFAULT_FORMAT)
    max_seq_length: int | None  # None: not stated; prepare_dataset takes the method recipe's default
    packing: bool
    dataset_expectation: dict[str, Any]  # every key: value line, normalised; format/max_seq_length/packing/examples/provenance/fill typed
    memory_budget_gb: float
    deployment_target: str  # raw first line
    deploy_runtime: str  # one of RUNTIMES
    deploy_format: str | None  # one of DEPLOY_FORMATS, or None when the brief leaves it to the export skill
    evaluation: dict[str, Any] = field(default_factory=dict)  # numbers parsed to float where they parse
    reward: list[str] = field(default_factory=list)
    report_to: str = DEFAULT_TRACKER  # one of TRACKERS
    tracking_project: str | None = None
    sections: dict[str, str] = field(default_factory=dict)  # canonical key (or the heading's own key) -> raw text
    defaults_applied: list[str] = field(default_factory=list)  # e.g. ["format: messages (default for sft-lora)"]
    time_budget_s: float | None = None  # "## Time Budget" (optional): preflight warns when the expected wall time exceeds it

    @property
    def experiment(self) -> str:
        """<Model>-<Method>-<Task>, as workspace.experiment_name makes it."""
        return experiment_name(self.base_model, self.method_label, self.task_slug)

    @property
    def examples(self) -> int | None:
        return self.dataset_expectation.get("examples")

    @property
    def provenance(self) -> str | None:
        """synthetic | curated | mixed, or None when the brief does not say."""
        return self.dataset_expectation.get("provenance")

    @property
    def fill(self) -> dict[str, str]:
        """{{name}} placeholder -> the text that replaces it (the brief's `fill:` line)."""
        return dict(self.dataset_expectation.get("fill") or {})

    @property
    def keep_placeholders(self) -> bool:
        return self.dataset_expectation.get("placeholders") == "keep"

    @property
    def long_records(self) -> str:
        """drop | truncate | refuse: what prepare_dataset does with records longer than max_seq_length."""
        return self.dataset_expectation.get("long_records") or "drop"

    @property
    def system_prompt(self) -> str | None:
        """`system_prompt:` in Dataset Expectation: text for conversations without a system turn; `none` gives an
        empty one (a template that injects its own default then has nothing to inject); absent: the data as is."""
        v = self.dataset_expectation.get("system_prompt")
        if v is None:
            return None
        v = str(v).strip().strip('"').strip("'")
        return "" if v.lower() in ("none", "empty", "no", "false") else v

    def where(self, section: str) -> str:
        """'<path>: ## <Section>' for error messages."""
        return f"{self.path}: ## {SECTION_TITLES.get(section, section)}"


# ---------------------------------------------------------------- helpers


def _key(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def slugify(text: str, max_len: int = 48) -> str:
    """Lowercase, runs of anything but letters and digits become '-', trimmed."""
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return s[:max_len].rstrip("-")


def _clean_line(line: str) -> str:
    """A line without list markers, emphasis and code ticks."""
    line = line.strip()
    line = re.sub(r"^(?:[-*+]\s+|\d+[.)]\s+|>\s*)", "", line)
    line = line.replace("**", "").replace("__", "").replace("`", "")
    return line.strip()


def _first_line(text: str) -> str:
    for line in text.splitlines():
        c = _clean_line(line)
        if c and not c.startswith("<!--"):
            return c
    return ""


_LEAD_SPLIT = re.compile(r"\s+[—–]\s*|\s*[—–]\s+|\s+-\s+|\s*:\s+|\s*\(|\s*,\s*|\s*;\s*|\s*\.\s+|\s*\.$")


def _lead(text: str) -> str:
    """The leading phrase of a line: what comes before a dash, colon, parenthesis or comma."""
    return _LEAD_SPLIT.split(text, maxsplit=1)[0].strip()


def canonical_method(text: str) -> str | None:
    """The canonical method id for a Chosen Method value ("QLoRA", "dpo", "SFT + LoRA" ...), or None."""
    line = _first_line(text)
    if not line:
        return None
    line = re.sub(r"^(?:chosen\s+)?method\s*[:=]\s*", "", line, flags=re.I)
    for candidate in (_lead(line), line):
        m = _ALIAS_TO_METHOD.get(_key(candidate))
        if m:
            return m
    # A sentence: accept it when the names it contains all point to one method.
    found = {_ALIAS_TO_METHOD[_key(w)] for w in re.findall(r"[A-Za-z][A-Za-z0-9+-]*", line) if _key(w) in _ALIAS_TO_METHOD}
    found |= {_ALIAS_TO_METHOD[_key(w)] for w in re.findall(r"[A-Za-z]+[-+ ][A-Za-z]+", line) if _key(w) in _ALIAS_TO_METHOD}
    if "sft-lora" in found and "sft-qlora" in found:
        found.discard("sft-lora")  # "SFT with QLoRA" names both words; QLoRA is the specific one
    if "sft-lora" in found and "vlm-sft" in found:
        found.discard("sft-lora")
    return found.pop() if len(found) == 1 else None


def _split_sections(text: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """(title, sections by canonical key, headings as written) from the markdown."""
    title = ""
    sections: dict[str, list[str]] = {}
    written: dict[str, str] = {}
    current: str | None = None
    in_fence = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
        m = None if in_fence else re.match(r"^\s{0,3}(#{1,6})\s*(.*?)\s*#*\s*$", line)
        if m:
            level, heading = len(m.group(1)), m.group(2)
            if level == 1:
                if not title:
                    title = re.sub(r"^training\s+brief\s*[:\-—–]\s*", "", heading, flags=re.I).strip()
                current = None
                continue
            k = _key(heading.rstrip(":"))
            canon = _HEADING_TO_SECTION.get(k)
            if canon is None and level > 2 and current is not None:
                # A sub-heading inside a known section is part of it.
                sections[current].append(line)
                continue
            current = canon or k
            if current in sections:
                # A repeated heading continues the earlier section rather than replacing it.
                sections[current].append("")
            else:
                sections[current] = []
                written[current] = heading.strip()
            continue
        if current is not None:
            sections[current].append(line)
    return title, {k: "\n".join(v).strip() for k, v in sections.items()}, written


def _kv_lines(text: str) -> dict[str, str]:
    """'key: value' lines (list markers and emphasis tolerated); keys normalised to snake_case."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        c = _clean_line(line)
        m = re.match(r"^([A-Za-z][A-Za-z0-9 _\-]{0,40}?)\s*[:=]\s*(.+)$", c)
        # A prose sentence with a colon is not a setting: several words on the left need a short value.
        if m and (" " not in m.group(1).strip() or len(m.group(2).split()) <= 3):
            k = re.sub(r"[^a-z0-9]+", "_", m.group(1).lower()).strip("_")
            out[k] = m.group(2).strip()
    return out


def parse_fill(v: str) -> dict[str, str] | None:
    """'name=Ada, author="Example Labs"' -> {"name": "Ada", "author": "Example Labs"}; None when it does not parse."""
    out: dict[str, str] = {}
    pos, v = 0, v.strip()
    while pos < len(v):
        m = _FILL_PAIR.match(v, pos)
        if not m or m.end() == pos:
            return None
        key, val = m.group(1), m.group(2).strip()
        if len(val) >= 2 and val[0] == val[-1] and val[0] in "\"'":
            val = val[1:-1].replace('\\"', '"') if val[0] == '"' else val[1:-1]
        out[key] = val
        pos = m.end()
    return out or None


def _parse_bool(v: str) -> bool | None:
    k = _key(_lead(v)) or _key(v)
    if k in _TRUE:
        return True
    if k in _FALSE:
        return False
    return None


def _parse_int(v: str) -> int | None:
    m = re.match(r"^[~≈]?\s*(\d[\d,_]*)(?:\.\d+)?\s*([kKmM])?\b", v.strip())
    if not m:
        return None
    n = int(m.group(1).replace(",", "").replace("_", ""))
    mult = {"k": 1000, "m": 1_000_000}.get((m.group(2) or "").lower(), 1)
    return n * mult


def _parse_number(v: str) -> Any:
    s = v.strip().rstrip("%")
    try:
        x = float(s)
    except ValueError:
        return v.strip()
    if v.strip().endswith("%"):
        x /= 100.0
    return int(x) if x.is_integer() and "." not in s and "e" not in s.lower() else x


_GB_UNITS = {"gb": 1.0, "g": 1.0, "gib": 1.073741824, "tb": 1000.0, "t": 1000.0, "tib": 1099.511627776, "mb": 0.001, "mib": 0.001048576}


_DURATION_UNITS = {"s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1, "m": 60, "min": 60, "mins": 60, "minute": 60,
                   "minutes": 60, "h": 3600, "hr": 3600, "hrs": 3600, "hour": 3600, "hours": 3600, "d": 86400, "day": 86400, "days": 86400}


def parse_duration_s(text: str) -> float | None:
    """Seconds in '2 h', '90 min', '1h30m', '1.5 hours', '45 minutes'; None when the text holds no duration."""
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]+)", text.lower())
    total, seen = 0.0, False
    for num, unit in parts:
        if unit in _DURATION_UNITS:
            total += float(num) * _DURATION_UNITS[unit]
            seen = True
    return total if seen else None


def _parse_memory_gb(text: str) -> float | None:
    m = re.search(r"(\d+(?:\.\d+)?)\s*(gib|gb|g|tib|tb|t|mib|mb)\b", text.lower())
    if not m:
        return None
    return round(float(m.group(1)) * _GB_UNITS[m.group(2)], 3)


def _parse_deployment(text: str) -> tuple[str | None, str | None, str | None]:
    """(runtime, format, problem) from e.g. 'transformers (merged-16bit)', 'llama.cpp gguf-q8_0', 'ollama'."""
    line = _first_line(text)
    low = line.lower()
    runtime = None
    # Find the first runtime word in the line; "llama.cpp" and "llama-cpp" both count.
    for m in re.finditer(r"[a-z][a-z0-9.+_-]*", low):
        word = m.group(0).rstrip(".")
        r = _ALIAS_TO_RUNTIME.get(_key(word))
        if r:
            runtime = r
            break
    fmt = None
    for m in re.finditer(r"[a-z][a-z0-9_.-]*", low):
        w = m.group(0).rstrip(".").replace("gguf_", "gguf-")
        if w in DEPLOY_FORMATS:
            fmt = w
            break
        if re.fullmatch(r"(q\d(_[0-9a-z]+)*|f16|bf16)", w):
            fmt = "gguf-" + w
            break
        if re.fullmatch(r"merged[-_]?(16bit|fp16|bf16|4bit)", w):
            fmt = "merged-4bit" if "4" in w else "merged-16bit"
            break
        if w in ("adapter", "lora-adapter"):
            fmt = "lora"
            break
        if w.startswith("gguf-"):
            return runtime, None, f"unknown GGUF quantisation {w!r}"
    if runtime is None and fmt and fmt.startswith("gguf-"):
        runtime = "llama.cpp"
    if runtime is None:
        return None, fmt, "no known runtime named"
    if fmt and fmt.startswith("gguf-") and runtime not in _GGUF_RUNTIMES:
        return runtime, fmt, f"{fmt} is a GGUF file, which {runtime} does not serve"
    return runtime, fmt, None


# ---------------------------------------------------------------- parse


class _Problems(list):
    """Every problem the brief has, each naming its section; raised together as one BadInput."""

    def add(self, section: str, msg: str, accepted: str | None = None) -> None:
        self.append(f"## {SECTION_TITLES.get(section, section)}: {msg}" + (f" (accepted: {accepted})" if accepted else ""))


@dataclass
class _Expectation:
    """The Dataset Expectation section, parsed: every key: value line plus the typed values."""

    values: dict[str, Any]
    fmt: str | None
    seq: int | None
    packing: bool
    defaults: list[str]


@dataclass
class _Deployment:
    raw: str
    runtime: str | None
    fmt: str | None


def parse_brief(text: str, path: str | Path = "training-brief.md") -> Brief:
    """Parse and validate a training brief. Raises one BadInput listing every problem, each with its section."""
    path = str(path)
    title, sections = _sections_of(text, path)
    problems = _Problems()
    _check_required(sections, problems)
    task_slug = _task_slug(sections, problems)
    base_model = _base_model(sections, problems)
    method = _method(sections, problems)
    de = _dataset_expectation(sections.get("dataset_expectation", ""), method, problems)
    mem = _memory_budget(sections, problems)
    time_budget = _time_budget(sections, problems)
    dep = _deployment(sections, problems)
    evaluation = {k: _parse_number(v) for k, v in _kv_lines(sections.get("evaluation", "")).items()}
    reward = _reward(sections, method, problems)
    report_to, tracking_project = _tracking(sections, problems)
    if problems:
        raise BadInput(
            f"the training brief has {len(problems)} problem(s):\n  - " + "\n  - ".join(problems),
            where=path,
            fix="correct the sections named above and call again",
        )
    return Brief(
        path=path,
        title=title,
        task=sections.get("task", "").strip(),
        task_slug=task_slug,
        base_model=base_model,
        method=method,
        method_label=METHOD_LABELS[method],
        dataset_format=de.fmt,
        max_seq_length=de.seq,
        packing=de.packing,
        dataset_expectation=de.values,
        memory_budget_gb=mem,
        deployment_target=dep.raw,
        deploy_runtime=dep.runtime,
        deploy_format=dep.fmt,
        evaluation=evaluation,
        reward=reward,
        report_to=report_to,
        tracking_project=tracking_project,
        sections=sections,
        defaults_applied=de.defaults,
        time_budget_s=time_budget,
    )


def _sections_of(text: str, path: str) -> tuple[str, dict[str, str]]:
    """(title, sections) of a brief that is not empty."""
    if not isinstance(text, str) or not text.strip():
        raise BadInput("the training brief is empty", where=path, fix="write the sections " + ", ".join(f"## {SECTION_TITLES[s]}" for s in REQUIRED_SECTIONS))
    # Comments carry notes for people (the example brief lists accepted values in them); never values.
    text = re.sub(r"<!--.*?(?:-->|$)", "", text, flags=re.S)
    title, sections, _written = _split_sections(text)
    return title, sections


def _check_required(sections: dict[str, str], problems: _Problems) -> None:
    for s in REQUIRED_SECTIONS:
        if s not in sections:
            problems.add(s, "section missing")
        elif not sections[s].strip():
            problems.add(s, "section is empty")


def _task_slug(sections: dict[str, str], problems: _Problems) -> str:
    task_text = sections.get("task", "")
    task_slug = ""
    if task_text.strip():
        task_slug = slugify(_lead(_first_line(task_text)))
        if not task_slug:
            problems.add("task", "no task name on its first line", "a slug such as 'repeat-words', then ' — ' and prose")
    return task_slug


def _base_model(sections: dict[str, str], problems: _Problems) -> str:
    """The first word of the Base Model section's first line."""
    base_model = ""
    if sections.get("base_model", "").strip():
        base_model = _first_line(sections["base_model"]).split()[0] if _first_line(sections["base_model"]) else ""
        base_model = base_model.strip(",;:")
        if not base_model or not re.fullmatch(r"(~?/)?[A-Za-z0-9][A-Za-z0-9._/-]*", base_model) or ".." in base_model:
            problems.add("base_model", f"{base_model!r} is not a model name",
                         "'finetune-mcp-tiny', a folder name under base-models/, an HF id such as Qwen/Qwen3-4B, "
                         "or the absolute path of a model folder inside a --data-dir")
    return base_model


def _method(sections: dict[str, str], problems: _Problems) -> str | None:
    method = None
    if sections.get("chosen_method", "").strip():
        method = canonical_method(sections["chosen_method"])
        if method is None:
            problems.add("chosen_method", f"unknown method {_first_line(sections['chosen_method'])!r}", ", ".join(METHOD_LABELS.values()))
    return method


def _dataset_expectation(de_raw: str, method: str | None, problems: _Problems) -> _Expectation:
    """Every key: value line of the section, with format, max_seq_length, packing and the policies typed."""
    kv = _kv_lines(de_raw)
    expectation: dict[str, Any] = dict(kv)
    defaults: list[str] = []
    fmt = _dataset_format(kv, method, problems, defaults)
    seq_key, seq = _max_seq_length(kv, de_raw, problems, defaults)
    packing = _packing(kv, method, problems, defaults)
    provenance = _typed_expectation_values(kv, expectation, problems)
    expectation["provenance"] = provenance
    expectation["format"] = fmt
    expectation["max_seq_length"] = seq
    expectation["packing"] = packing
    if seq_key and seq_key != "max_seq_length":
        expectation.pop(seq_key, None)
    return _Expectation(expectation, fmt, seq, packing, defaults)


def _dataset_format(kv: dict[str, str], method: str | None, problems: _Problems, defaults: list[str]) -> str | None:
    fmt = None
    if "format" in kv:
        fmt = _ALIAS_TO_FORMAT.get(_key(_lead(kv["format"]))) or _ALIAS_TO_FORMAT.get(_key(kv["format"]))
        if fmt is None:
            problems.add("dataset_expectation", f"unknown format {kv['format']!r}", "|".join(FORMATS))
    elif method:
        fmt = DEFAULT_FORMAT[method]
        defaults.append(f"format: {fmt} (default for {METHOD_LABELS[method]})")
    if fmt and method and fmt not in METHOD_FORMATS[method]:
        problems.add("dataset_expectation", f"format {fmt!r} does not fit the chosen method {METHOD_LABELS[method]}",
                     "|".join(METHOD_FORMATS[method]))
    return fmt


def _max_seq_length(kv: dict[str, str], de_raw: str, problems: _Problems, defaults: list[str]) -> tuple[str | None, int | None]:
    """(the key the brief wrote it under, the token count)."""
    seq = None
    seq_key = next((k for k in _SEQ_KEYS if k in kv), None)
    if seq_key is None:
        if de_raw.strip():
            defaults.append("max_seq_length: not stated (prepare_dataset takes the method recipe's default and reports the data's p99)")
    else:
        seq = _parse_int(kv[seq_key])
        if seq is None or seq < 8 or seq > 1_048_576:
            problems.add("dataset_expectation", f"{seq_key}: {kv[seq_key]!r} is not a token count", "an integer from 8 to 1048576")
            seq = None
    return seq_key, seq


def _packing(kv: dict[str, str], method: str | None, problems: _Problems, defaults: list[str]) -> bool:
    packing = False
    if "packing" in kv:
        b = _parse_bool(kv["packing"])
        if b is None:
            problems.add("dataset_expectation", f"packing: {kv['packing']!r} is not true or false", "true|false")
        else:
            packing = b
    else:
        defaults.append("packing: false (not stated)")
    if packing and method and method not in ("sft-lora", "sft-qlora"):
        problems.add("dataset_expectation", f"packing: true, but {METHOD_LABELS[method]} does not pack sequences", "packing: false")
    return packing


def _typed_expectation_values(kv: dict[str, str], expectation: dict[str, Any], problems: _Problems) -> str | None:
    """examples, fill, placeholders and long_records typed in `expectation` (aliases dropped); returns the provenance."""
    if "examples" in kv:
        n = _parse_int(kv["examples"])
        if n is None:
            problems.add("dataset_expectation", f"examples: {kv['examples']!r} is not a count", "a number such as ~2000")
        expectation["examples"] = n
    prov_key = next((k for k in ("provenance", "origin", "data_origin", "data_provenance") if k in kv), None)
    provenance = None
    if prov_key:
        provenance = _ALIAS_TO_PROVENANCE.get(_key(_lead(kv[prov_key]))) or _ALIAS_TO_PROVENANCE.get(_key(kv[prov_key]))
        if provenance is None:
            problems.add("dataset_expectation", f"{prov_key}: {kv[prov_key]!r} is not a provenance", "|".join(PROVENANCES))
        if prov_key != "provenance":
            expectation.pop(prov_key, None)
    if "fill" in kv:
        fill = parse_fill(kv["fill"])
        if fill is None:
            problems.add("dataset_expectation", f"fill: {kv['fill']!r} is not a list of name=value pairs",
                         "fill: name=Ada, author=Example Labs (quote a value that holds a comma)")
        expectation["fill"] = fill or {}
    if "placeholders" in kv:
        pol = _key(_lead(kv["placeholders"]))
        pol = {"keep": "keep", "train": "keep", "leave": "keep", "fail": "fail", "refuse": "fail", "error": "fail"}.get(pol)
        if pol is None:
            problems.add("dataset_expectation", f"placeholders: {kv['placeholders']!r} is not a policy", "|".join(PLACEHOLDER_POLICIES))
        expectation["placeholders"] = pol
    long_key = next((k for k in ("long_records", "long_sequences", "too_long", "overlong") if k in kv), None)
    if long_key:
        pol = _LONG_ALIASES.get(_key(_lead(kv[long_key])))
        if pol is None:
            problems.add("dataset_expectation", f"{long_key}: {kv[long_key]!r} is not a policy", "|".join(LONG_RECORD_POLICIES))
        if long_key != "long_records":
            expectation.pop(long_key, None)
        expectation["long_records"] = pol
    return provenance


def _memory_budget(sections: dict[str, str], problems: _Problems) -> float | None:
    mem = None
    if sections.get("memory_budget", "").strip():
        mem = _parse_memory_gb(sections["memory_budget"])
        if mem is None or mem <= 0:
            problems.add("memory_budget", f"{_first_line(sections['memory_budget'])!r} is not an amount of memory", "a size such as '4 GB', '96 GiB' or '0.5 TB'")
            mem = None
    return mem


def _time_budget(sections: dict[str, str], problems: _Problems) -> float | None:
    """The optional Time Budget in seconds."""
    time_budget = None
    if sections.get("time_budget", "").strip():
        time_budget = parse_duration_s(_first_line(sections["time_budget"]))
        if not time_budget:
            problems.add("time_budget", f"{_first_line(sections['time_budget'])!r} is not a duration", "a duration such as '2 h', '90 min' or '1h30m'")
            time_budget = None
    return time_budget


def _deployment(sections: dict[str, str], problems: _Problems) -> _Deployment:
    dep_raw = _first_line(sections.get("deployment_target", ""))
    runtime = dep_fmt = None
    if dep_raw:
        runtime, dep_fmt, why = _parse_deployment(sections["deployment_target"])
        if why:
            problems.add("deployment_target", f"{dep_raw!r}: {why}",
                         "a runtime (" + ", ".join(RUNTIMES) + ") optionally with a format (" + ", ".join(DEPLOY_FORMATS) + ")")
    return _Deployment(dep_raw, runtime, dep_fmt)


def _reward(sections: dict[str, str], method: str | None, problems: _Problems) -> list[str]:
    """The reward function names (GRPO needs at least one)."""
    reward: list[str] = []
    if sections.get("reward", "").strip():
        for line in sections["reward"].splitlines():
            c = _clean_line(line)
            if not c:
                continue
            c = re.sub(r"^rewards?(?:\s+functions?)?\s*[:=]\s*", "", c, flags=re.I)
            for part in re.split(r"\s*[,;]\s*|\s+\+\s+|\s+and\s+", c):
                name = _lead(part.strip())
                if re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]*", name or ""):
                    reward.append(name.lower().replace("-", "_"))
    if method == "grpo" and not reward:
        problems.add("reward", "GRPO needs at least one reward function" if "reward" in sections else "section missing (GRPO needs reward functions)",
                     "names such as 'exact_match, format'")
    return reward


def _tracking(sections: dict[str, str], problems: _Problems) -> tuple[str, str | None]:
    """(report_to, project) from the optional Tracking section."""
    track = _kv_lines(sections.get("tracking", ""))
    report_to = DEFAULT_TRACKER
    raw_tracker = track.get("report_to") or track.get("tracker")
    if raw_tracker:
        report_to = re.sub(r"[^a-z]", "", raw_tracker.lower().replace("weightsandbiases", "wandb").replace("w&b", "wandb"))
        if report_to not in TRACKERS:
            problems.add("tracking", f"report_to {raw_tracker!r} is not a tracker finetune-mcp sets up", ", ".join(TRACKERS))
    elif sections.get("tracking", "").strip():
        problems.add("tracking", "no 'report_to: <tracker>' line", ", ".join(TRACKERS))
    return report_to, track.get("project") or None


def load_brief(path: str | Path) -> Brief:
    """Read and parse a brief file. NotFound when it is missing; BadInput when it is not UTF-8 or invalid."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise NotFound(f"training brief {str(p)!r} not found", where=str(p), fix="pass the path of an existing training-brief.md") from None
    except IsADirectoryError:
        raise BadInput(f"training brief {str(p)!r} is a directory", where=str(p), fix="pass the path of the training-brief.md file") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadInput(f"the training brief is not UTF-8 (byte {e.start})", where=str(p), fix="save the brief as UTF-8") from None
    return parse_brief(text, p)


BRIEF_FILE = "training-brief.md"
EXAMPLE_BRIEF = Path(__file__).resolve().parent.parent / "templates" / "training-brief.md"


def example_brief() -> str:
    """A complete brief with every section and, in comments, every accepted value (README and brief://example)."""
    return EXAMPLE_BRIEF.read_text(encoding="utf-8")


def load_experiment_brief(ws, experiment: str) -> Brief:
    """The brief copied into an experiment by prepare_dataset (ws: workspace.Workspace)."""
    d = ws.experiment_dir(experiment)
    p = d / BRIEF_FILE
    if not p.is_file():
        raise NotFound(f"experiment {experiment!r} has no {BRIEF_FILE}", where=str(p), fix="run prepare_dataset with the training brief; it copies the brief into the experiment")
    return load_brief(p)
