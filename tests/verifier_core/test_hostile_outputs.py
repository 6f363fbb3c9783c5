"""Hostile model outputs and KernelBench's full sizes on the cpu backend: cases probed beyond the red-team suites.

Each test is a hole that was fixed (the memory the reference's intermediates and the precision probe need, which
let a full-size KernelBench task past the memory gate and then exhaust a 24 GB host; format fields that reach
dunder attributes) or a hostile output whose verdict is worth pinning (exceptions that are not ``Exception``).
"""
import os
import textwrap

import pytest

from verifier import evaluate, inputs
from verifier.config import VerifierConfig
from verifier.evaluate import _DeviceStage, verify
from verifier.extract import extract_candidate
from verifier.static_checks import check_source
from verifier.tasks import load_task, load_task_module
from verifier.types import Category

from .candidates import calling, python_only, task_path

GiB = 1 << 30

# KernelBench level1/100_HingeLoss.py at its full size: a 4 GiB input, a scalar output, and a reference whose
# ``mean(clamp(1 - p * t))`` holds two more input-sized temporaries
HINGE = textwrap.dedent('''\
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def __init__(self):
            super(Model, self).__init__()

        def forward(self, predictions, targets):
            return torch.mean(torch.clamp(1 - predictions * targets, min=0))

    batch_size = 32768
    input_shape = (32768,)
    dim = 1

    def get_inputs():
        return [torch.rand(batch_size, *input_shape), torch.randint(0, 2, (batch_size,)).float() * 2 - 1]

    def get_init_inputs():
        return []
    ''')


def _hinge(tmp_path):
    path = tmp_path / "level1" / "100_HingeLoss.py"
    os.makedirs(path.parent, exist_ok=True)
    path.write_text(HINGE)
    return load_task(str(path))


def test_the_references_intermediates_count_in_the_memory_gate(tmp_path, monkeypatch):
    """Inputs and outputs alone (8 GiB per trial in the parent and 12 GiB in the child) fit a 24 GB host; the
    reference's two 4 GiB temporaries (in the parent, which runs it, and in the child, which times it) do not.
    Measured at 1/16 of the size: the parent peaked at 4x the input during a reference call."""
    task = _hinge(tmp_path)
    fp = inputs.estimate_footprint(load_task_module(task), "float32")
    assert (fp.input_bytes, fp.output_bytes, fp.work_bytes) == (4 * GiB + 128 * 1024, 4, 8 * GiB)
    assert sum(inputs.trial_bytes(fp)) > 24 * GiB
    monkeypatch.setattr(inputs, "host_available_bytes", lambda: 22 * GiB)
    r = verify(task, python_only(calling("torch.relu(predictions)", "predictions, targets")),
               VerifierConfig(build_cache_dir=str(tmp_path / "cache")))
    assert r.category == Category.INFRA and "host memory" in r.feedback
    assert "intermediates 8.0 GiB" in r.feedback and "build" not in r.details
    # an out-of-memory error with 30 GiB free on a shared device: others hold what the trial (36 GiB) needs
    assert inputs.memory_taken_by_others(fp.to_dict(), 30 * GiB)


def test_an_elementwise_reference_needs_no_extra_memory():
    relu = load_task_module(load_task(task_path("relu")))
    fp = inputs.estimate_footprint(relu, "float32")
    assert fp.work_bytes == fp.output_bytes == fp.input_bytes
    assert inputs.trial_bytes(fp) == inputs.trial_bytes(inputs.Footprint(fp.input_bytes, fp.output_bytes, 0))


def test_the_precision_probe_is_skipped_where_its_copies_would_exhaust_the_host(tmp_path, monkeypatch):
    """The probe re-runs the reference on float16-rounded inputs and in float64 (8x the input of HingeLoss at
    1/16 size, on top of a trial): on a host without that much free it is skipped, never run into the OOM
    killer."""
    stage = _DeviceStage.__new__(_DeviceStage)
    stage.cfg, stage.details = VerifierConfig(), {}
    stage.backend = evaluate.get_backend("cpu")
    stage.footprint = inputs.Footprint(4 * GiB, 4, 0, 8 * GiB)
    assert inputs.precision_probe_bytes(stage.footprint) >= 32 * GiB
    monkeypatch.setattr(inputs, "host_available_bytes", lambda: 20 * GiB)
    assert stage._precision_probe(None, 1, [], []) is None
    assert "host memory" in stage.details["precision_probe"]["skipped"]


@pytest.mark.parametrize("template", ["'{0.__class__}'.format(x)", "'{0.__init__.__globals__}'.format(nn.Module)",
                                      "'{m[0].__class__.__mro__}'.format_map({'m': [x]})",
                                      "str.format('{0.__class__}', x)", "('{0.' + '__class__}').format(x)"])
def test_format_fields_that_reach_dunders_are_rejected(template):
    code = extract_candidate(python_only(calling(f"x if {template} else x", "x")), 200_000)
    assert "dynamic_code" in {v.rule for v in check_source(code, "cpu")}


@pytest.mark.parametrize("expr", ["'{0} {1:.3f} {a.shape} {__x__}'.format(1, 2.0, a=x, __x__=3)",
                                  "'{0.__name__}'.format(type(x))",           # as allowed as type(x).__name__
                                  "'a docstring that shows {self.__dict__}'"])   # not a template: never formatted
def test_ordinary_format_strings_stay_allowed(expr):
    code = extract_candidate(python_only(calling(f"x if {expr} else x", "x")), 200_000)
    assert "dynamic_code" not in {v.rule for v in check_source(code, "cpu")}


@pytest.mark.slow
@pytest.mark.parametrize("exc", ["SystemExit(0)", "KeyboardInterrupt()"])
def test_exceptions_that_are_not_exceptions_are_runtime_errors(make_cfg, exc):
    """``sys.exit`` and a fake Ctrl-C raised from forward: a runtime error of the candidate, not an interrupted or
    infra verdict."""
    body = f'''
class ModelNew(nn.Module):
    def forward(self, x):
        raise {exc}
'''
    r = verify(load_task(task_path("relu")), python_only(body), make_cfg())
    assert r.category == Category.RUNTIME_ERROR and r.reward == -1.0
    assert exc.split("(")[0] in r.feedback
