"""Shared pytest fixtures."""
import pytest
import torch

from tests.tiny_gguf import build_gguf_fixtures
from tests.tiny_models import Fixtures, build_fixtures


@pytest.fixture(scope="session", autouse=True)
def expert_cache(tmp_path_factory):
    """Quantized-expert caches go to a temporary folder, never the user's ~/.cache/a3b-nodes; set in os.environ so
    the ComfyUI servers the tests start inherit it too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("A3B_CACHE_DIR", str(tmp_path_factory.mktemp("a3b-cache")))
        yield


@pytest.fixture(scope="session")
def fixtures() -> Fixtures:
    """Tiny checkpoints in every layout plus transformers reference outputs (built once, cached on disk)."""
    return build_fixtures()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices only pay for thread spin-up; one thread keeps such tests fast on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ggufs():
    """The tiny GGUF files (tests/tiny_gguf.py) of the tests that read GGUFs."""
    files = build_gguf_fixtures()
    if files is None:
        pytest.skip("llama.cpp's converter (the llama-cpp-python 0.3.36 source package) could not be downloaded "
                    "with pip, so no GGUF files can be made")
    return files
