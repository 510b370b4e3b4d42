import atexit
import os
import shutil
import tempfile

import pytest

# Triton decides at import whether its JIT functions are compiled or interpreted, for triton's own
# library functions too; without a GPU, SGLang's kernels can only run interpreted
# (tests/test_sglang_chain_kernel.py), so the CPU run sets it before anything imports triton.
if os.environ.get("DIALSPEC_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Servers started by tests (in-process or as subprocesses) cache measured cost models and dtype
# choices here, never in the user's ~/.cache.
if "DIALSPEC_CACHE_DIR" not in os.environ:
    os.environ["DIALSPEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="dialspec-test-cache-")
    atexit.register(shutil.rmtree, os.environ["DIALSPEC_CACHE_DIR"], True)

from tests.tiny_pair import make_tiny_pair  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_path, draft_path) of a tiny random-init Llama pair sharing one tokenizer."""
    return make_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))


@pytest.fixture(autouse=True)
def _root_log_handlers():
    """`dialspec serve` run in-process calls logging.basicConfig, which binds a handler to the
    test's captured stderr; drop it afterwards so later tests do not log into a closed stream."""
    import logging

    before = list(logging.root.handlers)
    yield
    for handler in logging.root.handlers[:]:
        if handler not in before:
            logging.root.removeHandler(handler)
