"""Device-side input creation: same seed -> bitwise-identical inputs, in any process."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from verifier.inputs import generate, make_inputs
from verifier.tasks import load_task, load_task_module

from .candidates import task_path

CHILD = r'''
import sys
sys.path.insert(0, {root!r})
import pytest
import torch
from safetensors.torch import save_file
from verifier.inputs import make_inputs
from verifier.tasks import load_task, load_task_module
torch.manual_seed(12345)  # unrelated global RNG state must not matter
module = load_task_module(load_task({task!r}))
xs = make_inputs(module, {seed}, "cpu", "float16")
save_file({{str(i): x for i, x in enumerate(xs) if isinstance(x, torch.Tensor)}}, {out!r})
'''


def test_parent_and_other_process_make_bitwise_identical_inputs(tmp_path):
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    task = task_path("mixed_inputs")
    seed = 2 ** 62 + 12345
    out = str(tmp_path / "inputs.safetensors")
    subprocess.run([sys.executable, "-c", CHILD.format(root=root, task=task, seed=seed, out=out)], check=True,
                   timeout=120)
    theirs = load_file(out)
    torch.manual_seed(999)
    mine = make_inputs(load_task_module(load_task(task)), seed, "cpu", "float16")
    tensors = [x for x in mine if isinstance(x, torch.Tensor)]
    assert len(tensors) == len(theirs) == 6
    for i, x in enumerate(mine):
        if isinstance(x, torch.Tensor):
            y = theirs[str(i)]
            assert x.dtype == y.dtype and torch.equal(x.view(-1).view(torch.uint8) if x.is_floating_point()
                                                      else x, y.view(-1).view(torch.uint8) if y.is_floating_point()
                                                      else y)


def test_seed_changes_inputs_precision_casts_floats_only():
    module = load_task_module(load_task(task_path("mixed_inputs")))
    a = make_inputs(module, 1, "cpu", "bfloat16")
    b = make_inputs(module, 2, "cpu", "bfloat16")
    assert not torch.equal(a[0], b[0]) and not torch.equal(a[2], b[2]) and not torch.equal(a[3], b[3])
    assert a[0].dtype == torch.bfloat16 and a[1].dtype == torch.int64 and a[5].dtype == torch.int64
    assert a[4] == 3
    assert float(a[2].min()) >= -1.0 and float(a[2].max()) <= 1.0
    again = make_inputs(module, 1, "cpu", "bfloat16")
    assert all(torch.equal(x, y) for x, y in zip(a, again) if isinstance(x, torch.Tensor))


def test_factories_are_redirected_and_seeded():
    made = generate(lambda: [torch.randn(3), torch.ones(2), torch.tensor([1.0, 2.0]),
                             torch.rand_like(torch.empty(4))], 7, "cpu", "float32")
    torch.manual_seed(0)
    again = generate(lambda: [torch.randn(3), torch.ones(2), torch.tensor([1.0, 2.0]),
                              torch.rand_like(torch.empty(4))], 7, "cpu", "float32")
    assert all(torch.equal(x, y) for x, y in zip(made, again))
    assert json.dumps([list(x.shape) for x in made]) == "[[3], [2], [2], [4]]"


def test_reseeding_with_cuda_up_seeds_every_cuda_generator_and_the_host_ones(monkeypatch):
    """Once CUDA is initialised the reseed before each timed call goes to the generators directly (torch.manual_seed
    walks every backend in Python, time a device waiting for the host charges to the call): the CPU generator, every
    CUDA device's generator, ``random`` and numpy all get the same fresh seed, and two reseeds differ."""
    import random

    import numpy as np

    from verifier import inputs

    class FakeGenerator:
        seeds: list = []

        def manual_seed(self, seed):
            self.seeds.append(seed)

    devices = (FakeGenerator(), FakeGenerator())
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "default_generators", devices, raising=False)
    monkeypatch.setattr(torch, "manual_seed", lambda seed: pytest.fail("torch.manual_seed on the timed path"))
    inputs.reseed_unpredictably()
    first = torch.default_generator.initial_seed()
    assert FakeGenerator.seeds == [first, first]
    assert random.random() == random.Random(first).random()
    assert np.random.get_state()[1][0] == np.random.RandomState(first % 2 ** 32).get_state()[1][0]
    inputs.reseed_unpredictably()
    assert torch.default_generator.initial_seed() != first and FakeGenerator.seeds[2:] == [torch.initial_seed()] * 2
