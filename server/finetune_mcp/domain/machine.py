"""The machine as preflight sees it: one observation (probe, or a recorded one replayed), the GPUs and platform it
shows, the spark-preflight checks applied to it, the training shape and the step probe, and the env report.

  probe(ws)                          -> observation: {"host": telemetry.probe_host(...), "env": jobs/probe_env}
  evaluate(observed, brief, skills)  -> platform, checks, verdict, memory and time estimates (pure: no I/O)

tests/fixtures/observations/ holds recorded observations (REPLAY_ENV replays one, RECORD_ENV saves a real one).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from finetune_mcp import schemas as S
from finetune_mcp import telemetry
from finetune_mcp.common.errors import BadInput, FtError, NotFound, Refused
from finetune_mcp.domain import memory
from finetune_mcp.domain.brief import Brief
from finetune_mcp.domain.recipes import choose_backend, duration, find_dataset, recipe_params, run_shape, time_estimate
from finetune_mcp.models import hf_hub_cache, resolve_base_model
from finetune_mcp.worker import prewarm, run_job
from finetune_mcp.workspace import utc_now

SKILL = "spark-preflight"
OBSERVATION_FORMAT = "finetune-mcp/preflight-observation@1"
REPLAY_ENV = "FINETUNE_MCP_PREFLIGHT_REPLAY"
RECORD_ENV = "FINETUNE_MCP_PREFLIGHT_RECORD"
ENV_REPORT = "env-report.json"
PROBE_TIMEOUT_S = 600  # a first Unsloth import on a GPU box compiles for a while


# ---------------------------------------------------------------- probing


def probe(ws, progress=None) -> dict[str, Any]:
    """One observation of this machine: the host (NVML, memory, disks, CPU, container) and the training env."""
    prewarm()  # the training Python imports while the host is probed
    host = telemetry.probe_host({"output_root": ws.output_root, "hf_cache": hf_hub_cache()})
    try:
        env = run_job("probe_env", {}, progress=progress, timeout=PROBE_TIMEOUT_S)
    except FtError as e:
        # A training Python that cannot even start is itself what preflight must report.
        env = {"error": str(e)}
    return {
        "format": OBSERVATION_FORMAT,
        "note": "recorded by the real probe (finetune_mcp.phases.preflight.probe)",
        "recorded_at": utc_now(),
        "host": host,
        "env": env,
    }


def load_observation(path: str | Path) -> dict[str, Any]:
    p = Path(path).expanduser()
    try:
        obs = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NotFound(f"recorded observation {str(p)!r} not found", where=REPLAY_ENV, fix=f"point {REPLAY_ENV} at an observation JSON, e.g. tests/fixtures/observations/gb10.json") from None
    except json.JSONDecodeError as e:
        raise BadInput(f"recorded observation is not valid JSON: {e.msg}", where=f"{p}:{e.lineno}:{e.colno}") from None
    if not isinstance(obs, dict) or obs.get("format") != OBSERVATION_FORMAT:
        raise BadInput(f"{p} is not a preflight observation (format must be {OBSERVATION_FORMAT!r})", where=f"{p}: format",
                       fix="record one with FINETUNE_MCP_PREFLIGHT_RECORD=<path> on the machine in question")
    for key in ("host", "env"):
        if not isinstance(obs.get(key), dict):
            raise BadInput(f"{p} lacks the {key!r} object of an observation", where=f"{p}: {key}")
    return obs


# ---------------------------------------------------------------- small readers of an observation


def _version_tuple(v: Any) -> tuple[int, ...] | None:
    if v is None:
        return None
    m = re.match(r"^\s*(\d+)(?:\.(\d+))?", str(v))
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def _fmt_v(t: tuple[int, ...] | None) -> str:
    return ".".join(str(x) for x in t) if t else "unknown"


def _num(x: Any, unit: str = "") -> str:
    if x is None:
        return "unknown"
    return f"{x:.1f}{unit}" if isinstance(x, float) else f"{x}{unit}"


@dataclass
class Gpu:
    name: str
    capability: tuple[int, int] | None
    total_gb: float | None
    free_gb: float | None
    unified: bool
    nvml: dict[str, Any] | None


def gpus(observed: Mapping[str, Any]) -> list[Gpu]:
    """The GPUs this observation shows: NVML's devices, else torch's (a container without NVML)."""
    host, env = observed.get("host") or {}, observed.get("env") or {}
    tdevs = ((env.get("torch") or {}).get("devices")) or []
    out = []
    for i, d in enumerate(((host.get("nvml") or {}).get("devices")) or []):
        mem = d.get("memory") or {}
        td = tdevs[i] if i < len(tdevs) else {}
        cap = d.get("compute_capability") or td.get("capability")
        out.append(Gpu(
            name=str(d.get("name") or td.get("name") or "unknown GPU"),
            capability=tuple(cap) if cap else None,
            total_gb=mem.get("total_gb") if mem.get("supported") else td.get("total_memory_gb"),
            free_gb=mem.get("free_gb") if mem.get("supported") else None,
            unified=(not mem.get("supported", True)) or bool(td.get("is_integrated")),
            nvml=d,
        ))
    if not out:
        for td in tdevs:
            cap = td.get("capability")
            out.append(Gpu(str(td.get("name")), tuple(cap) if cap else None, td.get("total_memory_gb"), None, bool(td.get("is_integrated")), None))
    return out


def detect_platform(observed: Mapping[str, Any], table) -> str:
    gs = gpus(observed)
    if not gs:
        return "cpu"
    cap = tuple(table.spark_capability)
    for g in gs:
        if any(n.lower() in g.name.lower() for n in table.spark_gpu_names) or (g.capability == cap and g.unified):
            return "dgx-spark"
    return "generic-nvidia"


def _env(observed) -> dict[str, Any]:
    return observed.get("env") or {}


def _torch(observed) -> dict[str, Any]:
    return _env(observed).get("torch") or {}


def _env_failed(observed) -> str | None:
    env = _env(observed)
    if env.get("error"):
        return f"the training environment could not be probed: {env['error'].splitlines()[0]}"
    t = env.get("torch") or {}
    if not t.get("ok"):
        return f"torch does not import in the training environment: {t.get('error') or 'not probed'}"
    return None


_ARCH = re.compile(r"^(sm|compute)_(\d+)([af]?)$")


def arch_coverage(arch_list: list[str], cap: tuple[int, int]) -> tuple[str, str | None]:
    """('cubin'|'ptx'|'none', the entry that covers cap).

    A cubin for X.y runs on X.z with z >= y; PTX for X.y is JIT-compiled for any newer device; an
    arch-specific 'a'/'f' target runs only on its own major (CUDA programming guide, binary compatibility).
    """
    best_ptx = None
    for a in arch_list:
        m = _ARCH.match(a)
        if not m:
            continue
        n = int(m.group(2))
        major, minor = n // 10, n % 10
        if m.group(1) == "sm":
            if m.group(3) == "a" and (major, minor) != cap:
                continue
            if major == cap[0] and minor <= cap[1]:
                return "cubin", a
        elif (major, minor) <= cap:
            best_ptx = a
    return ("ptx", best_ptx) if best_ptx else ("none", None)


# ---------------------------------------------------------------- the checks


@dataclass
class Outcome:
    status: str  # pass | warn | fail
    observed: str
    threshold: str
    causes: tuple[str, ...] = ()


def _remediation(check, causes) -> str:
    specific = [check.remedies[c] for c in causes if c in check.remedies]
    return " ".join(specific) if specific else check.remediation


def _driver(observed, check, table, platform) -> Outcome:
    nv = (observed.get("host") or {}).get("nvml") or {}
    if not nv.get("available"):
        return Outcome("fail", f"NVML not loadable ({nv.get('error') or 'no error text'}) although a GPU was seen", "NVML answers", ("nvml-missing",))
    drv, cuda_drv = nv.get("driver_version"), _version_tuple(nv.get("cuda_driver_version"))
    major = _version_tuple(drv)[0] if _version_tuple(drv) else None
    build = _version_tuple(_torch(observed).get("cuda_build"))
    seen = (f"driver {drv or 'unknown'} (supports CUDA {_fmt_v(cuda_drv)}); torch built with "
            + (f"CUDA {_fmt_v(build)}" if build else "no CUDA (CPU-only build)"))
    if platform == "dgx-spark":
        need_cuda = _version_tuple(check.thresholds.min_cuda)
        need_drv = table.cuda_min_driver.get(str(need_cuda[0]))
        thr = f"driver >= {need_drv} and driver CUDA >= {_fmt_v(need_cuda)}"
        if major is None or cuda_drv is None:
            return Outcome("fail", seen + "; version unreadable", thr)
        if major < need_drv or cuda_drv < need_cuda:
            return Outcome("fail", seen, thr)
        return Outcome("pass", seen, thr)
    if build is None:
        thr = "driver version readable (torch has no CUDA build to match; see N2)"
        return Outcome("pass" if major else "fail", seen, thr)
    need_drv = table.cuda_min_driver.get(str(build[0]))
    if need_drv is None:
        return Outcome("warn", seen, f"a known minimum driver for CUDA {build[0]} (table has {sorted(table.cuda_min_driver)})")
    thr = f"driver >= {need_drv} for CUDA {build[0]}.x"
    if major is None:
        return Outcome("fail", seen + "; version unreadable", thr)
    return Outcome("pass" if major >= need_drv else "fail", seen, thr)


def _torch_build(observed, check, platform) -> Outcome:
    failed = _env_failed(observed)
    if failed:
        return Outcome("fail", failed, "torch imports in the training Python", ("probe-failed",))
    t = _torch(observed)
    build = _version_tuple(t.get("cuda_build"))
    py = (_env(observed).get("python") or {}).get("executable", "the training Python")
    seen = f"torch {t.get('version')} in {py}, CUDA build {_fmt_v(build) if build else 'none (CPU-only)'}"
    thr = "a CUDA build" + (f" >= {check.thresholds.min_cuda}" if check.thresholds.min_cuda else "") + ", cuda.is_available(), device arch covered, a kernel runs"
    if build is None:
        return Outcome("fail", seen, thr, ("cpu-build",))
    if check.thresholds.min_cuda and build < _version_tuple(check.thresholds.min_cuda):
        return Outcome("fail", seen, thr, ("cuda12-build",))
    if not t.get("cuda_available"):
        why = "; ".join(t.get("cuda_warnings") or []) or t.get("cuda_error") or "no reason given"
        return Outcome("fail", f"{seen}; cuda.is_available() is False: {why}", thr)
    arch = t.get("arch_list") or []
    status, causes, notes = "pass", [], []
    for d in t.get("devices") or []:
        cap = tuple(d.get("capability") or ())
        if len(cap) != 2:
            continue
        how, entry = arch_coverage(arch, cap)
        sm = f"sm_{cap[0]}{cap[1]}"
        if how == "none":
            status = "fail"
            causes.append("no-kernel-image")
            notes.append(f"{d.get('name')} is {sm}; arch list {arch} has no code for it")
        elif how == "ptx":
            status = "warn" if status == "pass" else status
            notes.append(f"{d.get('name')} is {sm}; only PTX {entry} covers it (JIT-compiled at first use)")
        else:
            notes.append(f"{d.get('name')} is {sm}, covered by {entry}")
    smoke = t.get("cuda_smoke") or {}
    if smoke and not smoke.get("ok"):
        status = "fail"
        causes.append("no-kernel-image")
        notes.append(f"test kernel failed: {smoke.get('error')}")
    return Outcome(status, "; ".join([seen] + notes), thr, tuple(dict.fromkeys(causes)))


def _memory(observed, check, platform, est: dict | None, model_error: str | None, budget_gb: float | None) -> Outcome:
    if model_error:
        return Outcome("fail", model_error, "the base model resolves locally", ("model-missing",))
    if est is None:
        return Outcome("warn", "no estimate", "an estimate")
    need = est["gb"]["total"]
    frac = check.thresholds.headroom_fraction or 1.0
    mem = (observed.get("host") or {}).get("memory") or {}
    gs = gpus(observed)
    if platform == "generic-nvidia" and not any(g.unified for g in gs):
        frees = [(g.free_gb if g.free_gb is not None else g.total_gb) for g in gs]
        frees = [f for f in frees if f is not None]
        avail = min(frees) if frees else None
        where = "free VRAM of the smallest GPU"
    else:
        avail = mem.get("available_gb")
        where = "unified memory available (MemAvailable)" if platform != "cpu" else "system RAM available"
    seen = f"estimate {need:.2f} GB ({est['method']}, {est['precision']}, seq {est['max_seq_length']}, micro batch {est['micro_batch_size']}); {where} {_num(avail, ' GB')}"
    if budget_gb:
        seen += f"; brief budget {budget_gb:g} GB"
    thr = f"estimate <= {frac:g} x available" + (" and <= MemFree (page cache not needed)" if platform == "dgx-spark" else "") + (" and <= budget" if budget_gb else "")
    if avail is None:
        return Outcome("warn", seen, thr)
    if need > avail:
        return Outcome("fail", seen, thr)
    status, causes = "pass", []
    if need > frac * avail:
        status = "warn"
    if platform == "dgx-spark" and mem.get("free_gb") is not None and need > mem["free_gb"]:
        status = "warn"
        causes.append("page-cache")
        seen += f"; MemFree {mem['free_gb']:.1f} GB, page cache {_num(mem.get('cached_gb'), ' GB')}"
    if budget_gb and need > budget_gb:
        status = "warn"
        causes.append("over-budget")
    return Outcome(status, seen, thr, tuple(causes))


def _storage(observed, check, est: dict | None) -> Outcome:
    disk = (observed.get("host") or {}).get("disk") or {}
    out, hf = disk.get("output_root") or {}, disk.get("hf_cache") or {}
    t = check.thresholds
    ckpt = 3 * (est or {}).get("checkpoint_gb", 0.0)  # three checkpoints kept while a run is going
    merged = (est or {}).get("merged_16bit_gb", 0.0)
    need_fail = (t.min_free_gb or 0) + ckpt
    need_warn = need_fail + merged + (t.export_slack_gb or 0)
    seen = (f"OUTPUT_ROOT {out.get('path')}: {_num(out.get('free_gb'), ' GB')} free, writable={out.get('writable')}; "
            f"HF cache {hf.get('path')}: {_num(hf.get('free_gb'), ' GB')} free, writable={hf.get('writable')}")
    thr = (f"OUTPUT_ROOT writable with >= {need_fail:.1f} GB (checkpoints), >= {need_warn:.1f} GB with a merged export; "
           f"HF cache writable with >= {t.min_free_gb or 0:g} GB")
    if not out or out.get("free_gb") is None:
        return Outcome("fail", seen + "; OUTPUT_ROOT not observed", thr)
    if not out.get("writable") or out["free_gb"] < need_fail:
        return Outcome("fail", seen + (f" ({out.get('write_error')})" if out.get("write_error") else ""), thr)
    if out["free_gb"] < need_warn:
        return Outcome("warn", seen, thr)
    if hf and (not hf.get("writable") or (hf.get("free_gb") is not None and hf["free_gb"] < (t.min_free_gb or 0))):
        return Outcome("warn", seen, thr)
    return Outcome("pass", seen, thr)


def _thermal(observed, check, platform) -> Outcome:
    t = check.thresholds
    watch = set(t.throttle_reasons or [])
    if platform == "cpu":
        cpu = (observed.get("host") or {}).get("cpu") or {}
        temp, high = cpu.get("temperature_c"), cpu.get("high_c")
        thr = "CPU sensor below its own high mark"
        if temp is None:
            return Outcome("pass", "no CPU temperature sensor readable (nothing to judge)", thr)
        seen = f"CPU {temp:.0f} °C ({cpu.get('sensor')}), high mark {_num(high, ' °C')}"
        return Outcome("warn" if high and temp >= high else "pass", seen, thr)
    status, notes = "pass", []
    for g in gpus(observed):
        d = g.nvml or {}
        temp, slow = d.get("temperature_c"), d.get("slowdown_temp_c")
        limit = (slow - (t.slowdown_margin_c or 0)) if slow else t.max_temp_c
        active = [r for r in (d.get("clock_event_reasons") or []) if r in watch]
        clocks = d.get("clocks_mhz") or {}
        note = (f"{g.name}: {_num(temp, ' °C')} (slowdown {_num(slow, ' °C')}), power limit {_num(d.get('power_limit_w'), ' W')}, "
                f"SM clock {_num(clocks.get('sm'))}/{_num(clocks.get('sm_max'))} MHz, clock-event reasons {d.get('clock_event_reasons')}")
        notes.append(note)
        if temp is None:
            if platform == "dgx-spark":
                status = "warn"
            continue
        if limit is not None and temp >= limit:
            status = "warn"
        if active:
            status = "warn"
    thr = (f"temperature < slowdown - {t.slowdown_margin_c:g} °C" if t.slowdown_margin_c is not None else "temperature below slowdown")
    if t.max_temp_c:
        thr += f" (< {t.max_temp_c:g} °C when NVML gives no slowdown threshold)"
    thr += f"; none of {sorted(watch)} active"
    return Outcome(status, "; ".join(notes) or "no GPU readings", thr)


def _imports(observed, check, platform, method: str) -> Outcome:
    failed = _env_failed(observed)
    t = check.thresholds
    thr = (f"import: {', '.join(t.required_imports or [])}"
           + (f"; GPU fast path: {', '.join(t.backend_imports or [])}" if platform != "cpu" else "")
           + "".join(f"; {m}: {', '.join(mods)}" for m, mods in (t.method_imports or {}).items()))
    if failed:
        return Outcome("fail", failed, thr, ("probe-failed",))
    imps = _env(observed).get("imports") or {}

    def state(name):
        i = imps.get(name) or {"ok": False, "error": "not probed"}
        return i.get("ok"), (i.get("version") if i.get("ok") else i.get("error"))

    status, causes, notes = "pass", [], []
    bad_req = [n for n in (t.required_imports or []) if not state(n)[0]]
    need = (t.method_imports or {}).get(method, [])
    bad_method = [n for n in need if not state(n)[0]]
    if bad_req or bad_method:
        status = "fail"
    if platform != "cpu":
        bad_backend = [n for n in (t.backend_imports or []) if not state(n)[0]]
        if bad_backend:
            status = "warn" if status == "pass" else status
            causes.append("backend")
    shown = list(dict.fromkeys((t.required_imports or []) + need + ((t.backend_imports or []) if platform != "cpu" else [])))
    for n in shown:
        ok, what = state(n)
        notes.append(f"{n} {what}" if ok else f"{n} FAILED ({what})")
    if platform == "cpu":
        notes.append("unsloth/triton not used on CPU (TRL backend)")
    if platform == "dgx-spark" and t.min_ptxas and state("triton")[0]:
        ok, note = _ptxas_ok(observed, t.min_ptxas)
        notes.append(note)
        if not ok:
            status = "warn" if status == "pass" else status
            causes.append("ptxas")
    return Outcome(status, "; ".join(notes), thr + (f"; Triton's ptxas release >= {t.min_ptxas:.1f}" if platform == "dgx-spark" and t.min_ptxas else ""), tuple(causes))


def _ptxas_ok(observed, min_release: float) -> tuple[bool, str]:
    info = _env(observed).get("triton_ptxas") or {}
    env, bundled = info.get("env") or {}, info.get("bundled") or {}
    # Triton prefers an explicit override; newer Triton has a separate Blackwell ptxas.
    for key in ("TRITON_PTXAS_BLACKWELL_PATH", "TRITON_PTXAS_PATH"):
        if key in env:
            chosen, label = env[key], key
            break
    else:
        name = "ptxas-blackwell" if "ptxas-blackwell" in bundled else "ptxas"
        chosen, label = bundled.get(name), f"Triton's bundled {name}"
    if not chosen:
        return False, "Triton's ptxas not found"
    rel = _version_tuple(chosen.get("release"))
    if rel is None:
        return False, f"{label} ({chosen.get('path')}): release unreadable ({chosen.get('error')})"
    return rel >= _version_tuple(min_release), f"{label} = CUDA {_fmt_v(rel)} ptxas"


def _bf16(observed, check, platform) -> Outcome:
    t = _torch(observed)
    min_cap = check.thresholds.min_capability or 8.0
    need = _version_tuple(min_cap)
    thr = f"native bf16 (compute capability >= {min_cap:.1f}; torch.cuda.is_bf16_supported(including_emulation=False))"
    bad = "fail" if platform == "dgx-spark" else "warn"
    native = t.get("bf16")
    caps = [g.capability for g in gpus(observed) if g.capability]
    cap_s = ", ".join(f"{c[0]}.{c[1]}" for c in caps) or "unknown"
    if native is True:
        return Outcome("pass", f"torch reports native bf16; compute capability {cap_s}", thr)
    if native is False:
        emu = " (only emulated)" if t.get("bf16_emulated") else ""
        return Outcome(bad, f"torch reports no native bf16{emu}; compute capability {cap_s}", thr)
    # torch could not answer (no CUDA): judge by the capability NVML reports.
    if caps and all(c >= need for c in caps):
        return Outcome("pass", f"torch could not answer (CUDA unavailable); compute capability {cap_s} has bf16", thr)
    return Outcome(bad, f"torch could not answer and compute capability is {cap_s}", thr)


def _cpu_fit(check, method: str) -> Outcome:
    t = check.thresholds
    thr = f"method not in {t.gpu_only_methods}"
    if method in (t.gpu_only_methods or []):
        return Outcome("warn", f"method {method}", thr, ("gpu-only-method",))
    return Outcome("pass", f"method {method}", thr)


def _time_fit(check, est: Mapping[str, Any]) -> Outcome:
    budget = est.get("budget_s")
    thr = f"<= the brief's time budget ({duration(budget)})" if budget else "the brief states no time budget"
    if not est.get("measured") or "wall_s" not in est:
        return Outcome("pass", f"not measured: {est.get('why')}", thr)
    seen = f"~{est['wall']} ({est['steps']} steps x {est['s_per_step']} s, {est['steps_from']})"
    if budget and est["wall_s"] > budget:
        return Outcome("warn", seen, thr, ("over-budget",))
    return Outcome("pass", seen, thr)


# ---------------------------------------------------------------- evaluate


def brief_facts(brief: Brief | Mapping[str, Any]) -> dict[str, Any]:
    """The facts of the brief that preflight uses."""
    if isinstance(brief, Brief):
        return {"base_model": brief.base_model, "method": brief.method, "max_seq_length": brief.max_seq_length,
                "memory_budget_gb": brief.memory_budget_gb, "time_budget_s": brief.time_budget_s}
    return {k: brief.get(k) for k in ("base_model", "method", "max_seq_length", "memory_budget_gb", "time_budget_s")}


def evaluate(observed: Mapping[str, Any], brief: Brief | Mapping[str, Any], skills, shape: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Platform, checks, verdict, memory and time estimates of one observation. Pure: the same inputs give the same report.

    observed["model"] is the brief's base model as preflight resolved it ({"name", "config", ...} or {"error"});
    observed["step_probe"] the measured training steps (jobs/step_probe.py), when there are any; shape the batch
    shape and run length the estimates assume (training_shape), else micro batch 1 at max_seq_length.
    """
    table = skills.table(SKILL, "checks")
    mem_table = skills.table(SKILL, "memory")
    facts = brief_facts(brief)
    platform = detect_platform(observed, table)
    model = observed.get("model") or {}
    model_error = model.get("error") if not model.get("config") else None
    est = None
    if not facts["max_seq_length"] and facts["method"]:
        # A brief without max_seq_length trains at the method recipe's default; estimate that run.
        p = recipe_params(skills, facts["method"]).get("max_seq_length")
        facts["max_seq_length"] = p.default if p is not None else None
    if model.get("config") and facts["method"] in mem_table.methods and facts["max_seq_length"]:
        kw = {}
        if shape:
            kw = {"micro_batch_size": shape["micro_batch"], "lora_r": shape["lora_r"], "lora_targets": shape["lora_targets"],
                  "tokens_per_sequence": shape["tokens_per_sequence"], "gradient_checkpointing": shape["gradient_checkpointing"]}
        # The backend generate_config will choose from this observation (Unsloth where it imports and supports the method).
        likely, _ = choose_backend("auto", facts["method"], platform, {"observed": observed}, skills, [])
        est = memory.estimate(model, facts["method"], int(facts["max_seq_length"]), platform, mem_table, backend=likely, **kw)
    elif not model_error:
        model_error = "no model config in the observation"
    budget = facts.get("memory_budget_gb")
    time_est = time_estimate(observed.get("step_probe"), shape, facts.get("time_budget_s"))

    runners = {
        "G1": lambda c: _driver(observed, c, table, platform),
        "G2": lambda c: _torch_build(observed, c, platform),
        "G3": lambda c: _memory(observed, c, platform, est, model_error, budget),
        "G4": lambda c: _storage(observed, c, est),
        "G5": lambda c: _thermal(observed, c, platform),
        "G6": lambda c: _imports(observed, c, platform, facts["method"]),
        "G7": lambda c: _bf16(observed, c, platform),
        "N1": lambda c: _driver(observed, c, table, platform),
        "N2": lambda c: _torch_build(observed, c, platform),
        "N3": lambda c: _memory(observed, c, platform, est, model_error, budget),
        "N4": lambda c: _storage(observed, c, est),
        "N5": lambda c: _bf16(observed, c, platform),
        "N6": lambda c: _imports(observed, c, platform, facts["method"]),
        "N7": lambda c: _thermal(observed, c, platform),
        "C1": lambda c: _cpu_fit(c, facts["method"]),
        "T1": lambda c: _time_fit(c, time_est),
    }
    checks: list[S.CheckResult] = []
    for c in table.checks:
        if platform not in c.platforms:
            continue
        o = runners[c.id](c)
        checks.append(S.CheckResult(
            id=c.id, name=c.name, status=o.status, observed=o.observed, threshold=o.threshold,
            remediation=None if o.status == "pass" else _remediation(c, o.causes),
            cite=skills.cite(SKILL, c.cite),
        ))
    statuses = {c.status for c in checks}
    verdict = "blocked" if "fail" in statuses else "ready-with-warnings" if "warn" in statuses else "ready"
    return {"platform": platform, "verdict": verdict, "checks": checks, "memory_estimate": est or {}, "time_estimate": time_est}


# ---------------------------------------------------------------- the tool


def model_for(pc, observed: dict, base_model: str) -> dict[str, Any]:
    recorded = observed.get("model")
    if isinstance(recorded, dict) and recorded.get("name") == base_model and (recorded.get("config") or recorded.get("error")):
        return recorded
    try:
        return memory.load_model_info(pc.ws.base_models_dir, base_model, data_dirs=pc.guard.read_roots)
    except FtError as e:
        return {"name": base_model, "error": str(e)}


STEP_PROBE_TIMEOUT_S = 900


def training_shape(pc, experiment: str, brief: Brief, platform: str) -> dict[str, Any]:
    """The batch shape and run length generate_config will start from: the recipe's defaults, the prepared data.

    Memory and time are estimated at this shape; generate_config estimates again with what it resolves.
    """
    params = recipe_params(pc.skills, brief.method)
    mem_table = pc.skills.table(SKILL, "memory")
    try:
        _, meta = find_dataset(pc, experiment)
    except FtError:
        meta = {}
    defaults = {k: p.default for k, p in params.items() if p.default is not None}
    return {
        **run_shape(defaults, meta, int(brief.max_seq_length or 2048), brief.packing, brief.method, mem_table),
        "lora_r": int(defaults.get("lora_r", mem_table.defaults.lora_r)),
        "lora_targets": [t.replace("_proj", "") for t in defaults.get("target_modules", mem_table.defaults.lora_targets)],
        "reference_forward": brief.method in ("dpo", "kto"),
        "gradient_checkpointing": bool(mem_table.defaults.gradient_checkpointing_gpu) if platform != "cpu" else False,
        "source": "the method recipe's defaults and the prepared dataset (meta.json)" if meta else "the method recipe's defaults (no prepared dataset yet)",
    }


def step_probe(pc, model: dict[str, Any], shape: dict[str, Any]) -> dict[str, Any]:
    """A few real training steps at the shape, in the worker; {"error"} when they cannot run."""
    try:
        ref = resolve_base_model(model["name"], pc.ws.base_models_dir, data_dirs=pc.guard.read_roots)
        if not ref.exists:
            return {"error": f"{model['name']} is not built yet (prepare_dataset builds it)"}
        keys = ("micro_batch", "sequences_per_example", "tokens_per_sequence", "time_tokens_per_sequence", "lora_r", "lora_targets",
                "gradient_checkpointing", "reference_forward")
        return run_job("step_probe", {"model_path": ref.load_path, "steps": 3, **{k: shape.get(k) for k in keys}}, timeout=STEP_PROBE_TIMEOUT_S)
    except FtError as e:
        return {"error": str(e)}


# ---------------------------------------------------------------- the env report


def read_env_report(pc, exp_dir: Path, experiment: str) -> dict:
    """The experiment's env-report.json, checked: generate_config reads the platform and the training environment from it."""
    path = exp_dir / ENV_REPORT
    if not path.is_file():
        raise Refused(
            f"experiment {experiment!r} has no {ENV_REPORT}: no preflight, no training script",
            where=str(path),
            fix=f"run preflight(experiment={experiment!r}) first; generate_config reads the platform and the training environment from its report",
        )
    try:
        report = json.loads(pc.guard.read_text(path))
    except json.JSONDecodeError as e:
        raise BadInput(f"{ENV_REPORT} is not valid JSON: {e.msg}", where=f"{path}:{e.lineno}", fix="run preflight again; it rewrites the report") from None
    if report.get("platform") not in ("cpu", "generic-nvidia", "dgx-spark"):
        raise BadInput(f"{ENV_REPORT} names no known platform ({report.get('platform')!r})", where=f"{path}: platform", fix="run preflight again")
    return report
