# syntax=docker/dockerfile:1
# Trainer image (CUDA): NGC PyTorch base + the project's pinned runtime set + Ray's dashboard.
#
#   docker build -t musacoder-rl:train .        (or: bash docker/build.sh train)
#   docker run --gpus all --ipc=host --net=host musacoder-rl:train --config configs/qwen3_8b.yaml --model /ckpt/Qwen3-8B
#
# The base keeps its own torch, TransformerEngine, flash-attn and apex (compiled against each other);
# docker/install_lock.py installs requirements-cluster.lock around them and resolves the base's
# /etc/pip/constraint.txt (see its docstring). BASE_IMAGE's torch must be 2.11.x, the lock's; the build
# stops naming both versions otherwise. Pin the base by digest for a reproducible build:
#   --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:26.03-py3@sha256:<digest>
# SGLang is not in this image: it pins another transformers (docker/README.md); it runs from
# docker/Dockerfile.rollout. The code is not installed into a venv: it lives in /opt/musacoder-rl on
# PYTHONPATH, and the entrypoint runs the trainer.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.03-py3
FROM ${BASE_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONPATH=/opt/musacoder-rl \
    RAY_USAGE_STATS_ENABLED=0 \
    RAY_USE_UVLOOP=0 \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    TOKENIZERS_PARALLELISM=false \
    NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# iproute2 / dnsutils: node-IP resolution in launch/ray_cluster.sh; rsync: log sync; numactl: CPU binding.
RUN apt-get update \
 && apt-get install -y --no-install-recommends iproute2 dnsutils rsync numactl \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/musacoder-rl
# Dependencies first (their layer survives code edits).
COPY requirements.lock requirements-cluster.lock ./
COPY docker/install_lock.py docker/
RUN python docker/install_lock.py --lock requirements-cluster.lock \
        --extra "fla-core==0.4.2" --extra "einops==0.8.2" \
 && python -c "import megatron.core, transformers, ray, fla; print('imports ok')"

COPY . .
RUN chmod +x docker/entrypoint.sh launch/*.sh launch/*.sbatch

ENTRYPOINT ["/opt/musacoder-rl/docker/entrypoint.sh"]
CMD ["--config", "configs/quickstart.yaml"]
