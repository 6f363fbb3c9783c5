"""SFT on the Megatron actor: packed and unpacked batches give the same loss and step; a killed run resumes to the
same losses; the HF export carries the training tokenizer and chat template and loads in transformers."""
import json
import os

import pytest

from megatron_rl.config import REPO_ROOT, TinyModelConfig
from megatron_rl.parallel import spawn
from megatron_rl.tokenizer import load_tokenizer

from tests.sft import sft_cases


@pytest.mark.slow
def test_packed_and_unpacked_batches_give_the_same_loss_and_step(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    cfg = TinyModelConfig(hidden_size=32, intermediate_size=64).hf_config(1024)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "model")
    out = tmp_path / "packing.json"
    spawn(sft_cases.packing_case, 1, str(tmp_path / "model"), str(out))
    assert json.loads(out.read_text())["max_weight_diff"] < 1e-7


@pytest.mark.slow
def test_resume_after_kill_gives_the_same_losses_and_the_export_is_a_complete_hf_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = load_tokenizer("qwen3-offline")
    data = tmp_path / "rows.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Write kernel {i}."},
                          {"role": "assistant", "content": f"```python\nx = {i} * {i}\n```"}]} for i in range(5)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "resume.json"
    spawn(sft_cases.resume_case, 1, str(REPO_ROOT), str(data), str(tmp_path), str(out))
    res = json.loads(out.read_text())
    full, resumed = res["full"], res["resumed"]
    assert full["steps"] == resumed["steps"] == 3 and resumed["steps_this_run"] == 1
    metrics = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    cut = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in cut] == [0, 1, 2]              # two steps before the kill, the third after it
    for a, b in zip(metrics, cut):
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6), (a, b)
        assert a["train/lr"] == pytest.approx(b["train/lr"])
    assert full["loss_last"] == pytest.approx(resumed["loss_last"], abs=1e-6)
    assert (tmp_path / "full" / "tb").is_dir()
    # the export: weights (one file, as the starting model stored them), config, and the training tokenizer with
    # its chat template
    export = full["hf_export"]
    assert sorted(os.listdir(export)) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    loaded = AutoTokenizer.from_pretrained(export)
    assert loaded.chat_template == tok.chat_template and len(loaded) == len(tok)
    model = AutoModelForCausalLM.from_pretrained(export)
    assert model.config.model_type == "qwen3_5_text" and model.config.hidden_size == 32
    ckpt_assets = sorted(os.listdir(tmp_path / "full" / "ckpt" / "iter_0000003" / "hf_assets"))
    assert "tokenizer.json" in ckpt_assets and "chat_template.jinja" in ckpt_assets


@pytest.mark.slow
def test_the_export_reproduces_a_multimodal_single_file_release(tmp_path):
    """SFT from the released multimodal layout (``model.language_model.*`` beside a vision tower and MTP weights,
    one ``model.safetensors``, named chat templates in ``additional_chat_templates/``): the export writes the same
    tensor names in the same one-file layout, the tensors the model does not hold byte for byte, and the named
    templates; the trained language-model tensors changed."""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.bridge.tiny_qwen3_5 import multimodal_config, multimodal_tensors, tiny_config, tiny_model

    tok = load_tokenizer("qwen3-offline")
    src = tmp_path / "release"
    src.mkdir()
    cfg = tiny_config(layers=2, layer_types=["linear_attention", "full_attention"], vocab=len(tok), hidden=32,
                      ffn=48)
    mm = multimodal_config(cfg)
    tensors = multimodal_tensors(tiny_model(cfg, seed=3), mm)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    mm.save_pretrained(src)
    tok.save_pretrained(src)
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages[0]['content'] }}")
    data = tmp_path / "rows.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Write kernel {i}."},
                          {"role": "assistant", "content": f"```python\nx = {i}\n```"}]} for i in range(2)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "summary.json"
    spawn(sft_cases.release_layout_case, 1, str(REPO_ROOT), str(src), str(data), str(tmp_path), str(out))
    export = json.loads(out.read_text())["hf_export"]

    assert sorted(f for f in os.listdir(export) if f.endswith(".safetensors") or f.endswith(".json")
                  and "index" in f) == ["model.safetensors"]
    got = load_file(os.path.join(export, "model.safetensors"))
    assert sorted(got) == sorted(tensors)
    for name in tensors:
        if name.startswith(("model.visual.", "mtp.")):
            assert got[name].dtype == tensors[name].dtype and torch.equal(got[name], tensors[name]), name
    assert not torch.equal(got["model.language_model.embed_tokens.weight"],
                           tensors["model.language_model.embed_tokens.weight"])
    assert (tmp_path / "run").is_dir()
    named = os.path.join(export, "additional_chat_templates", "tool_use.jinja")
    assert open(named).read() == "{{ messages[0]['content'] }}"
    assert json.load(open(os.path.join(export, "config.json")))["model_type"] == "qwen3_5"
