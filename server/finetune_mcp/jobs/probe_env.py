"""Worker job: what the training environment sees — torch and its CUDA build, devices, bf16, and which training libraries import.

Runs in the training Python (FINETUNE_MCP_TRAIN_PYTHON) because that is where training happens:
the server's own interpreter may have a different torch or none at all. Stdlib + torch only; every
failure is recorded as text, so one broken library never hides what the others say.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from finetune_mcp.common.proto import emit_progress, run_main

# Import order matters: Unsloth patches transformers/TRL and wants to be imported before them,
# the way a generated train.py does it.
LIBRARIES = ("unsloth", "bitsandbytes", "triton", "transformers", "trl", "peft", "datasets", "accelerate")

# Keys of one torch device in the result (recorded observations carry exactly these).
TORCH_DEVICE_KEYS = ("index", "name", "capability", "total_memory_gb", "is_integrated", "multi_processor_count")

ENV_KEYS = (
    "CUDA_VISIBLE_DEVICES", "TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH", "PYTORCH_CUDA_ALLOC_CONF",
    "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE",
)


def _err(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0].strip()}" if lines else type(e).__name__


def _version(name: str, mod: Any) -> str | None:
    v = getattr(mod, "__version__", None)
    if isinstance(v, str):
        return v
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def try_import(name: str) -> dict[str, Any]:
    if importlib.util.find_spec(name) is None:
        return {"ok": False, "version": None, "error": f"ModuleNotFoundError: No module named '{name}'"}
    t0 = time.monotonic()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importlib.import_module(name)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # Unsloth raises NotImplementedError without a GPU; some libraries call sys.exit
        return {"ok": False, "version": None, "error": _err(e), "seconds": round(time.monotonic() - t0, 2)}
    return {"ok": True, "version": _version(name, mod), "error": None, "seconds": round(time.monotonic() - t0, 2)}


_RELEASE = re.compile(r"release (\d+)\.(\d+)")


def ptxas_release(path: str | Path) -> dict[str, Any]:
    """`ptxas --version` of one binary: its CUDA release (e.g. 13.0) or why it could not be read."""
    p = Path(path)
    out: dict[str, Any] = {"path": str(p), "release": None, "error": None}
    if not p.is_file():
        out["error"] = "not found"
        return out
    try:
        r = subprocess.run([str(p), "--version"], capture_output=True, text=True, timeout=20)
        m = _RELEASE.search(r.stdout + r.stderr)
        if m:
            out["release"] = f"{m.group(1)}.{m.group(2)}"
        else:
            out["error"] = (r.stdout + r.stderr).strip()[-200:] or f"exit {r.returncode}"
    except (OSError, subprocess.SubprocessError) as e:
        out["error"] = _err(e)
    return out


def triton_ptxas() -> dict[str, Any]:
    """The ptxas binaries Triton would use: the environment's override, else the ones bundled with it."""
    spec = importlib.util.find_spec("triton")
    info: dict[str, Any] = {"env": {}, "bundled": {}}
    for key in ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH"):
        if os.environ.get(key):
            info["env"][key] = ptxas_release(os.environ[key].split()[0])
    if spec and spec.origin:
        bindir = Path(spec.origin).parent / "backends" / "nvidia" / "bin"
        for name in ("ptxas", "ptxas-blackwell"):
            if (bindir / name).is_file():
                info["bundled"][name] = ptxas_release(bindir / name)
    return info


def cpu_bf16_flags() -> list[str]:
    """CPU features that execute bf16 natively (x86 AVX512-BF16/AMX, Arm BF16)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags: set[str] = set()
    for line in text.splitlines():
        if line.lower().startswith(("flags", "features")):
            flags.update(line.split(":", 1)[1].split())
    return sorted(f for f in flags if f in ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16", "svebf16"))


def probe_torch() -> dict[str, Any]:
    try:
        import torch
    except BaseException as e:  # noqa: BLE001 - an unloadable torch is an observation, not a crash
        return {"ok": False, "error": _err(e)}
    t: dict[str, Any] = {"ok": True, "error": None, "version": torch.__version__, "cuda_build": torch.version.cuda}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            t["cuda_available"] = bool(torch.cuda.is_available())
        except Exception as e:
            t["cuda_available"] = False
            t["cuda_error"] = _err(e)
    # torch explains an unusable driver in a warning ("The NVIDIA driver on your system is too old ...").
    t["cuda_warnings"] = [str(w.message).splitlines()[0] for w in caught][:5]
    try:
        t["arch_list"] = list(torch.cuda.get_arch_list())
    except Exception:
        t["arch_list"] = []
    t["devices"] = []
    t["bf16"] = None
    t["bf16_emulated"] = None
    t["cuda_smoke"] = None
    if t["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            dev = {
                "index": i,
                "name": p.name,
                "capability": [p.major, p.minor],
                "total_memory_gb": round(p.total_memory / 1e9, 3),
                "is_integrated": bool(getattr(p, "is_integrated", False)),
                "multi_processor_count": getattr(p, "multi_processor_count", None),
            }
            t["devices"].append(dev)
        try:
            t["bf16"] = bool(torch.cuda.is_bf16_supported(including_emulation=False))
            t["bf16_emulated"] = bool(torch.cuda.is_bf16_supported(including_emulation=True))
        except TypeError:  # torch before the including_emulation argument
            t["bf16"] = bool(torch.cuda.is_bf16_supported())
        try:
            x = torch.arange(16, device="cuda", dtype=torch.float32)
            t["cuda_smoke"] = {"ok": float((x * 2).sum().item()) == 240.0, "error": None}
        except Exception as e:  # "no kernel image is available for execution on the device" lands here
            t["cuda_smoke"] = {"ok": False, "error": _err(e)}
    t["cpu_bf16_flags"] = cpu_bf16_flags()
    t["threads"] = torch.get_num_threads()
    return t


def probe(params: dict[str, Any]) -> dict[str, Any]:
    libraries = params.get("libraries") or list(LIBRARIES)
    total = 2 + len(libraries)
    emit_progress(0, total, "probing torch")
    torch_info = probe_torch()
    imports: dict[str, Any] = {}
    for k, name in enumerate(libraries, start=1):
        emit_progress(k, total, f"importing {name}")
        imports[name] = try_import(name)
    emit_progress(total - 1, total, "reading ptxas versions")
    ptxas = triton_ptxas() if imports.get("triton", {}).get("ok") else None
    emit_progress(total, total, "done")
    return {
        "python": {"version": sys.version.split()[0], "executable": sys.executable, "machine": platform.machine()},
        "torch": torch_info,
        "imports": imports,
        "triton_ptxas": ptxas,
        "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
    }


if __name__ == "__main__":
    run_main(probe)
