import pytest

from verifier.config import VerifierConfig


@pytest.fixture(scope="session")
def make_cfg(build_cache):
    """Config factory for end-to-end tests: small timing protocol, the session's build cache
    (tests/conftest.py)."""

    def make(**overrides):
        base = dict(build_cache_dir=build_cache, num_timing_trials=5, num_warmup=1, time_budget_s=2.0,
                    max_jobs=2, run_timeout_s=120.0)
        base.update(overrides)
        return VerifierConfig(**base)

    return make
