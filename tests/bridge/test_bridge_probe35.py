"""Bridge probe 35: HF checkpoint layouts an export must give back as it was given them.

- A sharded release (``model-0000i-of-0000N.safetensors`` + index) came back from ``mcore-to-hf`` repacked into 5 GB
  shards: other file names, another index. Its weight map is now recorded with the checkpoint's HF assets and the
  export writes the same shard files (byte for byte when the weights did not change) and the same index.
- A multimodal export declared the source's dtype in ``text_config`` while the language model's weights were written
  in another one (``--dtype``, or weights that disagreed with config.json).
"""
import filecmp
import json

import pytest
import torch

from ckpt_tools.__main__ import main
from tests.bridge import tiny_qwen3, tiny_qwen3_5
from tests.bridge.tiny_qwen3 import read_weights


def _sharded_qwen3(d, *, tied=False):
    tiny_qwen3.tiny_model(tiny_qwen3.tiny_config(tied=tied), seed=2).save_pretrained(d, max_shard_size="60KB")
    return d


def _weights_files(d):
    return sorted(p.name for p in d.iterdir() if "safetensors" in p.name)


# ----- a sharded source's files and index ----------------------------------------------------------------------------
def test_a_sharded_source_records_its_weight_map_and_the_writer_gives_the_same_files_back(tmp_path):
    from ckpt_tools.hf_io import ShardedSafetensorsWriter, follow_weight_map
    from megatron_rl.bridge.hf_dir import SOURCE_WEIGHT_MAP_FILE, load_source_weight_map
    from megatron_rl.checkpoint import copy_hf_assets

    src = _sharded_qwen3(tmp_path / "hf")
    assert len(list(src.glob("model-*.safetensors"))) > 2
    assert SOURCE_WEIGHT_MAP_FILE in copy_hf_assets(src, tmp_path / "assets")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map = load_source_weight_map(tmp_path / "assets")
    assert weight_map == index["weight_map"]

    tensors = read_weights(src)
    assert follow_weight_map(weight_map, [*tensors, "extra"]) is None   # a map that no longer fits: packed by size
    writer = ShardedSafetensorsWriter(tmp_path / "out", single_file=False,
                                      weight_map=follow_weight_map(weight_map, list(tensors)))
    writer.add_all(tensors.items())   # export order, not the source's file order
    writer.close()
    out = tmp_path / "out"
    assert _weights_files(out) == _weights_files(src)
    assert all(filecmp.cmp(src / f, out / f, shallow=False) for f in _weights_files(src) if f.endswith(".safetensors"))
    assert json.loads((out / "model.safetensors.index.json").read_text()) == index


def test_the_writer_names_a_tensor_outside_the_weight_map_or_never_written(tmp_path):
    from ckpt_tools.hf_io import ShardedSafetensorsWriter

    writer = ShardedSafetensorsWriter(tmp_path / "a", weight_map={"a": "x.safetensors", "b": "y.safetensors"})
    with pytest.raises(ValueError, match="'c'"):
        writer.add("c", torch.ones(1))
    writer.add("a", torch.ones(1))
    with pytest.raises(ValueError, match="'b' of y.safetensors"):
        writer.close()


def test_a_single_file_source_records_no_weight_map_and_unsafe_file_names_are_refused(tmp_path):
    from megatron_rl.bridge import HFCheckpointError
    from megatron_rl.bridge.hf_dir import SOURCE_WEIGHT_MAP_FILE, load_source_weight_map
    from megatron_rl.checkpoint import copy_hf_assets

    tiny_qwen3.tiny_model(tiny_qwen3.tiny_config()).save_pretrained(tmp_path / "one")
    assert SOURCE_WEIGHT_MAP_FILE not in copy_hf_assets(tmp_path / "one", tmp_path / "assets")
    assert load_source_weight_map(tmp_path / "assets") is None
    (tmp_path / "assets" / SOURCE_WEIGHT_MAP_FILE).write_text(json.dumps({"w": "../../evil.safetensors"}))
    with pytest.raises(HFCheckpointError, match="shard file name"):
        load_source_weight_map(tmp_path / "assets")


@pytest.mark.slow
def test_sharded_release_round_trips_through_tp2_to_the_same_files_and_index(tmp_path):
    """A tied HF release in 7 shards -> Megatron at TP=2 -> HF: the same shard file names, each byte-identical, the
    same index, the tokenizer files (an explicit ``--max-shard-size`` still packs by size: test_ckpt_tools_cli)."""
    src = _sharded_qwen3(tmp_path / "hf", tied=True)
    (src / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    mcore, out = tmp_path / "mcore", tmp_path / "out"
    assert main(["hf-to-mcore", "--hf", str(src), "--out", str(mcore), "--tp", "2", "--no-progress"]) == 0
    assert main(["mcore-to-hf", "--ckpt", str(mcore), "--out", str(out), "--no-progress"]) == 0
    assert _weights_files(out) == _weights_files(src)
    for f in _weights_files(src):
        assert filecmp.cmp(src / f, out / f, shallow=False), f
    assert (json.loads((out / "model.safetensors.index.json").read_text())
            == json.loads((src / "model.safetensors.index.json").read_text()))
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 512}'


# ----- the dtype a multimodal export declares ------------------------------------------------------------------------
def test_a_multimodal_export_declares_its_weights_dtype_in_text_config_too(tmp_path):
    from transformers import AutoConfig

    from ckpt_tools.hf_io import write_hf_config

    mm = tiny_qwen3_5.multimodal_config(tiny_qwen3_5.tiny_config(layers=2, layer_types=["linear_attention",
                                                                                          "full_attention"]))
    mm.dtype = mm.text_config.dtype = torch.bfloat16   # a bf16 release, exported in float32
    write_hf_config(tmp_path, mm.to_dict(), torch.float32, ("Qwen3_5ForConditionalGeneration",))
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["dtype"] == raw["torch_dtype"] == "float32"
    assert raw["text_config"]["dtype"] == "float32"
    assert AutoConfig.from_pretrained(tmp_path).text_config.dtype in (torch.float32, "float32")
