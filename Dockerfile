# Production image: CUDA + PyTorch base, the project's pinned requirements, then the code.
# SGLang and TransformerEngine are optional extras installed on top for real clusters.
FROM nvcr.io/nvidia/pytorch:25.10-py3
WORKDIR /opt/musacoder-rl
COPY requirements.txt .
RUN python -m pip install --no-cache-dir -r requirements.txt
ARG WITH_SGLANG=1
RUN if [ "$WITH_SGLANG" = "1" ]; then python -m pip install --no-cache-dir "sglang[all]" sglang-router; fi
COPY . .
ENV PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
CMD ["bash", "launch/quickstart.sh"]
