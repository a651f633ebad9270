# loraplex server image, in stages so that the runtime holds only what serving needs:
#   python   the base with Python 3 + venv (the CUDA bases have none) and the non-root user
#   deps     the serving dependencies from pyproject.toml into /opt/venv; the layer depends on pyproject.toml
#            alone, so a code change never re-installs torch
#   model    + the `convert` extra (transformers, gguf) and the fetch code: converts SmolLM2-135M-Instruct into
#            /opt/models once, at build time; only that folder leaves this stage
#   app      + the server and client packages (--no-deps) into /opt/venv
#   kernels  app + g++: `loraplex kernels` builds the native CPU kernels of every instruction set (avx512, avx2,
#            generic) into /opt/kernels, so the runtime serves them on any CPU without a compiler
#   convert  app + the convert extra: `loraplex fetch-model` for filling a model volume (built only on request)
#   runtime  python + /opt/venv from app + the model + the kernels + the demo adapters, run as uid 10001. No HEALTHCHECK:
#            Kubernetes' gRPC probes do that. Nothing is downloaded when a container starts.
# Build:
#   CPU:  docker build -t loraplex:0.1.0-cpu .
#   CUDA: docker build --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 -t loraplex:0.1.0-cuda .
# The CUDA base brings no CUDA libraries torch needs (its wheel carries its own); it brings Python-less Ubuntu
# plus the NVIDIA_* variables the NVIDIA container runtime reads to expose the GPU and driver.
# Pass --build-arg PIP_INDEX_URL=... / PIP_EXTRA_INDEX_URL=... to install from a mirror (or torch's CPU index).
ARG BASE=python:3.11-slim

FROM ${BASE} AS python
ARG DEBIAN_FRONTEND=noninteractive
# Python 3 with venv where the base has none (the CUDA images); the distribution's own version, so no pin.
# hadolint ignore=DL3008
RUN set -eux; \
    if ! command -v python3 >/dev/null; then \
        apt-get update; \
        apt-get install -y --no-install-recommends python3 python3-venv; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'
# The uid the Kubernetes manifests run as (deploy/k8s/base/deployment.yaml: runAsUser).
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/loraplex --shell /usr/sbin/nologin loraplex
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

FROM python AS deps
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
WORKDIR /build
COPY pyproject.toml ./
# [project].dependencies, exactly as pinned there: the serving dependencies and nothing else (but the in-repo
# loraplex-client, "name @ {root:uri}/...": the app stage installs it from its folder).
RUN python3 -m venv /opt/venv \
    && python3 -c 'import tomllib; print("\n".join(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] if " @ " not in d))' > serve.txt \
    && /opt/venv/bin/pip install -r serve.txt

FROM deps AS model
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
RUN python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["convert"]))' > convert.txt \
    && /opt/venv/bin/pip install -r convert.txt
# Only the modules fetch-model imports (tests/deploy/test_deploy.py checks the list), so other code changes keep the
# converted model cached.
COPY service/__init__.py service/errors.py service/fetch.py service/torch_threads.py service/
COPY service/loading service/loading
RUN PYTHONPATH=/build /opt/venv/bin/python -c \
    'from pathlib import Path; from service.fetch import fetch_model; fetch_model(Path("/opt/models/SmolLM2-135M-Instruct"))'

FROM deps AS app
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
COPY README.md ./
COPY clients/python clients/python
COPY service service
RUN /opt/venv/bin/pip install --no-deps ./clients/python .

# Not part of the default build: `docker build --target convert -t loraplex-convert:0.1.0 .` is the image of the
# model-volume component's Job (deploy/k8s/components/model-volume), the server plus fetch-model's converter.
FROM app AS convert
RUN python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["convert"]))' > convert.txt \
    && /opt/venv/bin/pip install -r convert.txt
ENV PATH=/opt/venv/bin:$PATH
USER 10001:10001
ENTRYPOINT ["loraplex", "fetch-model"]

FROM app AS kernels
ARG DEBIAN_FRONTEND=noninteractive
# The distribution's compiler, whatever its version: the libraries need only the C runtime and OpenMP (torch's).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && /opt/venv/bin/loraplex kernels --cache /opt/kernels

FROM python AS runtime
WORKDIR /app
COPY --from=app /opt/venv /opt/venv
COPY --from=model /opt/models /app/models
COPY --from=kernels /opt/kernels /opt/kernels
COPY adapters/demo /app/adapters/demo
ENV PATH=/opt/venv/bin:$PATH \
    LORAPLEX_KERNEL_CACHE=/opt/kernels
USER 10001:10001
# gRPC, the OpenAI-compatible HTTP API, then Prometheus /metrics (service.config.Settings defaults).
EXPOSE 50051 8000 9400
# The model is /app/models/SmolLM2-135M-Instruct (Settings' default, relative to /app); every other flag comes
# from LORAPLEX_* variables (in Kubernetes: the loraplex-config ConfigMap).
ENTRYPOINT ["loraplex", "serve", "--host", "0.0.0.0", "--metrics-host", "0.0.0.0"]
