# syntax=docker/dockerfile:1
# Sluice edge: the OpenAI-compatible HTTP API on 8080. No torch, no transformers, no GPU.
#
#   docker build -f deploy/edge.Dockerfile -t sluice-edge .     (from the repository root)
#
# The project's dependency list is the worker's (torch, transformers); the edge imports none of
# those, so this image installs deploy/edge-requirements.txt and then the project with --no-deps.
# tests/deploy checks that the list covers every package the edge imports and matches the
# versions in pyproject.toml.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/sluice
COPY deploy/edge-requirements.txt ./
RUN python -m pip install -r edge-requirements.txt
COPY pyproject.toml README.md ./
COPY sluice ./sluice
COPY edge ./edge
RUN python -m pip install --no-deps .

COPY --chmod=755 deploy/healthcheck.py /usr/local/bin/sluice-healthcheck

# A fixed numeric uid, so Kubernetes can verify runAsNonRoot. The edge writes no files, except
# with several processes: their metrics, in a temporary folder (/tmp).
RUN useradd --system --uid 10001 --user-group --no-create-home sluice \
    && mkdir -p /var/lib/sluice && chown 10001:10001 /var/lib/sluice
USER 10001:10001
# The state store's SQLite file (stored Responses; docs/operations.md, "State"): mount a volume
# here to keep it, or set SLUICE_EDGE_STATE_URL to share PostgreSQL between edges.
ENV SLUICE_EDGE_STATE_DIR=/var/lib/sluice
VOLUME ["/var/lib/sluice"]

# Inside a container the edge must listen on every interface (its own default is 127.0.0.1).
# One edge process per CPU core the container may use (they share the port; --processes).
ENV SLUICE_EDGE_HOST=0.0.0.0 \
    SLUICE_EDGE_PROCESSES=0
EXPOSE 8080
# Liveness only: /ready (at least one worker SERVING) is the orchestrator's readiness signal.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["sluice-healthcheck", "http"]
# Configure with SLUICE_EDGE_* variables or flags after the image name (docs/configuration.md);
# SLUICE_EDGE_WORKERS (the worker addresses) has no default.
ENTRYPOINT ["sluice-edge"]
CMD []
