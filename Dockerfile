# syntax=docker/dockerfile:1
#
# dialspec images (see deploy/README.md). Build from the repository root:
#
#   docker build --target cpu -t dialspec:cpu .   # gateway + embedded CPU engine + embedded pair
#   docker build --target gpu -t dialspec:gpu .   # SGLang 0.5.23 runtime + dialspec's plugin
#
# Neither target has been built on this project's machines (no Docker engine there); the
# files are checked statically by tests/test_deploy.py.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm
# The official SGLang image whose sglang matches pyproject's `sglang==0.5.23` extra.
# Tags are `v<version>` (CUDA 13); CUDA 12 tags ended with v0.5.19-cu129.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# ---------------------------------------------------------------------------------------------
# cpu-build: a virtualenv in /opt/venv with CPU torch, the dependencies, and dialspec (editable,
# so the source tree keeps its layout: the embedded pair is found at /app/models/embedded).
FROM ${PYTHON_IMAGE} AS cpu-build
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the CPU index: an unpinned torch from PyPI pulls the multi-GB CUDA build.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /app
# Dependencies only (a layer that changes with pyproject.toml, not with every source edit).
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && python -c "import torch; assert not torch.version.cuda, 'CUDA torch slipped into the CPU image'"
# The sources (.dockerignore lets only the package folders and models/ through).
COPY . /app
RUN pip install --no-deps -e /app

# ---------------------------------------------------------------------------------------------
# cpu: the gateway on the embedded engine, as a non-root user.
FROM ${PYTHON_IMAGE} AS cpu
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/home/dialspec/.cache/huggingface
RUN groupadd --system --gid 10001 dialspec \
    && useradd --system --uid 10001 --gid dialspec --create-home --home-dir /home/dialspec dialspec
COPY --from=cpu-build /opt/venv /opt/venv
COPY --from=cpu-build /app /app
WORKDIR /app
USER dialspec
EXPOSE 8000
# Liveness (the process serves HTTP); readiness is GET /ready. The slim image has no curl.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
CMD ["dialspec", "serve", "--host", "0.0.0.0", "--port", "8000"]

# ---------------------------------------------------------------------------------------------
# gpu: the official SGLang image plus dialspec and its SGLang plugin (entry point group
# `sglang.srt.plugins`, loaded by launch_server and the scheduler processes).
FROM ${SGLANG_IMAGE} AS gpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1
WORKDIR /opt/dialspec
COPY . /opt/dialspec
# Every package the image already has is pinned as a constraint, so installing dialspec can add
# packages but never replace the image's torch / CUDA kernels / sglang: a conflict fails the build
# loudly instead of silently swapping the CUDA stack.
RUN python3 -m pip list --format=freeze --exclude-editable > /tmp/image-constraints.txt \
    && python3 -m pip install -c /tmp/image-constraints.txt -e "/opt/dialspec[sglang]" \
    && python3 -c "import sglang, torch, server; assert torch.cuda.is_available() or torch.version.cuda, 'the image lost its CUDA torch'; print('sglang', sglang.__version__, 'torch', torch.__version__)"
COPY deploy/scripts/runtime.sh /usr/local/bin/dialspec-runtime
COPY deploy/scripts/router.sh /usr/local/bin/dialspec-router
RUN chmod 0755 /usr/local/bin/dialspec-runtime /usr/local/bin/dialspec-router
EXPOSE 30000
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:30000/health"]
CMD ["dialspec-runtime"]
