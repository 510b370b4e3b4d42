import pytest

from tests.tiny_pair import make_tiny_pair


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_path, draft_path) of a tiny random-init Llama pair sharing one tokenizer."""
    return make_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))
