import pytest

from tests.core.harness import Runner


@pytest.fixture
def rt() -> Runner:
    """A fresh CPU runner with a seeded random generator."""
    return Runner(seed=1234)
