"""A TorchDispatchMode that fails every op which would make the host wait for the device.

It watches what actually runs (every aten op dispatched while it is active), not the source.
"Device" means any non-CPU tensor: on a CPU-only machine the tests put the batch on torch's
`meta` device, which holds no data, so an op that needs device values on the host cannot even
pretend to work there; under `scripts/gpu_smoke.sh` the same tests run on CUDA.

Failing ops (CUDA semantics):
  * host reads of device values: `_local_scalar_dense` (`.item()`, `bool()`, `int()`, `float()`,
    `if tensor:`), `is_nonzero`, `equal`, and ops whose output size depends on values
    (`nonzero`, `masked_select`, `unique*`, `bincount`, boolean-mask indexing, `repeat_interleave`
    with a tensor of repeats and no `output_size`);
  * device -> host copies (`.cpu()`, `.tolist()`, `.numpy()`, `.to("cpu")`: `_to_copy` / `copy_` /
    `_copy_from` towards the CPU);
  * tensors built from Python data directly on the device (`torch.tensor(list, device=dev)`,
    `torch.as_tensor`: a pageable copy that synchronises the stream), or from a Python list of
    device values (`torch.tensor([t0, t1])`: one `.item()` each); these never reach the
    dispatcher as ops, so a TorchFunctionMode beside the dispatch mode watches the torch API;
  * host -> device copies, unless the detector was told the batch changed (`uploads=True`), and
    then only non-blocking ones and, on CUDA, from pinned memory (SGLang's own pattern).
`pause()` exempts a block (SGLang's own code around the hook bodies under test).
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_HOST_READS = {
    aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.nonzero, aten.masked_select,
    aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.bincount,
}  # fmt: skip
_COPIES = {aten._to_copy, aten.copy_, aten._copy_from}


class HostSync(AssertionError):
    """An op that would block the host until the device catches up."""


def _on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


def _copy_ends(func, args, kwargs):
    """`(src, dst_device, non_blocking)` of a copy op."""
    packet = func.overloadpacket
    if packet is aten._to_copy:
        src = args[0]
        return src, kwargs.get("device") or src.device, bool(kwargs.get("non_blocking", False))
    non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    if packet is aten.copy_:
        return args[1], args[0].device, non_blocking
    return args[0], args[1].device, non_blocking  # _copy_from(src, dst)


def _where() -> str:
    """The innermost frame of dialspec's code that issued the op."""
    for frame in reversed(traceback.extract_stack()):
        if "/server/" in frame.filename or "/verifier/" in frame.filename:
            return f"{frame.filename.split('/')[-1]}:{frame.lineno} `{frame.line}`"
    return "(outside dialspec)"


class SyncDetector:
    """Context manager: both modes below, sharing what is allowed."""

    def __init__(self, uploads: bool = False):
        self.uploads = uploads
        self.paused = 0
        self.uploaded = 0  # host -> device copies seen (allowed ones)
        self._modes = [_WatchOps(self), _WatchApi(self)]

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    @contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def fail(self, what, why: str):
        raise HostSync(f"{what}: {why} at {_where()}")


_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}


def _holds_device_tensor(data) -> bool:
    if isinstance(data, (list, tuple)):
        return any(_holds_device_tensor(x) for x in data)
    return _on_device(data)


class _WatchApi(TorchFunctionMode):
    def __init__(self, detector: SyncDetector):
        super().__init__()
        self.d = detector

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.d.paused and func in _FROM_DATA and args and not isinstance(args[0], torch.Tensor):
            if _holds_device_tensor(args[0]):
                self.d.fail(func.__name__, "a tensor built from a Python list of device values")
            if torch.device(kwargs.get("device") or "cpu").type != "cpu":
                self.d.fail(func.__name__, "a tensor built from Python data directly on the device")
        return func(*args, **kwargs)


class _WatchOps(TorchDispatchMode):
    def __init__(self, detector: SyncDetector):
        super().__init__()
        self.d = detector

    def _check(self, func, args, kwargs) -> None:
        d = self.d
        packet = func.overloadpacket
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        if not any(_on_device(t) for t in tensors) and packet not in _COPIES:
            return  # host-only work
        if packet in _HOST_READS:
            d.fail(func, "reads device values on the host")
        repeats_by_tensor = func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor)
        if repeats_by_tensor and kwargs.get("output_size") is None:
            d.fail(func, "repeat_interleave by a tensor of repeats without output_size")
        if packet in (aten.index, aten.index_put, aten.index_put_):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or []):
                d.fail(func, "boolean-mask indexing (a nonzero inside)")
        if packet in _COPIES:
            src, dst, non_blocking = _copy_ends(func, args, kwargs)
            dst = torch.device(dst)
            if _on_device(src) and dst.type == "cpu":
                d.fail(func, "copies device values to the host")
            if not _on_device(src) and dst.type != "cpu":
                if not d.uploads:
                    d.fail(func, "copies host data to the device in a step whose batch did not change")
                if not non_blocking:
                    d.fail(func, "blocking host -> device copy")
                if dst.type == "cuda" and not src.is_pinned():
                    d.fail(func, "host -> device copy from pageable memory (synchronises on CUDA)")
                d.uploaded += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.d.paused:
            self._check(func, args, kwargs)
        return func(*args, **kwargs)
