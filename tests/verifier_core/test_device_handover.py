"""The device handover's layout (``verifier.device_handover``) on CPU tensors: what the child packs, the parent
reads back bit for bit; a layout from a hostile child is refused entry by entry; a device layout nobody offered is
a runtime error. The CUDA IPC part runs in ``test_gpu.py``."""
import pytest
import torch

from verifier import device_handover as dh
from verifier.config import VerifierConfig
from verifier.evaluate import _DeviceStage, _Verdict
from verifier.types import Category


def _outputs():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(3, 5, generator=gen), torch.randn(7, generator=gen) > 0,
            torch.randn(2, 3, dtype=torch.complex128, generator=gen), torch.tensor(-5, dtype=torch.int8),
            torch.empty(0, 4), torch.randn(4, 2, generator=gen).to(torch.bfloat16).t()]   # last: not contiguous


def test_packed_outputs_read_back_bit_for_bit_as_views_of_the_snapshot():
    refs = _outputs()
    buf = torch.zeros(dh.buffer_bytes(refs), dtype=torch.uint8)
    layout = dh.pack({f"out{i}": t for i, t in enumerate(refs)}, buf)
    assert all(e["offset"] % dh.ALIGN == 0 for e in layout.values())
    got = dh.read_outputs(buf, layout, refs)
    for i, ref in enumerate(refs):
        t = got[f"out{i}"]
        assert t.dtype == ref.dtype and t.shape == ref.shape
        assert torch.equal(t.reshape(-1).view(torch.uint8) if t.numel() else t, ref.contiguous().reshape(-1)
                           .view(torch.uint8) if ref.numel() else ref)
        if t.numel():
            assert t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()   # a view, no copy


def test_an_output_of_another_shape_or_dtype_reads_as_meta_of_what_the_child_claimed():
    refs = [torch.ones(4, 4), torch.ones(8)]
    cand = {"out0": torch.ones(2, 8), "out1": torch.ones(8, dtype=torch.float64)}
    buf = torch.zeros(4096, dtype=torch.uint8)
    got = dh.read_outputs(buf, dh.pack(cand, buf), refs)
    assert got["out0"].is_meta and list(got["out0"].shape) == [2, 8]
    assert got["out1"].is_meta and got["out1"].dtype == torch.float64


def test_outputs_larger_than_the_offered_buffer_are_refused_by_the_child():
    buf = torch.zeros(dh.buffer_bytes([torch.ones(4)]), dtype=torch.uint8)
    with pytest.raises(dh.DeviceHandoverError, match="more than the 256 bytes offered"):
        dh.pack({"out0": torch.ones(100)}, buf)


@pytest.mark.parametrize("layout,message", [
    ({"out0": {"dtype": "float32", "shape": [64], "offset": 1 << 20}}, "run past"),
    ({"out0": {"dtype": "float32", "shape": [1 << 40, 1 << 40], "offset": 0}}, "run past"),
    ({"out0": {"dtype": "float32", "shape": [4], "offset": 4}}, "malformed offset"),
    ({"out0": {"dtype": "float32", "shape": [4], "offset": True}}, "malformed offset"),
    ({"out0": {"dtype": "float32", "shape": [4], "offset": -256}}, "malformed offset"),
    ({"out0": {"dtype": "object", "shape": [4], "offset": 0}}, "unknown dtype"),
    ({"out0": {"dtype": "float32", "shape": [-1], "offset": 0}}, "malformed shape"),
    ({"out0": {"dtype": "float32", "shape": [2.0], "offset": 0}}, "malformed shape"),
    ({"out0": {"dtype": "float32", "shape": "4", "offset": 0}}, "malformed shape"),
    ({"x0": {"dtype": "float32", "shape": [4], "offset": 0}}, "malformed output layout entry"),
    ({"out0": [1, 2]}, "malformed output layout entry"),
    ([], "malformed output layout"),
])
def test_a_hostile_layout_is_refused_by_name(layout, message):
    with pytest.raises(dh.DeviceHandoverError, match=message):
        dh.read_outputs(torch.zeros(1024, dtype=torch.uint8), layout, [torch.ones(4)])


@pytest.mark.parametrize("offer,message", [
    (None, "malformed device handover offer"), ({"handle": "ab", "bytes": 0}, "malformed device handover offer"),
    ({"handle": "zz", "bytes": 64}, "malformed device handover handle"),
    ({"handle": "ab" * 10, "bytes": 64}, "malformed device handover handle"),
])
def test_the_child_refuses_a_malformed_offer_before_any_driver_call(offer, message):
    with pytest.raises(dh.DeviceHandoverError, match=message):
        dh.write_outputs(offer, {"out0": torch.ones(4)}, torch.device("cpu"))


def test_the_child_refuses_outputs_off_the_device():
    with pytest.raises(dh.DeviceHandoverError, match="not on the device"):
        dh.write_outputs({"handle": "ab" * 64, "bytes": 64}, {"out0": torch.ones(4)}, torch.device("cuda", 0))


def test_a_device_layout_nobody_offered_is_a_runtime_error():
    stage = _DeviceStage.__new__(_DeviceStage)   # only the handover's state matters here
    with pytest.raises(_Verdict) as e:
        stage._device_outputs({"out0": {"dtype": "float32", "shape": [4], "offset": 0}}, [torch.ones(4)])
    assert e.value.category == Category.RUNTIME_ERROR and "not offered" in e.value.feedback_text
    stage._device_snapshot = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(_Verdict, match="") as e:
        stage._device_outputs({"out0": {"dtype": "float32", "shape": [64], "offset": 0}}, [torch.ones(64)])
    assert "unusable outputs" in e.value.feedback_text and "run past" in e.value.feedback_text


def test_the_device_handover_is_off_on_a_cpu_and_configurable():
    stage = _DeviceStage.__new__(_DeviceStage)
    stage.cfg = VerifierConfig(backend="cpu")
    assert stage._device_offer("out", 1 << 30) is None and stage._device_offer("commit", 1 << 30) is None
    assert VerifierConfig(device_handover_above_bytes=None).device_handover_above_bytes is None
    with pytest.raises(ValueError, match="device_handover_above_bytes"):
        VerifierConfig(device_handover_above_bytes=-1)


def test_a_stage_sharing_the_device_offers_buffers_up_to_a_share_of_its_memory_for_all_kinds_together(monkeypatch):
    """The shared cap is 1/64 of the device's memory for every buffer and its copy together (KernelBench level 1's
    256 MB outputs fit on an 80 GB GPU; the old flat 256 MiB sent them through a memfd), the other kinds' idle buffers
    make room before an offer is refused, and a stage holding the device alone is offered any size."""
    from verifier import evaluate

    class FakeBuffer:   # the driver's allocation, as ``ExportedBuffer`` (no GPU here)
        live: list = []

        def __init__(self, nbytes, device):
            self.nbytes = nbytes
            FakeBuffer.live.append(self)

        def message(self):
            return {"handle": "00", "bytes": self.nbytes}

        def close(self):
            FakeBuffer.live.remove(self)

    monkeypatch.setattr(evaluate.device_handover, "ExportedBuffer", FakeBuffer)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 << 30, 80 << 30))
    stage = _DeviceStage.__new__(_DeviceStage)
    stage.cfg, stage.device, stage.details, stage._device_bufs = VerifierConfig(backend="cuda"), "cuda:0", {}, {}
    stage._capacity, stage._held_since = 80 << 30, None
    mib = 1 << 20
    assert stage._device_offer("out", 256 * mib) == {"handle": "00", "bytes": 256 * mib}   # beside other stages
    assert stage._device_offer("out", 700 * mib) is None                    # 1.4 GB with its copy: over 1.25 GB
    assert stage._device_offer("out", 600 * mib)["bytes"] == 600 * mib
    assert stage._device_offer("commit", 64 * mib)["bytes"] == 64 * mib    # the idle full buffer made room
    assert set(stage._device_bufs) == {"commit"} and [b.nbytes for b in FakeBuffer.live] == [64 * mib]
    assert stage._device_offer("sample", 32 * mib)["bytes"] == 32 * mib    # both fit: nothing closed
    assert set(stage._device_bufs) == {"commit", "sample"}
    stage._held_since = 0.0                                                # timing: the device is ours alone
    assert stage._device_offer("out", 4 << 30)["bytes"] == 4 << 30
    assert "device_off" not in stage.details.get("handover", {})


def test_a_commitment_laid_out_on_the_device_reads_back_and_a_malformed_one_is_refused():
    digests = {"d0_0": torch.randint(-9, 9, (5, 2)), "d1_0": torch.randint(-9, 9, (3, 2))}
    buf = torch.zeros(2 * dh.ALIGN, dtype=torch.uint8)
    layout = dh.pack(digests, buf)
    stage = _DeviceStage.__new__(_DeviceStage)
    stage.details = {}
    stage._snapshot = lambda kind, report, key: buf   # what the offered buffer held on the reply
    got = stage._read_commitment({"commit_layout": layout}, 1 << 20, offered=True)
    assert set(got) == {(0, 0), (1, 0)} and torch.equal(got[(1, 0)], digests["d1_0"])
    with pytest.raises(_Verdict, match="malformed output commitment"):
        stage._read_commitment({"commit_layout": dh.pack({"d0_0": torch.ones(4)}, buf)}, 1 << 20, offered=True)
    with pytest.raises(_Verdict, match="unusable commitment"):
        stage._read_commitment({"commit_layout": {"out0": layout["d0_0"]}}, 1 << 20, offered=True)
    stage._snapshot = lambda kind, report, key: None
    with pytest.raises(_Verdict, match="not offered"):
        stage._read_commitment({"commit_layout": layout}, 1 << 20, offered=False)
