import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def build_cache(tmp_path_factory):
    """One extension build cache for the whole session (content-addressed): a kernel library that tests in
    several folders use (tests/verifier_core/candidates.py) is compiled once, not once per folder."""
    return str(tmp_path_factory.mktemp("verifier-build-cache"))


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
