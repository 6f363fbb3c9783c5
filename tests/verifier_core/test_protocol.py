"""Untrusted child messages: malformed fields become protocol errors (-> runtime_error), never crashes."""
import pytest

from verifier.correctness import same_structure
from verifier.evaluate import _TRIAL_FIELDS, _checked
from verifier.sandbox import ProtocolError


@pytest.mark.parametrize("msg", [
    {"op": "trial_done", "n_outputs": "3"},
    {"op": "trial_done", "aten_ops": {"relu": "many"}},
    {"op": "trial_done", "aten_ops": ["relu"]},
    {"op": "trial_done", "values": [1, 2]},
    {"op": "trial_done", "fd": "/x/outputs/out1.safetensors"},
])
def test_malformed_trial_reports_are_protocol_errors(msg):
    with pytest.raises(ProtocolError):
        _checked(msg, _TRIAL_FIELDS)


def test_well_formed_report_passes():
    msg = {"op": "trial_done", "fd": 7, "spec": "leaf", "n_outputs": 1, "values": {},
           "types": ["Tensor"], "subclass_outputs": [], "devices": ["cpu"], "aliases_input": False,
           "inputs_modified": False, "aten_ops": {"empty_like": 1}, "device_kernels": {}, "timer_patched": []}
    assert _checked(msg, _TRIAL_FIELDS) is msg


@pytest.mark.parametrize("junk", [None, 3, {"seq": "tuple"}, {"seq": "tuple", "items": 5}, {"dict": []}, []])
def test_structure_comparison_is_total_on_junk(junk):
    assert same_structure(junk, "leaf") is False
    assert same_structure(junk, {"seq": "tuple", "items": ["leaf"]}) is False


def test_large_input_fingerprint_is_chunked_and_exact():
    """The in-place-modification fingerprint of a large input is summed slice by slice (a widening
    whole-tensor sum would need several times the input's memory) and equals the one-shot sums of its 64-bit
    words modulo 2**64 (32-bit words or bytes, summed exactly, when its size is no multiple of eight or four)."""
    import types

    import torch

    from verifier._child import DeviceSession

    session = types.SimpleNamespace(torch=torch)
    for x, view in ((torch.randn(1000, 38), torch.int64), (torch.randn(999, 37), torch.int32),
                    (torch.randint(0, 255, (1001,), dtype=torch.uint8), torch.uint8)):
        b = x.reshape(-1).view(view)
        words = [int(v) for v in b.tolist()]
        mod = 1 << 64 if view == torch.int64 else None
        want = tuple(sum(w) % mod if mod else sum(w) for w in (words, words[::7]))
        for chunk in (1, 7, 1000, 4099, 1 << 20):
            assert DeviceSession._bytesum(session, x, chunk=chunk) == want
        y = x.clone()
        y.view(-1)[500] += 1
        assert DeviceSession._bytesum(session, y, chunk=4099) != want


@pytest.mark.parametrize("phase", ["import", "construct", "trial", "timing"])
def test_harness_errors_after_the_candidate_loaded_are_never_infra(phase):
    """Once candidate code may have run, the child can write anything on its result channel: a forged
    harness error (even one shaped like the task-load failure) is the candidate's runtime error, never an
    infra verdict (which would be retried and dropped from scoring)."""
    import types

    from verifier.evaluate import _DeviceStage
    from verifier.types import Category

    stage = _DeviceStage.__new__(_DeviceStage)
    stage.phase = phase
    stage.service = types.SimpleNamespace(infra_error=None, timed_out=False)
    for forged in ({"op": "error", "phase": "harness", "stage": "task", "error": {"type": "X", "message": "m"}},
                   {"op": "error", "phase": "harness", "error": {"type": "OSError", "message": "device lost"}}):
        assert stage._fail_from_error(forged).category == Category.RUNTIME_ERROR
