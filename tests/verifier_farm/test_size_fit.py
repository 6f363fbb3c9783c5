"""The `fit` size profile: KernelBench tasks at their own GPU sizes shrunk to a CPU budget, sized on meta tensors,
with every relation between the constants kept (a name defined from another follows it) and the reference still
running, for real, on the new shapes."""
from __future__ import annotations

import pytest
import torch

from verifier.size_profiles import (FIT_MIN_VALUE, apply_size_profile, fit_sizes, int_constants, meta_cost,
                                    parse_fit_profile)
from verifier.tasks import load_task, load_task_module

HEADER = "import torch\nimport torch.nn as nn\n\n"

RELU = HEADER + '''class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)

batch_size = 4096
dim = 393216

def get_inputs():
    return [torch.rand(batch_size, dim)]

def get_init_inputs():
    return []
'''

MATMUL_T = HEADER + '''class Model(nn.Module):
    def forward(self, A, B):
        return torch.matmul(A.T, B)

M = 1024 * 2
K = 4096 * 2
N = 2048 * 2

def get_inputs():
    return [torch.rand(K, M), torch.rand(K, N)]

def get_init_inputs():
    return []
'''

DEPTHWISE = HEADER + '''class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size_h, kernel_size_w, groups):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, (kernel_size_h, kernel_size_w), groups=groups, bias=False)

    def forward(self, x):
        return self.conv(x)

batch_size = 32
in_channels = 128
out_channels = in_channels
kernel_size_h = 3
kernel_size_w = 7
height = width = 512
groups = in_channels

def get_inputs():
    return [torch.rand(batch_size, in_channels, height, width)]

def get_init_inputs():
    return [in_channels, out_channels, kernel_size_h, kernel_size_w, groups]
'''

# heads must divide the embedding: a halving that breaks it fails on meta and is not taken
ATTENTION = HEADER + '''class Model(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.attn = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x)[0]

batch_size = 64
seq_len = 2048
embed_dim = 48
num_heads = 48

def get_inputs():
    return [torch.rand(batch_size, seq_len, embed_dim)]

def get_init_inputs():
    return [embed_dim, num_heads]
'''

# KernelBench's HingeLoss: targets of shape (batch,) broadcast against the last input dim, so batch_size and the
# tuple input_shape only shrink together
HINGE = HEADER + '''class Model(nn.Module):
    def forward(self, predictions, targets):
        return torch.mean(torch.clamp(1 - predictions * targets, min=0))

batch_size = 32768
input_shape = (32768,)
dim = 1

def get_inputs():
    return [torch.rand(batch_size, *input_shape), torch.randint(0, 2, (batch_size,)).float() * 2 - 1]

def get_init_inputs():
    return []
'''

SMALL = RELU.replace("4096", "16").replace("393216", "64")

# get_inputs reads a value: it cannot run on meta tensors, so the task cannot be sized and stays as it is
DATA_DEPENDENT = RELU.replace("return [torch.rand(batch_size, dim)]",
                              "n = int(torch.randint(1, 3, (1,)).item())\n    return [torch.rand(batch_size * n, dim)]")


def _task(tmp_path, name: str, source: str, level: int = 1):
    path = tmp_path / f"level{level}" / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return load_task(str(path))


def _run_for_real(task) -> torch.Tensor:
    module = load_task_module(task, module_name="fit_test_task")
    with torch.no_grad():
        return module.Model(*module.get_init_inputs())(*module.get_inputs())


@pytest.mark.parametrize("name,source", [("19_ReLU", RELU), ("16_Matmul_with_transposed_A", MATMUL_T),
                                         ("85_conv_depthwise", DEPTHWISE), ("97_attention", ATTENTION)])
def test_full_size_tasks_fit_the_default_budget_and_still_run(tmp_path, name, source):
    task = _task(tmp_path, name, source)
    before = meta_cost(task)
    assert before is not None and not before.within(64 << 20, 2 * 10**9)
    fitted = apply_size_profile(task, "fit")
    after = meta_cost(fitted)
    assert after is not None and after.within(64 << 20, 2 * 10**9), (before, after)
    resized = fitted.meta["resized"]
    assert resized and all(FIT_MIN_VALUE // 2 <= new < old for old, new in resized.values())
    constants = int_constants(fitted.source)
    assert all(constants[k] == new for k, (_, new) in resized.items())
    out = _run_for_real(fitted)
    assert torch.isfinite(out).all() and out.numel() > 0
    assert "def get_inputs" in fitted.source and fitted.task_id == task.task_id and fitted.path == task.path


def test_relations_between_constants_are_kept(tmp_path):
    fitted, resized = fit_sizes(_task(tmp_path, "85_conv_depthwise", DEPTHWISE))
    module = load_task_module(fitted, module_name="fit_test_depthwise")
    assert module.groups == module.in_channels == module.out_channels       # defined from in_channels: they follow
    assert (module.kernel_size_h, module.kernel_size_w) == (3, 7)           # small constants are never touched
    assert "groups" not in resized and "in_channels" in resized
    attention, resized = fit_sizes(_task(tmp_path, "97_attention", ATTENTION))
    module = load_task_module(attention, module_name="fit_test_attention")
    assert module.embed_dim % module.num_heads == 0                          # a halving that breaks it was refused


def test_matmul_written_as_arithmetic_is_resized(tmp_path):
    task = _task(tmp_path, "16_Matmul_with_transposed_A", MATMUL_T)
    assert int_constants(task.source) == {"M": 2048, "K": 8192, "N": 4096}
    fitted, resized = fit_sizes(task)
    assert set(resized) == {"M", "K", "N"} and resized["K"][0] == 8192
    out = _run_for_real(fitted)
    assert out.shape == (resized["M"][1], resized["N"][1])


def test_a_budget_is_parsed_and_a_bad_one_named():
    assert parse_fit_profile("gpu") is None and parse_fit_profile(None) is None
    assert parse_fit_profile("fit") == (64 << 20, 2 * 10**9)
    assert parse_fit_profile("fit:16") == (16 << 20, 2 * 10**9)
    assert parse_fit_profile("fit:16:0.5") == (16 << 20, 5 * 10**8)
    for bad in ("fit:x", "fit:0", "fit:-1", "fit:1:2:3", "fit:nan", "fit:inf"):
        with pytest.raises(ValueError, match="size profile"):
            parse_fit_profile(bad)


def test_tighter_budgets_give_smaller_tasks(tmp_path):
    task = _task(tmp_path, "19_ReLU", RELU)
    sizes = [meta_cost(apply_size_profile(task, f"fit:{mib}")).nbytes for mib in (256, 16, 1)]
    assert sizes[0] > sizes[1] > sizes[2] and sizes[2] <= 1 << 20


def test_tasks_that_fit_or_cannot_be_sized_come_back_unchanged(tmp_path):
    small = _task(tmp_path, "1_small", SMALL)
    assert fit_sizes(small) == (small, {})
    dynamic = _task(tmp_path, "2_dynamic", DATA_DEPENDENT)
    assert meta_cost(dynamic) is None and fit_sizes(dynamic) == (dynamic, {})


def test_sizes_that_only_work_together_shrink_together_tuples_included(tmp_path):
    task = _task(tmp_path, "100_HingeLoss", HINGE)
    assert int_constants(task.source) == {"batch_size": 32768, "input_shape": (32768,), "dim": 1}
    fitted, resized = fit_sizes(task)
    assert set(resized) == {"batch_size", "input_shape"}
    (b0, b1), (s0, s1) = resized["batch_size"], resized["input_shape"]
    assert b0 == 32768 and s0 == (32768,) and s1 == (b1,) and b1 <= 4096
    assert meta_cost(fitted).within(64 << 20, 2 * 10**9)
    assert _run_for_real(fitted).ndim == 0
    assert fitted.meta["resized"]["input_shape"] == [[32768], [b1]]


# hidden widths as a list passed through get_init_inputs (KernelBench level3/1_MLP's form)
MLP = HEADER + '''class Model(nn.Module):
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


@pytest.mark.parametrize("name,source,before", [("1_MLP", MLP, [8192, 8192]), ("3_DeepNarrowMLP", DEEP_MLP, [2048] * 6)])
def test_list_layer_widths_are_sizes_fit_shrinks(tmp_path, name, source, before):
    """KernelBench's MLPs give their hidden widths as ``layer_sizes = [16384, 16384]`` or ``[1024] * 16``: ``fit``
    shrank integer constants and tuples only, so level3/1_MLP, 2_ShallowWideMLP and 3_DeepNarrowMLP kept 0.07-4.3 GB
    of parameters and never fitted (on a CPU the verifier then answered ``infra`` for the memory)."""
    task = _task(tmp_path, name, source, level=3)
    assert int_constants(task.source)["layer_sizes"] == before
    assert not meta_cost(task).within(64 << 20, 2 * 10**9)   # the hidden layers' parameters alone exceed 64 MiB
    fitted, resized = fit_sizes(task)
    assert meta_cost(fitted).within(64 << 20, 2 * 10**9), resized
    old, new = resized["layer_sizes"]
    assert old == before and isinstance(new, list) and len(new) == len(before) and sum(new) < sum(before)
    assert fitted.meta["resized"]["layer_sizes"] == [before, new]
    module = load_task_module(fitted, module_name="fit_test_fitted")
    assert module.layer_sizes == new                      # still a list: the task's own code sees what it expects
    out = _run_for_real(fitted)
    assert out.shape == (module.batch_size, module.output_size) and torch.isfinite(out).all()
