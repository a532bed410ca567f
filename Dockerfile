# finetune-mcp GPU image: the MCP server plus the training stack, on NVIDIA's NGC PyTorch base.
#
# The NGC image is multi-arch: on a DGX Spark (arm64, GB10, CUDA 13 required) and on amd64 NVIDIA
# boxes the same tag resolves to the right platform. 25.09 is the CUDA 13.0 release that NVIDIA's
# DGX Spark Unsloth playbook uses.
#
#   docker build -t finetune-mcp:gpu .   (the tag the docker launcher uses; FINETUNE_MCP_DOCKER_IMAGE overrides)
#   docker run --rm -i --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
#     -v "$HOME/.cache/huggingface:/root/.cache/huggingface" \
#     -v "$HOME/.triton:/root/.triton" \
#     -v "${DGX_SPARK_ROOT:-$HOME/dgx-spark}:${DGX_SPARK_ROOT:-$HOME/dgx-spark}" \
#     -v "${OUTPUT_ROOT:-${DGX_SPARK_ROOT:-$HOME/dgx-spark}/outputs/trainings}:${OUTPUT_ROOT:-${DGX_SPARK_ROOT:-$HOME/dgx-spark}/outputs/trainings}" \
#     -e DGX_SPARK_ROOT="${DGX_SPARK_ROOT:-$HOME/dgx-spark}" -e OUTPUT_ROOT \
#     finetune-mcp:gpu serve --role training-engineer
#
# Caches are bind-mounted at the in-container defaults (HF_HOME untouched); DGX_SPARK_ROOT and
# OUTPUT_ROOT are mounted at the same path inside and out, so a run dir printed in a log is a path
# that exists on the host (layout seed, rule 6).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.09-py3
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/finetune-mcp
COPY pyproject.toml README.md ./
COPY server ./server
COPY roles ./roles
COPY skills ./skills

# Keep NGC's CUDA build of torch: the constraint stops pip from swapping in a PyPI wheel built for
# another CUDA (on GB10, a CUDA 12 wheel fails with a missing libcudart.so.12). Unsloth and
# bitsandbytes go in with --no-deps, as NVIDIA's DGX Spark playbook installs them, so their pins
# cannot downgrade the stack either.
RUN pip list --format=freeze | grep -iE '^(torch|torchvision|torchaudio|triton)==' > /tmp/keep.txt \
 && pip install --no-cache-dir -c /tmp/keep.txt ".[train]" \
 && pip install --no-cache-dir --no-deps unsloth==2026.10.9 unsloth-zoo==2026.10.9 bitsandbytes==0.50.2 \
 && rm /tmp/keep.txt

ENTRYPOINT ["finetune-mcp"]
CMD ["serve", "--role", "training-engineer"]
