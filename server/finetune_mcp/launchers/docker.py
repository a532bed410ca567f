"""The docker launcher: the trainer inside an NGC-based training container, as DGX Spark users run it.

The `docker run` line follows the layout seed's rule 6 (dgx-spark-training-layout):
- caches bind-mounted at the in-container defaults: the host HF cache ($HF_HOME, else
  ~/.cache/huggingface) at /root/.cache/huggingface and ~/.triton at /root/.triton, so nothing
  inside the container needs HF_HOME set and every experiment shares one cache;
- OUTPUT_ROOT mounted at the same path inside and out (-v "$OUTPUT_ROOT:$OUTPUT_ROOT"), so a run
  directory printed in a log exists on the host; the prepared datasets and local base models are
  mounted read-only at their own paths for the same reason (config.yaml names them by host path);
- the GPU flags of NVIDIA's DGX Spark playbooks (nvidia/pytorch-fine-tune, nvidia/unsloth):
  --gpus all, --ipc=host, --ulimit memlock=-1, --ulimit stack=67108864.
The image must hold the training stack: FINETUNE_MCP_DOCKER_IMAGE (default: the project's GPU
image, built from its Dockerfile on the NGC PyTorch base).

The docker CLI runs in the foreground under the run supervisor; it proxies SIGTERM to the
container's trainer (--sig-proxy is on by default without a TTY; --init gives the trainer a real
PID 1 above it), and a stop that must escalate kills the container by name.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from finetune_mcp.common.errors import Refused
from finetune_mcp.launchers.base import RunSpec, SupervisedLauncher
from finetune_mcp.launchers.torchrun import torchrun_argv

DEFAULT_IMAGE = "finetune-mcp:gpu"
CONTAINER_HF_CACHE = "/root/.cache/huggingface"
CONTAINER_TRITON_CACHE = "/root/.triton"
# Forwarded from the server's environment into the container when set there.
_PASS_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "TRITON_PTXAS_PATH",
             "PYTORCH_CUDA_ALLOC_CONF", "TOKENIZERS_PARALLELISM")


def container_name(run_ref: str) -> str:
    return "ftmcp-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", run_ref)[-120:]


def host_hf_cache(env: dict[str, str] | os._Environ) -> Path:
    return Path(env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface").expanduser()


class DockerLauncher(SupervisedLauncher):
    name = "docker"

    def image(self, spec: RunSpec) -> str:
        return str(spec.options.get("image") or os.environ.get("FINETUNE_MCP_DOCKER_IMAGE") or DEFAULT_IMAGE)

    def supervisor_python(self, spec: RunSpec) -> str:
        # The training Python lives in the image; on the host any Python runs the stdlib supervisor.
        return sys.executable

    def render(self, spec: RunSpec) -> list[str]:
        env = dict(spec.env) or dict(os.environ)
        out_root = Path(spec.mounts["output_root"])
        cmd = ["docker", "run", "--rm", "--init", "--name", container_name(spec.run_ref)]
        if spec.device == "cuda":
            gpus = "all" if not spec.gpus or "all" in spec.gpus else f'"device={",".join(spec.gpus)}"'
            cmd += ["--gpus", gpus]
        cmd += ["--ipc=host", "--ulimit", "memlock=-1", "--ulimit", "stack=67108864"]
        cmd += ["-v", f"{host_hf_cache(env)}:{CONTAINER_HF_CACHE}"]
        cmd += ["-v", f"{Path(env.get('HOME') or Path.home()) / '.triton'}:{CONTAINER_TRITON_CACHE}"]
        cmd += ["-v", f"{out_root}:{out_root}"]
        for key in ("datasets", "base_models"):
            p = spec.mounts.get(key)
            if p is not None and not Path(p).resolve().is_relative_to(out_root.resolve()):
                cmd += ["-v", f"{p}:{p}:ro"]
        cmd += ["-w", str(spec.run_dir)]
        cmd += ["-e", "PYTHONUNBUFFERED=1"]
        for k in _PASS_ENV:
            if env.get(k):
                cmd += ["-e", k]  # by name: a token never appears on the command line
        python = str(spec.options.get("python") or os.environ.get("FINETUNE_MCP_DOCKER_PYTHON") or "python")
        inner = torchrun_argv(python, spec.nproc) if spec.nproc > 1 else [python]
        cmd += [self.image(spec), *inner, spec.script, "--config", str(spec.config_path)]
        return cmd

    def check(self, spec: RunSpec) -> None:
        line = shlex.join(self.render(spec))
        why = engine_unreachable()
        if why:
            raise Refused(
                f"no Docker engine is reachable here ({why}); nothing was launched",
                where="launcher=docker",
                fix=("start the Docker daemon (or fix DOCKER_HOST / membership of the docker group) and launch again, "
                     f"or use launcher='local'. The run would execute:\n{line}"),
            )

    def escalate(self, run_dir: Path, run_json: dict[str, Any]) -> None:
        # Killing the docker CLI would leave the container running; kill the container itself.
        subprocess.run(["docker", "kill", "--signal", "KILL", run_json.get("container") or container_name(run_json["run_id"])],
                       capture_output=True, timeout=30)

    def start(self, spec: RunSpec) -> dict[str, Any]:
        rec = super().start(spec)
        rec["container"] = container_name(spec.run_ref)
        rec["image"] = self.image(spec)
        return rec


def engine_unreachable(timeout: float = 10.0) -> str | None:
    """None when a Docker engine answers; else why not, in words."""
    exe = shutil.which("docker")
    if not exe:
        return "the docker CLI is not installed"
    try:
        p = subprocess.run([exe, "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"the engine did not answer within {timeout:.0f}s"
    if p.returncode != 0 or not p.stdout.strip():
        msg = (p.stderr or p.stdout).strip().splitlines()
        return "the engine did not answer: " + (msg[-1] if msg else f"docker version exited {p.returncode}")
    return None
