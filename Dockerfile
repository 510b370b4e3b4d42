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
# The official SGLang image whose sglang matches pyproject's `sglang==0.5.23` extra. Its tag could
# not be pulled from the project's machines: check `docker manifest inspect lmsysorg/sglang:v0.5.23`
# before the first build (release tags are `v<version>`; CUDA 12 variants carry `-cu12x`).
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
# Dependencies only (a layer that changes with pyproject.toml, not with every source edit), with
# the `structured` extra (xgrammar: response_format), so the image serves structured outputs.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['structured']))" > /tmp/requirements.txt \
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
# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd (hadolint DL3066).
USER 10001:10001
EXPOSE 8000
# Liveness (the process serves HTTP); readiness is GET /ready. The slim image has no curl.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
CMD ["dialspec", "serve", "--host", "0.0.0.0", "--port", "8000"]

# ---------------------------------------------------------------------------------------------
# gpu: the official SGLang image plus dialspec and its SGLang plugin (entry point group
# `sglang.srt.plugins`, loaded by launch_server and the scheduler processes).
#
# Host requirement: sglang 0.5.23's wheel pins torch==2.14.1 and CUDA 13 packages
# (cuda-python>=13.0, flashinfer_python[cu13], nvidia-cutlass-dsl[cu13], nvshmem4py-cu13;
# Requires-Dist of its METADATA), so the node needs an NVIDIA driver for CUDA 13: >= 580
# (580.65.06 on Linux) and the NVIDIA Container Toolkit.
FROM ${SGLANG_IMAGE} AS gpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1
WORKDIR /opt/dialspec
COPY . /opt/dialspec
# The image installs sglang editable (upstream docker/Dockerfile: `pip install -e "python[...]"`
# in /sgl-workspace/sglang), and `pip list --exclude-editable` leaves editable packages out of the
# constraints (pip refuses editables there). Installing `.[sglang]` would then let pip fetch
# sglang==0.5.23 from PyPI over the image's whenever the editable's version string differs, so
# the extra is NOT installed: the image's sglang is used as is. Every other package the image
# has is a constraint, so dialspec's dependencies can be added but never replace the CUDA stack
# (a conflict fails the build); and the build fails unless torch's and sglang's versions and
# locations are the same afterwards and sglang is the version pyproject pins.
RUN STACK='import importlib.metadata as m, sglang, torch; print(torch.__version__, torch.__file__, m.version("sglang"), sglang.__file__)' \
    && python3 -c "$STACK" > /tmp/stack-before.txt \
    && python3 -m pip list --format=freeze --exclude-editable > /tmp/image-constraints.txt \
    && python3 -m pip install -c /tmp/image-constraints.txt -e /opt/dialspec \
    && python3 -c "$STACK" > /tmp/stack-after.txt \
    && { diff /tmp/stack-before.txt /tmp/stack-after.txt || { echo "installing dialspec changed the image's torch/sglang" >&2; exit 1; }; } \
    && python3 -c "import importlib.metadata as m, tomllib; want = [r.split('==')[1] for r in tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['sglang'] if r.startswith('sglang==')][0]; have = m.version('sglang'); assert have == want, f'image has sglang {have}, dialspec pins {want}'" \
    && python3 -c "import torch, server.sglang_plugin; assert torch.version.cuda, 'the image lost its CUDA torch'; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
COPY deploy/scripts/router.sh /usr/local/bin/dialspec-router
RUN chmod 0755 /usr/local/bin/dialspec-router
EXPOSE 30000
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:30000/health"]
# The one source of SGLang's launch flags (server/runtime_cli.py); settings from the environment.
CMD ["dialspec", "runtime", "launch", "--host", "0.0.0.0"]
