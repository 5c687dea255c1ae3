# polyshard on TPU VMs: torch 2.9 (CPU wheel: the TPU does the compute) with torch_xla 2.9 and libtpu,
# the XLA lane's pinned environment (constraints-xla.txt: torch_xla 2.9.0 needs exactly torch 2.9.0;
# docs/lanes.md), and a smoke test of every config.
# Build from the repository root:  docker build -f docker/tpu.Dockerfile -t polyshard-tpu .
FROM python:3.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    PJRT_DEVICE=TPU \
    USE_TORCH_XLA=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

WORKDIR /opt/polyshard
COPY pyproject.toml constraints-xla.txt README.md ./
COPY parallel ./parallel
COPY backends ./backends
COPY configs ./configs
COPY examples ./examples

# torch from the CPU index (the CUDA build would add ~5 GB for nothing); libtpu from Google's index.
RUN pip install --no-cache-dir -c constraints-xla.txt \
        --extra-index-url https://download.pytorch.org/whl/cpu \
        -f https://storage.googleapis.com/libtpu-wheels/index.html \
        -f https://storage.googleapis.com/libtpu-releases/index.html \
        -e '.[tpu,hf]'

# Smoke test: every shipped spec validates inside the image (its own step, so a failing config is
# what the build log shows).
# hadolint ignore=DL3059
RUN for config in configs/*.yaml; do polyshard validate "${config}" > /dev/null; done

ENTRYPOINT ["polyshard"]
CMD ["--help"]
