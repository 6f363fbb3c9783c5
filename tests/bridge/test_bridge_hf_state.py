"""LazyHFState: sharded/single safetensors, slices, and broken inputs named in the error."""
import json

import pytest
import torch
from safetensors.torch import save_file

from megatron_rl.bridge import HFCheckpointError, LazyHFState


def write_sharded(d, tensors_by_file):
    weight_map = {}
    for fname, tensors in tensors_by_file.items():
        save_file(tensors, str(d / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture
def sharded(tmp_path):
    g = torch.Generator().manual_seed(0)
    a = {"x": torch.randn(6, 4, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16)}
    b = {"y": torch.randn(4, 8, generator=g)}
    write_sharded(tmp_path, {"m-1.safetensors": a, "m-2.safetensors": b})
    return tmp_path, {**a, **b}


def test_reads_whole_tensors_and_slices(sharded):
    d, ref = sharded
    st = LazyHFState(d)
    assert sorted(st.keys()) == ["b", "x", "y"] and "x" in st and "z" not in st
    assert st.shape("y") == (4, 8) and st.dtype("b") == torch.bfloat16
    assert torch.equal(st.read("b"), ref["b"])
    assert torch.equal(st.read("x", 0, 2, 5), ref["x"][2:5])
    assert torch.equal(st.read("y", 1, 3, 7), ref["y"][:, 3:7])
    assert st.file_of("y").name == "m-2.safetensors"
    with pytest.raises(KeyError, match="'z'"):
        st.read("z")


def test_single_file_without_index(tmp_path):
    save_file({"w": torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    assert torch.equal(LazyHFState(tmp_path)["w"], torch.ones(2, 2))


def test_truncated_file_is_named(sharded):
    d, _ = sharded
    f = d / "m-2.safetensors"
    f.write_bytes(f.read_bytes()[:-16])
    with pytest.raises(HFCheckpointError, match="m-2.safetensors"):
        LazyHFState(d)


def test_garbage_header_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(HFCheckpointError, match="model.safetensors"):
        LazyHFState(tmp_path)


def test_index_pointing_at_missing_file_or_tensor(sharded):
    d, _ = sharded
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["z"] = "m-3.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFCheckpointError, match="m-3.safetensors"):
        LazyHFState(d)
    index["weight_map"]["z"] = "m-1.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFCheckpointError, match="'z'"):
        LazyHFState(d)
    (d / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(HFCheckpointError, match="index.json"):
        LazyHFState(d)


def test_missing_directory_or_weights(tmp_path):
    with pytest.raises(HFCheckpointError, match="does not exist"):
        LazyHFState(tmp_path / "nope")
    with pytest.raises(HFCheckpointError, match="no safetensors"):
        LazyHFState(tmp_path)
