"""Corpus sweep 35: KernelBench's own tasks (levels 1-4, HEAD and two older revisions) loaded, fitted and run.

Fixed here (each was wrong before), each pinned with a short task written for the test (no KernelBench file):
- ``fit`` shrank integer constants and integer tuples but not integer lists: KernelBench's MLPs give their hidden
  widths as ``layer_sizes = [16384, 16384]`` or ``[1024] * 16``, so level3/1_MLP, 2_ShallowWideMLP and 3_DeepNarrowMLP
  kept 0.07-4.3 GB of parameters and never fitted (on a CPU the verifier then answered ``infra`` for the memory).
"""
from __future__ import annotations

import pytest
import torch

from verifier.size_profiles import fit_sizes, int_constants, meta_cost
from verifier.tasks import load_task, load_task_module

BUDGET = (64 << 20, 2 * 10**9)

# hidden widths as a list passed through get_init_inputs (KernelBench level3/1_MLP's form)
MLP = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, input_size, layer_sizes, output_size):
        super().__init__()
        dims = [input_size, *layer_sizes]
        self.net = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(dims, dims[1:])], nn.Linear(dims[-1], output_size))

    def forward(self, x):
        return torch.relu(self.net(x))


batch_size = 8
input_size = 512
layer_sizes = [8192, 8192]
output_size = 256


def get_inputs():
    return [torch.rand(batch_size, input_size)]


def get_init_inputs():
    return [input_size, layer_sizes, output_size]
'''

# ... and as a repeated list (level3/3_DeepNarrowMLP's form)
DEEP_MLP = MLP.replace("layer_sizes = [8192, 8192]", "layer_sizes = [2048] * 6")


def _task(tmp_path, name: str, source: str, level: int = 3):
    path = tmp_path / f"level{level}" / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return load_task(str(path))


def _run(task) -> torch.Tensor:
    module = load_task_module(task, module_name="corpus35_task")
    with torch.no_grad():
        return module.Model(*module.get_init_inputs())(*module.get_inputs())


@pytest.mark.parametrize("name,source,before", [("1_MLP", MLP, [8192, 8192]), ("3_DeepNarrowMLP", DEEP_MLP, [2048] * 6)])
def test_list_layer_widths_are_sizes_fit_shrinks(tmp_path, name, source, before):
    task = _task(tmp_path, name, source)
    assert int_constants(task.source)["layer_sizes"] == before
    assert not meta_cost(task).within(*BUDGET)          # the hidden layers' parameters alone exceed 64 MiB
    fitted, resized = fit_sizes(task)
    assert meta_cost(fitted).within(*BUDGET), resized
    old, new = resized["layer_sizes"]
    assert old == before and isinstance(new, list) and len(new) == len(before) and sum(new) < sum(before)
    assert fitted.meta["resized"]["layer_sizes"] == [before, new]
    module = load_task_module(fitted, module_name="corpus35_fitted")
    assert module.layer_sizes == new                      # still a list: the task's own code sees what it expects
    out = _run(fitted)
    assert out.shape == (module.batch_size, module.output_size) and torch.isfinite(out).all()
