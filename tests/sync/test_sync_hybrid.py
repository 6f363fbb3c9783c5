"""check_sync on the Qwen3.5 hybrid: after a sync the engine (transformers' Qwen3.5, another random init)
reproduces the Megatron actor's logprobs within 1e-3 in fp32, at TP=2 on the text layout and at PP=2 on the
released multimodal layout (the language model's names under ``model.language_model.``; vision and MTP
tensors are not the actor's and are not sent)."""
import json
import os

import pytest
import torch

from tests.bridge.tiny_qwen3_5 import multimodal_config, multimodal_tensors, tiny_config, tiny_model
from tests.sync.test_sync_shapes import _ranks


def _save(path, layout: str):
    from safetensors.torch import save_file

    cfg = tiny_config(layers=4, vocab=250)
    cfg.max_position_embeddings = 128
    model = tiny_model(cfg, seed=5)
    if layout == "text":
        model.save_pretrained(path)
        return str(path), len(model.state_dict())
    mm = multimodal_config(cfg)
    tensors = multimodal_tensors(model, mm)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    mm.save_pretrained(path)
    return str(path), sum(1 for n in tensors if n.startswith(("model.language_model.", "lm_head.")))


@pytest.mark.slow
def test_check_sync_hybrid_tp2_text_and_pp2_multimodal(tmp_path):
    from megatron_rl.parallel import spawn

    cases = []
    for name, layout, tp, pp in [("hybrid_text_tp2", "text", 2, 1), ("hybrid_multimodal_pp2", "multimodal", 1, 2)]:
        hf_dir, n_lm = _save(tmp_path / name, layout)
        cases.append(dict(name=name, hf_dir=hf_dir, tp=tp, pp=pp, n_tensors=n_lm, dtype="float32",
                          prompt=[249, 0, 7, 125, 1, 248]))
    spawn(_ranks, 2, cases, str(tmp_path))
    for case in cases:
        r = json.loads((tmp_path / (case["name"] + ".json")).read_text())
        assert r["tokens"] == 16 and r["model_type"] in ("qwen3_5", "qwen3_5_text"), case["name"]
        assert r["max_abs_logprob_diff"] <= 1e-3, (case["name"], r["max_abs_logprob_diff"])
        assert r["sync"]["num_tensors"] == case["n_tensors"], (case["name"], r["sync"]["num_tensors"])
        assert r["weight_version"] == "1" and r["served_weight_version"] == 1
