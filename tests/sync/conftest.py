import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "rollout"))

from rollout_helpers import served_fixture  # noqa: E402


@pytest.fixture
def served():
    yield from served_fixture()
