"""Load SGLang 0.5.23's chain rejection kernel (`reject_sampling.py`) by path, without SGLang.

That one file imports only triton, so it runs where SGLang cannot be installed: on the CPU through
Triton's interpreter (`TRITON_INTERPRET=1`, CI) and on a bare CUDA machine that has triton but no
SGLang (`scripts/gpu_smoke.sh` carries a copy taken from the installed wheel). The file is read
from `DIALSPEC_SGLANG_KERNEL_FILE` when set, else from the installed `sglang` package.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

KERNEL_RELPATH = Path("kernels/ops/speculative/reject_sampling.py")
ENV_FILE = "DIALSPEC_SGLANG_KERNEL_FILE"


def kernel_file() -> Path:
    if os.environ.get(ENV_FILE):
        path = Path(os.environ[ENV_FILE])
    else:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"sglang is not installed and {ENV_FILE} is unset: run `make test` (installs "
                "sglang==0.5.23 --no-deps) or `scripts/gpu_smoke.sh prepare`"
            )
        path = Path(spec.submodule_search_locations[0]) / KERNEL_RELPATH
    if not path.is_file():
        raise FileNotFoundError(f"SGLang chain kernel not found at {path}")
    return path


def load_chain_kernel(interpret: bool):
    """The module object of `reject_sampling.py`; `interpret` makes its kernels Triton-interpreted
    (decided when `@triton.jit` runs, i.e. at load, so the flag is set only around the load)."""
    path = kernel_file()
    name = f"_dialspec_sglang_reject_sampling_{'interp' if interpret else 'jit'}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        spec.loader.exec_module(module)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return module
