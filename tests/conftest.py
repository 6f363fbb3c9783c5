import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def build_cache(tmp_path_factory):
    """One extension build cache for the session (content-addressed): a kernel library that tests in several
    folders use (tests/verifier_core/candidates.py) is compiled once, not once per folder. tests/run.sh sets
    MRL_TEST_VERIFIER_CACHE per tier, so the unit tier's parallel workers share one cache too."""
    shared = os.environ.get("MRL_TEST_VERIFIER_CACHE")
    if shared:
        os.makedirs(shared, exist_ok=True)
        return shared
    return str(tmp_path_factory.mktemp("verifier-build-cache"))


def pytest_configure(config):
    # The two tiers of tests/run.sh: unit = everything not marked slow; integration = marked slow.
    config.addinivalue_line("markers", "unit: in-process and quick (every test not marked slow)")
    config.addinivalue_line("markers", "integration: the slow tier (spawned ranks, Ray, compiles, end-to-end runs)")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the tier markers must be on the items by then
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.integration if "slow" in item.keywords else pytest.mark.unit)
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
