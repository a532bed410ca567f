"""mem_gb / temp_c probes (NVML, unified memory on GB10, CPU fallback) and the host side of preflight's probe.

Light on purpose: psutil and pynvml (nvidia-ml-py) are imported on first use, and every NVML
failure (no library, no device, a query a device does not support) becomes data, never an
exception. Sizes are decimal GB (1e9 bytes), the unit of the brief's memory budget.

mem_gb: memory in use from NVML on a discrete GPU; on a unified-memory device, where NVML's
memory query is not supported (GB10), system memory in use (MemTotal - MemAvailable); without a
GPU, the resident memory of a process tree. temp_c: the hottest NVML GPU, else a CPU sensor, else None.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

GB = 1e9

_lock = threading.Lock()
_nvml_state: dict[str, Any] = {"tried": False, "mod": None, "error": None}

# NVML clock-event reason bits (nvmlClocksEventReason*), named as the skill's thresholds name them.
CLOCK_EVENT_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}

# Keys of one NVML device in an observation (recorded files must carry exactly these).
NVML_DEVICE_KEYS = (
    "index", "name", "compute_capability", "memory", "temperature_c", "slowdown_temp_c", "shutdown_temp_c",
    "power_limit_w", "power_draw_w", "clocks_mhz", "clock_event_reasons", "processes",
)

# psutil sensor groups that measure the CPU package, in order of preference.
_CPU_SENSORS = ("coretemp", "k10temp", "zenpower", "cpu_thermal", "cpu-thermal", "soc_thermal", "acpitz")


def _gb(nbytes: float | int | None) -> float | None:
    return None if nbytes is None else round(float(nbytes) / GB, 3)


def _err(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def nvml():
    """The initialised pynvml module, or None (nvml_error() says why). Initialised once per process."""
    with _lock:
        if not _nvml_state["tried"]:
            _nvml_state["tried"] = True
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml_state["mod"] = pynvml
            except Exception as e:  # NVMLError_LibraryNotFound on machines without the driver, ImportError, ...
                _nvml_state["error"] = _err(e)
        return _nvml_state["mod"]


def nvml_error() -> str | None:
    nvml()
    return _nvml_state["error"]


def _handles(nv) -> list:
    try:
        return [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
    except Exception:
        return []


def _is_not_supported(nv, e: BaseException) -> bool:
    cls = getattr(nv, "NVMLError_NotSupported", None)
    return (cls is not None and isinstance(e, cls)) or "Not Supported" in str(e)


def _system_used_gb() -> float:
    import psutil

    vm = psutil.virtual_memory()
    return round((vm.total - vm.available) / GB, 3)


def _tree_rss_gb(root_pid: int) -> float | None:
    import psutil

    try:
        root = psutil.Process(root_pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return None
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:  # a child that exited between listing and reading
            pass
    return round(total / GB, 3)


def mem_gb(pid_tree_root: int | None = None) -> float | None:
    """Memory in use, in GB: NVML GPU memory used (all devices); system memory in use on a unified-memory
    device; else the resident memory of pid_tree_root's process tree (default: this process)."""
    nv = nvml()
    if nv is not None:
        handles = _handles(nv)
        used, unified, seen = 0, False, False
        for h in handles:
            try:
                info = nv.nvmlDeviceGetMemoryInfo(h)
            except Exception as e:
                if _is_not_supported(nv, e):
                    unified = True
                continue
            # Some unified-memory drivers answer with zeros instead of NOT_SUPPORTED.
            if info.total == 0:
                unified = True
            else:
                used += info.used
                seen = True
        if unified:
            return _system_used_gb()
        if seen:
            return _gb(used)
    return _tree_rss_gb(pid_tree_root if pid_tree_root is not None else os.getpid())


def _cpu_temp() -> tuple[float | None, float | None, str | None]:
    """(current, high mark, sensor group) of the hottest CPU sensor psutil can read."""
    try:
        import psutil

        groups = psutil.sensors_temperatures() if hasattr(psutil, "sensors_temperatures") else {}
    except Exception:
        return None, None, None
    if not groups:
        return None, None, None
    names = [n for n in _CPU_SENSORS if n in groups] or sorted(groups)
    for name in names:
        readings = [r for r in groups[name] if r.current is not None and r.current > 0]
        if readings:
            hottest = max(readings, key=lambda r: r.current)
            return float(hottest.current), (float(hottest.high) if hottest.high else None), name
    return None, None, None


def temp_c() -> float | None:
    """The hottest GPU's temperature from NVML, else the hottest CPU sensor, else None."""
    nv = nvml()
    if nv is not None:
        temps = []
        for h in _handles(nv):
            try:
                temps.append(float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)))
            except Exception:
                pass
        if temps:
            return max(temps)
    return _cpu_temp()[0]


# ---------------------------------------------------------------- the host side of preflight's probe


def _try(fn, *args):
    try:
        return fn(*args), None
    except Exception as e:
        return None, _err(e)


def _decode(v):
    return v.decode() if isinstance(v, bytes) else v


def _device(nv, i: int, h) -> dict[str, Any]:
    d: dict[str, Any] = {"index": i}
    d["name"], _ = _try(lambda: _decode(nv.nvmlDeviceGetName(h)))
    cap, err = _try(nv.nvmlDeviceGetCudaComputeCapability, h)
    d["compute_capability"] = list(cap) if cap else None
    mem, err = _try(nv.nvmlDeviceGetMemoryInfo, h)
    if mem is not None and mem.total == 0:
        mem, err = None, "memory info answered with total=0 (unified memory)"
    if mem is not None:
        d["memory"] = {"supported": True, "total_gb": _gb(mem.total), "used_gb": _gb(mem.used), "free_gb": _gb(mem.free)}
    else:
        d["memory"] = {"supported": False, "error": err}
    d["temperature_c"], _ = _try(lambda: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)))
    d["slowdown_temp_c"], _ = _try(lambda: float(nv.nvmlDeviceGetTemperatureThreshold(h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)))
    d["shutdown_temp_c"], _ = _try(lambda: float(nv.nvmlDeviceGetTemperatureThreshold(h, nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)))
    d["power_limit_w"], _ = _try(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0)
    d["power_draw_w"], _ = _try(lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0)
    clocks = {}
    for key, fn, kind in (
        ("sm", nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM),
        ("sm_max", nv.nvmlDeviceGetMaxClockInfo, nv.NVML_CLOCK_SM),
        ("mem", nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_MEM),
        ("mem_max", nv.nvmlDeviceGetMaxClockInfo, nv.NVML_CLOCK_MEM),
    ):
        clocks[key], _ = _try(fn, h, kind)
    d["clocks_mhz"] = clocks
    reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
    mask, _ = _try(reasons_fn, h) if reasons_fn else (None, None)
    d["clock_event_reasons"] = None if mask is None else [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    procs, _ = _try(nv.nvmlDeviceGetComputeRunningProcesses, h)
    d["processes"] = None if procs is None else [
        {"pid": p.pid, "used_gb": _gb(p.usedGpuMemory) if isinstance(p.usedGpuMemory, int) and p.usedGpuMemory < 2**63 else None}
        for p in procs
    ]
    return d


def probe_nvml() -> dict[str, Any]:
    nv = nvml()
    if nv is None:
        return {"available": False, "error": nvml_error(), "driver_version": None, "cuda_driver_version": None, "devices": []}
    driver, _ = _try(lambda: _decode(nv.nvmlSystemGetDriverVersion()))
    cuda, _ = _try(nv.nvmlSystemGetCudaDriverVersion)
    cuda_s = f"{cuda // 1000}.{(cuda % 1000) // 10}" if isinstance(cuda, int) and cuda > 0 else None
    return {
        "available": True,
        "error": None,
        "driver_version": driver,
        "cuda_driver_version": cuda_s,
        "devices": [_device(nv, i, h) for i, h in enumerate(_handles(nv))],
    }


def _pressure_some_avg10() -> float | None:
    try:
        for line in Path("/proc/pressure/memory").read_text().splitlines():
            if line.startswith("some "):
                return float(dict(kv.split("=") for kv in line.split()[1:])["avg10"])
    except (OSError, KeyError, ValueError):
        pass
    return None


def probe_memory() -> dict[str, Any]:
    import psutil

    vm = psutil.virtual_memory()
    sw = psutil.swap_memory()
    return {
        "total_gb": _gb(vm.total),
        "available_gb": _gb(vm.available),  # MemAvailable: free + what the kernel expects to reclaim
        "free_gb": _gb(vm.free),  # MemFree: not even page cache
        "used_gb": _gb(vm.total - vm.available),
        "cached_gb": _gb(getattr(vm, "cached", 0) + getattr(vm, "buffers", 0)),
        "swap_total_gb": _gb(sw.total),
        "swap_used_gb": _gb(sw.used),
        "pressure_some_avg10": _pressure_some_avg10(),
    }


def _writable(d: Path) -> tuple[bool, str | None]:
    """Whether a file can be created in d, tried for real (ACLs and read-only mounts fool os.access)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".finetune-mcp-probe-", dir=d)
        os.close(fd)
        os.unlink(tmp)
        return True, None
    except OSError as e:
        return False, _err(e)


def probe_path(path: Path | str) -> dict[str, Any]:
    """Free space and writability of path; a path that does not exist yet is judged by its nearest existing parent."""
    import psutil

    p = Path(path).expanduser().absolute()
    existing = p
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    out: dict[str, Any] = {"path": str(p), "exists": p.exists(), "checked": str(existing)}
    try:
        du = psutil.disk_usage(str(existing))
        out.update(free_gb=_gb(du.free), total_gb=_gb(du.total))
    except OSError as e:
        out.update(free_gb=None, total_gb=None, error=_err(e))
    out["writable"], why = _writable(existing) if existing.is_dir() else (False, "not a directory")
    if why:
        out["write_error"] = why
    return out


def probe_container() -> dict[str, Any]:
    evidence = []
    kind = None
    if Path("/.dockerenv").exists():
        evidence.append("/.dockerenv")
        kind = "docker"
    if Path("/run/.containerenv").exists():
        evidence.append("/run/.containerenv")
        kind = kind or "podman"
    if os.environ.get("container"):
        evidence.append(f"container={os.environ['container']}")
        kind = kind or os.environ["container"]
    try:
        cg = Path("/proc/1/cgroup").read_text()
        for word in ("docker", "kubepods", "containerd", "lxc", "libpod"):
            if word in cg:
                evidence.append(f"/proc/1/cgroup mentions {word}")
                kind = kind or ("kubernetes" if word == "kubepods" else word)
                break
    except OSError:
        pass
    return {"in_container": bool(evidence), "kind": kind, "evidence": evidence}


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def probe_host(paths: dict[str, Path | str]) -> dict[str, Any]:
    """What the server's machine shows: NVML, memory, disks at `paths` (name -> path), CPU, container, CPU sensor."""
    import psutil

    temp, high, sensor = _cpu_temp()
    return {
        "hostname": socket.gethostname(),
        "os": {"system": platform.system(), "release": platform.release()},
        "cpu": {
            "arch": platform.machine(),
            "model": _cpu_model(),
            "logical_cores": psutil.cpu_count(logical=True),
            "physical_cores": psutil.cpu_count(logical=False),
            "temperature_c": temp,
            "high_c": high,
            "sensor": sensor,
        },
        "container": probe_container(),
        "nvml": probe_nvml(),
        "memory": probe_memory(),
        "disk": {name: probe_path(p) for name, p in paths.items()},
        "server_python": sys.version.split()[0],
    }


# The same rules for a generated train.py, which must stay standalone (training stack + pyyaml;
# psutil comes with accelerate, pynvml may be missing). Templates paste this text verbatim;
# tests execute it in a bare interpreter.
TRAIN_PY_SNIPPET = '''\
# --- mem_gb / temp_c: the rules of finetune_mcp.telemetry, standalone (GB = 1e9 bytes) ---
import os
import psutil
try:
    import pynvml
    pynvml.nvmlInit()
    _NVML = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
except Exception:  # no driver or no nvidia-ml-py: the CPU rules apply
    _NVML = []


def mem_gb():
    """NVML GPU memory used; system memory in use on unified memory (GB10); else this process tree's RSS."""
    used, seen, unified = 0, False, False
    for h in _NVML:
        try:
            m = pynvml.nvmlDeviceGetMemoryInfo(h)
        except Exception as e:  # NVML_ERROR_NOT_SUPPORTED on a GB10
            unified = unified or "Not Supported" in str(e)
            continue
        unified = unified or m.total == 0
        used, seen = used + m.used, seen or m.total > 0
    if unified:
        vm = psutil.virtual_memory()
        return round((vm.total - vm.available) / 1e9, 3)
    if seen:
        return round(used / 1e9, 3)
    me = psutil.Process(os.getpid())
    return round(sum(p.memory_info().rss for p in [me] + me.children(recursive=True)) / 1e9, 3)


def temp_c():
    """The hottest GPU (NVML), else the hottest CPU sensor (psutil), else None."""
    temps = []
    for h in _NVML:
        try:
            temps.append(float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)))
        except Exception:
            pass
    if not temps:
        try:
            temps = [r.current for g in psutil.sensors_temperatures().values() for r in g if r.current]
        except Exception:
            pass
    return max(temps) if temps else None
'''
