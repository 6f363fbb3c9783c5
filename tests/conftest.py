import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def verifier_cache_root(tmp_path_factory):
    """The verifier's caches for the whole run: `builds/` (extension builds, content-addressed, with their
    precompiled headers) and `verdicts.sqlite`. tests/run.sh points MRL_TEST_VERIFIER_CACHE at one directory for
    both tiers, so the integration tier reuses what the unit tier compiled; without it, one per session."""
    root = os.environ.get("MRL_TEST_VERIFIER_CACHE")
    if root:
        os.makedirs(os.path.join(root, "builds"), exist_ok=True)
        return root
    root = str(tmp_path_factory.mktemp("verifier-cache"))
    os.makedirs(os.path.join(root, "builds"))
    return root


@pytest.fixture(scope="session")
def build_cache(verifier_cache_root):
    """One extension build cache for the run (content-addressed): a kernel library that tests in several
    folders use (tests/verifier_core/candidates.py) is compiled once, not once per folder."""
    return os.path.join(verifier_cache_root, "builds")


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
