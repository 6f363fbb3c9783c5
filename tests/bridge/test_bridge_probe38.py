"""Bridge probe 38: HF checkpoints of shapes and layouts nobody tuned for.

Found and fixed:
- A Qwen3 config with ``use_sliding_window: true`` whose ``max_window_layers`` covers every layer (transformers and
  vLLM/SGLang window only the layers from ``max_window_layers`` on, so every layer is plain causal attention, and
  ``save_pretrained`` writes ``layer_types`` all ``full_attention``) was refused as sliding-window attention. It is
  converted now, round-trips bitwise and verifies against transformers on sequences longer than the window; a config
  where either reading windows a layer is still refused by name.
- ``verify`` of a correct ``hf-to-mcore --dtype bfloat16`` conversion of a float32 release failed (exit 1, logits off
  by 0.19 on a tiny hybrid): in its default float32 compute it ran transformers on the release's unrounded weights
  against the checkpoint's bf16 ones. The HF side now runs on the release's weights rounded to the checkpoint's dtype
  (as loading it in that dtype does), but for the tensors the architecture keeps in float32 (GDN's ``A_log`` and
  ``dt_bias``, which the checkpoint holds unrounded).
"""
import json

import pytest
import torch

from ckpt_tools.__main__ import main
from megatron_rl.models import ConfigMismatchError, ParallelSizes, spec_for
from tests.bridge import tiny_qwen3, tiny_qwen3_5
from tests.bridge.tiny_qwen3 import read_weights

SHAPE = dict(layers=2, hidden=32, heads=2, kv_heads=1, ffn=48)


# ----- Qwen3 sliding-window fields: refused only where a layer is windowed ------------------------------------------
@pytest.mark.parametrize("fields,ok", [
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 28}, True),   # every layer below 28
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}, True),    # = num_hidden_layers
    ({"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0}, True),  # no window size
    ({"use_sliding_window": False, "sliding_window": 4, "max_window_layers": 0}, True),    # switched off
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}, False),   # layer 1 is windowed
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 28,          # layer_types windows one
      "layer_types": ["full_attention", "sliding_attention"]}, False),
])
def test_qwen3_sliding_window_fields_are_refused_only_when_a_layer_is_windowed(fields, ok):
    cfg = tiny_qwen3.tiny_config(**SHAPE, **fields)
    if ok:
        spec_for(cfg).validate(cfg, ParallelSizes())
    else:
        with pytest.raises(ConfigMismatchError, match="sliding"):
            spec_for(cfg).validate(cfg, ParallelSizes())


def test_use_sliding_window_below_max_window_layers_converts_round_trips_and_verifies(tmp_path, capsys):
    cfg = tiny_qwen3.tiny_config(**SHAPE, use_sliding_window=True, sliding_window=4, max_window_layers=28)
    assert cfg.layer_types == ["full_attention"] * 2   # transformers windows no layer
    hf_dir = tmp_path / "hf"
    tiny_qwen3.tiny_model(cfg, seed=5).save_pretrained(hf_dir)
    mc, out = tmp_path / "mc", tmp_path / "out"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(mc), "--no-progress"]) == 0
    assert main(["mcore-to-hf", "--ckpt", str(mc), "--out", str(out), "--no-progress"]) == 0
    src, back = read_weights(hf_dir), read_weights(out)
    assert sorted(src) == sorted(back) and all(torch.equal(src[n], back[n]) for n in src)
    exported = json.loads((out / "config.json").read_text())
    assert exported["use_sliding_window"] is True and exported["max_window_layers"] == 28
    capsys.readouterr()
    # 16 tokens > the window of 4: a windowed layer on either side would show in the logits
    assert main(["verify", "--hf", str(hf_dir), "--ckpt", str(mc), "--seq-len", "16"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ok"]


# ----- verify: the HF side runs on the weights the checkpoint holds -------------------------------------------------
def test_verify_passes_a_narrower_dtype_conversion_and_still_fails_a_wrong_checkpoint(tmp_path, capsys):
    cfg = tiny_qwen3_5.tiny_config(layers=2, hidden=32, layer_types=["linear_attention", "full_attention"])
    hf_dir, other = tmp_path / "hf", tmp_path / "other"
    tiny_qwen3_5.tiny_model(cfg, seed=3).save_pretrained(hf_dir)   # float32 weights
    tiny_qwen3_5.tiny_model(cfg, seed=4).save_pretrained(other)
    mc = tmp_path / "mc"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(mc), "--dtype", "bfloat16", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["verify", "--hf", str(hf_dir), "--ckpt", str(mc)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["ok"] and report["dtype"] == "float32" and report["checkpoint_dtype"] == "bfloat16"
    assert report["max_abs_logit_diff"] <= 1e-4
    assert main(["verify", "--hf", str(other), "--ckpt", str(mc)]) == 1


def test_round_weights_rounds_all_but_the_fp32_kept_parameters():
    from ckpt_tools.verify import round_weights

    cfg = tiny_qwen3_5.tiny_config(layers=2, hidden=32, layer_types=["linear_attention", "full_attention"])
    model = tiny_qwen3_5.tiny_model(cfg, seed=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    round_weights(model, torch.bfloat16, keep_fp32=spec_for(cfg).fp32_params)
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32
        if n.endswith(("A_log", "dt_bias")):
            assert torch.equal(p, before[n]), n
        else:
            assert torch.equal(p, before[n].bfloat16().float()), n
    assert not torch.equal(model.lm_head.weight, before["lm_head.weight"])
