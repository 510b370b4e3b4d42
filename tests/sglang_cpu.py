"""SGLang 0.5.23's heavy modules on CPU: imported with a stand-in torchvision, then withdrawn.

`sglang.srt.configs` imports torchvision at module level, and PyPI only carries CUDA torchvision
wheels, which do not load next to CPU torch; no torchvision attribute is used by the code under
test. `import_heavy` puts a stand-in on the import path for the duration of the imports only and
removes it afterwards, so other tests never see it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

HEAVY = [
    "sglang.srt.model_executor.forward_batch_info",
    "sglang.srt.speculative.eagle_info",
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.speculative.eagle_utils",
    "sglang.srt.speculative.eagle_worker_v2",
    "sglang.srt.speculative.standalone_worker_v2",
    "sglang.srt.speculative.eagle_draft_cuda_graph_runner",
    "sglang.srt.speculative.eagle_worker_common",
    "sglang.srt.model_executor.model_runner",
    "sglang.kernels.ops.speculative.reject_sampling",
    "sglang.srt.managers.scheduler",
]


class _Anything:
    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return _Anything()

    def __getattr__(self, name):
        return _Anything()

    def __mro_entries__(self, bases):
        return (object,)


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StandInModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        pass


def import_heavy(names=None) -> dict:
    """Import SGLang's speculative modules with torchvision stood in, then withdraw the stand-in."""
    finder = _TorchvisionStandIn()
    sys.meta_path.insert(0, finder)
    try:
        mods = {name: importlib.import_module(name) for name in (names or HEAVY)}
    finally:
        sys.meta_path.remove(finder)
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    return mods
