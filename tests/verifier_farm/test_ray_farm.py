"""The farm on Ray actors (CPU, ray.init(num_cpus=2)), and the in-process farm without Ray."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import farm_fakes as ff
from verifier.farm import FarmConfig
from verifier.types import Category

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.slow
def test_ray_farm_on_cpu(tmp_path):
    ray = pytest.importorskip("ray")
    from verifier.ray_farm import RayVerifierFarm

    (tmp_path / "m").mkdir()
    m = str(tmp_path / "m")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([ROOT, HERE])}})
    try:
        farm = RayVerifierFarm(ff.FakeConfig(build_cache_dir=str(tmp_path / "b")),
                               FarmConfig(build_fn=ff.fake_build, run_fn=ff.fake_run, precheck_fn=ff.fake_precheck,
                                          max_retries=1))
        try:
            assert len(farm._compile.slots) == 1 and len(farm._device.slots) == 1  # 2 CPUs: 1 + 1 actors
            items = [(ff.FakeTask("a"), "ok"), (ff.FakeTask("b"), "wrong"), (ff.FakeTask("c"), f"crash_once:{m}c"),
                     (ff.FakeTask("d"), f"infra_once:{m}d"), (ff.FakeTask("e"), "FORMAT"),
                     (ff.FakeTask("f"), "build_fail"), (ff.FakeTask("g"), "crash_always")]
            futs = farm.submit_batch(items)
            rs = [f.result(timeout=120) for f in futs]
            again = farm.verify_batch([(ff.FakeTask("a"), "ok")])[0]
            st = farm.stats()
        finally:
            farm.close()
    finally:
        ray.shutdown()
    assert [r.category for r in rs] == [Category.PASS, Category.CORRECTNESS_ERROR, Category.PASS, Category.PASS,
                                        Category.FORMAT_ERROR, Category.COMPILE_ERROR, Category.INFRA]
    assert [r.attempts for r in rs] == [1, 1, 2, 2, 1, 1, 2]
    assert "actor died" in rs[2].details["infra_history"][0]
    assert rs[0].details["pid"] != os.getpid()  # ran inside an actor
    assert again.cached and st["device"]["restarts"] >= 3


def test_in_process_farm_works_without_ray(tmp_path):
    code = f"""
import sys
sys.modules["ray"] = None  # any 'import ray' now raises ImportError
sys.path[:0] = [{ROOT!r}, {HERE!r}]
import verifier.farm, verifier.ray_farm  # importing the Ray farm module must not need Ray
import farm_fakes as ff
from verifier.farm import FarmConfig, VerifierFarm
with VerifierFarm(ff.FakeConfig(build_cache_dir={str(tmp_path)!r}),
                  FarmConfig(compile_mode="thread", device_mode="thread", build_fn=ff.fake_build,
                             run_fn=ff.fake_run, precheck_fn=ff.fake_precheck)) as farm:
    r = farm.verify_batch([(ff.FakeTask("a"), "ok")])[0]
print(r.category.value)
try:
    verifier.ray_farm.RayVerifierFarm(ff.FakeConfig())
except ImportError:
    print("no-ray")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["pass", "no-ray"]
