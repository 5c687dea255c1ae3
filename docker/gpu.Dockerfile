# polyshard on NVIDIA GPUs: CUDA 12.8 devel base (nvcc for DeepSpeed's ops), the pinned environment
# from constraints.txt, DeepSpeed's CPU-Adam and fused-Adam ops compiled at build time for the target
# architectures (no JIT build on the first step of a job), and a smoke test of every config.
# Build from the repository root:  docker build -f docker/gpu.Dockerfile -t polyshard-gpu .
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04
FROM ${CUDA_IMAGE}

# A100 (8.0), A10/3090 (8.6), L4/4090 (8.9), H100/H200 (9.0)
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0"
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    TORCH_NCCL_ASYNC_ERROR_HANDLING=3 \
    PATH=/opt/venv/bin:${PATH}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev \
       build-essential ninja-build libaio-dev git \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/polyshard
COPY pyproject.toml constraints.txt README.md ./
COPY parallel ./parallel
COPY backends ./backends
COPY configs ./configs
COPY examples ./examples

RUN python3.11 -m venv /opt/venv \
    && pip install --no-cache-dir -c constraints.txt -e '.[hf,deepspeed,bench]'
# Ops built now, for TORCH_CUDA_ARCH_LIST: DeepSpeed would otherwise JIT-compile them on every node
# at the first step (minutes, and a compiler in the runtime image).
RUN DS_BUILD_CPU_ADAM=1 DS_BUILD_FUSED_ADAM=1 DS_BUILD_UTILS=1 \
    pip install --no-cache-dir --no-build-isolation --force-reinstall --no-deps \
        -c constraints.txt 'deepspeed==0.19.8' \
    && ds_report

# Smoke test: every shipped spec validates inside the image.
RUN for config in configs/*.yaml; do polyshard validate "${config}" > /dev/null; done

ENTRYPOINT ["polyshard"]
CMD ["--help"]
