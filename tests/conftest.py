"""Shared pytest fixtures."""
import pytest

from tests.tiny_models import Fixtures, build_fixtures


@pytest.fixture(scope="session")
def fixtures() -> Fixtures:
    """Tiny checkpoints in every layout plus transformers reference outputs (built once, cached on disk)."""
    return build_fixtures()
