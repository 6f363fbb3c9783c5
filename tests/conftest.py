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


# The integration tier's longest tests (tests/run.sh prints each tier's slowest), in the order they should start when
# the tier runs in parallel (one test at a time per worker, in collection order): started first, the last test to
# finish is a short one. A prefix of a node id; the rest keep their order.
LONGEST_FIRST = (
    "tests/sft/test_recipe.py::test_reduced_recipe_orders_the_stages",
    "tests/launch/test_slurm.py::test_real_slurm_selftest",
    "tests/trainer/test_train_e2e.py::test_toy_learns_through_ray",
    "tests/trainer/test_train_e2e.py::test_resume_after_kill",
    "tests/verifier_core/test_pch.py::",
    "tests/verifier_farm/test_cli.py::test_real_candidate_check_then_eval",
    "tests/ckpt_tools/test_ckpt_hybrid.py::",
    "tests/actor/test_actor_parallel.py::",
    "tests/agent/test_agent_real_verifier.py::",
    "tests/sft/test_sft_train.py::test_resume_after_kill",
)


def _start_rank(item) -> int:
    return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)), len(LONGEST_FIRST))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the tier markers must be on the items by then
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.integration if "slow" in item.keywords else pytest.mark.unit)
    items.sort(key=_start_rank)   # stable: every worker of a parallel run sorts to the same order
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


def pytest_runtest_logreport(report):
    """With MRL_TEST_FAILED_FILE set (tests/run.sh), append the node id of every failed test to it, so that a test
    that failed under a parallel tier's load can be run again alone. The controller writes it (an xdist worker's
    reports reach the controller too)."""
    path = os.environ.get("MRL_TEST_FAILED_FILE")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a", encoding="utf-8") as f:
            f.write(report.nodeid + "\n")
