# loraplex server image: what `make serve` installs (the venv with the server, the client and the dev tools,
# and the default model), run as a non-root user. One Dockerfile, two bases:
#   CPU:  docker build -t loraplex:0.1.0-cpu .
#   CUDA: docker build --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 -t loraplex:0.1.0-cuda .
# The CUDA base brings no CUDA libraries torch needs (its wheel carries its own); it brings Python-less Ubuntu
# plus the NVIDIA_* variables the NVIDIA container runtime reads to expose the GPU and driver.
# Pass --build-arg PIP_INDEX_URL=... / PIP_EXTRA_INDEX_URL=... to install from a mirror.
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG DEBIAN_FRONTEND=noninteractive
# make, plus Python 3 with venv where the base has none (the CUDA images).
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends make ca-certificates \
        $(command -v python3 >/dev/null || echo python3 python3-venv); \
    rm -rf /var/lib/apt/lists/*; \
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'

# The uid the Kubernetes manifests run as (deploy/k8s/base/deployment.yaml: runAsUser).
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/loraplex --shell /usr/sbin/nologin loraplex
WORKDIR /app
RUN chown loraplex:loraplex /app
USER 10001:10001

# Only what `make setup model` reads: the Makefile, the two pyproject files and the packages they install.
COPY --chown=10001:10001 Makefile pyproject.toml README.md ./
COPY --chown=10001:10001 clients/python clients/python
COPY --chown=10001:10001 service service

ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1
# The same targets `make serve` runs before serving: setup (venv + pip install) and model (fetch-model).
RUN make setup model

ENV PATH=/app/.venv/bin:$PATH
# gRPC, then Prometheus /metrics (service.config.Settings defaults).
EXPOSE 50051 9400
# Every other flag comes from LORAPLEX_* variables (in Kubernetes: the loraplex-config ConfigMap).
ENTRYPOINT ["loraplex", "serve", "--host", "0.0.0.0", "--metrics-host", "0.0.0.0"]
