import pytest

from rollout_helpers import served_fixture


@pytest.fixture
def served():
    yield from served_fixture()
