"""Where the device-generic tests run: the CPU here and in CI, a GPU under `scripts/gpu_smoke.sh`.

`DIALSPEC_TEST_DEVICE=cuda pytest tests/test_verifier_exactness.py ...` reruns the statistical
verifier tests with every tensor (and the verifier's random stream) on that device. Asking for a
device that is not there fails at import: a GPU run that silently fell back to the CPU would
report GPU results it never produced.
"""

from __future__ import annotations

import os

import torch

DEVICE = torch.device(os.environ.get("DIALSPEC_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    raise RuntimeError("DIALSPEC_TEST_DEVICE=cuda but torch sees no CUDA device")


def generator_like(gen: torch.Generator) -> torch.Generator:
    """`gen` itself on the CPU (so CPU runs keep their seeded streams); on another device a
    generator there, seeded from `gen` (deterministic, but a different stream)."""
    if DEVICE.type == "cpu":
        return gen
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    return torch.Generator(device=DEVICE).manual_seed(seed)
