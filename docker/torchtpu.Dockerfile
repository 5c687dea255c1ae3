# polyshard on TPU VMs through TorchTPU (torch-tpu: torch_xla's successor, torch 2.11-2.15): the main
# lane's pinned environment (constraints.txt: torch 2.15) with torch's CPU wheel (TorchTPU brings the
# device) and torch-tpu with libtpu; jobs set topology.device: tpu on backend fsdp (docs/tpu.md).
# Not yet run on TPU hardware. A smoke test of every config.
# Build from the repository root:  docker build -f docker/torchtpu.Dockerfile -t polyshard-torchtpu .
FROM python:3.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    USE_TORCH_XLA=0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

WORKDIR /opt/polyshard
COPY pyproject.toml constraints.txt README.md ./
COPY parallel ./parallel
COPY backends ./backends
COPY configs ./configs
COPY examples ./examples

# torch at the main lane's pin from the CPU index (the CUDA build would add ~5 GB for nothing);
# libtcmalloc, which TorchTPU asks to be preloaded (its host allocator warning): the distribution's
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/* \
    && grep -vE '^(torch==|nvidia-|triton==|cuda-)' constraints.txt > /tmp/constraints-cpu.txt \
    && pip install --no-cache-dir -c /tmp/constraints-cpu.txt \
        --extra-index-url https://download.pytorch.org/whl/cpu \
        "torch==$(sed -n 's/^torch==//p' constraints.txt)" -e '.[torchtpu,hf]'
ENV LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

# Smoke test: every shipped spec validates inside the image (its own step, so a failing config is
# what the build log shows).
# hadolint ignore=DL3059
RUN for config in configs/*.yaml; do polyshard validate "${config}" > /dev/null; done

ENTRYPOINT ["polyshard"]
CMD ["--help"]
