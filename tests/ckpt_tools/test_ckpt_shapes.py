"""`python -m ckpt_tools` on HF checkpoints of other shapes and styles, and on broken ones.

Bad input is refused in the parent, before any rank starts, with a message naming the field or
tensor and no output left behind. One end-to-end run converts a transformers-4 style bf16
checkpoint of an untuned shape at TP=2, exports it on one rank, and checks the release bitwise,
its config.json, its assets and its logits under transformers.
"""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_tools.__main__ import main
from tests.bridge.tiny_qwen3 import read_weights, tiny_config, tiny_model, tokens

# head_dim != hidden/heads, MQA at tp=2, odd ffn, vocab < 128*tp: nothing divides evenly by accident
SHAPE = dict(hidden=32, heads=4, kv_heads=1, head_dim=16, ffn=98, vocab=100)
ASSETS = {"tokenizer_config.json": '{"model_max_length": 512}', "tokenizer.json": '{"version": "1.0"}',
          "vocab.json": '{"a": 0}', "merges.txt": "#version: 0.2\n",
          "generation_config.json": '{"bos_token_id": 1, "eos_token_id": [2, 3]}'}


def _v4_config(cfg, dtype):
    """config.json as transformers 4 wrote it for Qwen3 (rope_theta, torch_dtype, rope_scaling: null)."""
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "max_window_layers": 28,
            "use_sliding_window": False, "sliding_window": None, "rope_scaling": None, "rope_theta": 1000000,
            "tie_word_embeddings": False, "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2,
            "transformers_version": "4.51.0"}


@pytest.fixture(scope="module")
def hf_v4(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "v4_bf16"
    cfg = tiny_config(**SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    tiny_model(cfg, seed=11, dtype=torch.bfloat16).save_pretrained(d, max_shard_size="20KB")
    assert (d / "model.safetensors.index.json").exists()
    (d / "config.json").write_text(json.dumps(_v4_config(cfg, "bfloat16"), indent=2))
    for name, text in ASSETS.items():
        (d / name).write_text(text)
    return d


@pytest.fixture
def single_file(tmp_path):
    """An fp32 checkpoint in one model.safetensors without an index."""
    d = tmp_path / "single"
    tiny_model(tiny_config(), seed=2).save_pretrained(d)
    assert (d / "model.safetensors").exists() and not (d / "model.safetensors.index.json").exists()
    return d


def _edit_weights(d, fn):
    path = d / "model.safetensors"
    t = load_file(path)
    fn(t)
    save_file(t, path, metadata={"format": "pt"})


def _edit_config(d, fn):
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


BROKEN = {
    "shape": (lambda d: _edit_weights(d, lambda t: t.update(
        {"model.layers.1.self_attn.k_proj.weight": torch.zeros(32, 32)})),
              [], ["'model.layers.1.self_attn.k_proj.weight'", "(32, 32)", "(32, 64)"]),
    "missing": (lambda d: _edit_weights(d, lambda t: t.pop("model.layers.0.mlp.up_proj.weight")),
                [], ["model.layers.0.mlp.up_proj.weight", "missing"]),
    "integer_weight": (lambda d: _edit_weights(d, lambda t: t.update(
        {"model.norm.weight": torch.ones(64, dtype=torch.int32)})), [], ["'model.norm.weight'", "int32"]),
    "llama": (lambda d: _edit_config(d, lambda c: c.update(model_type="llama")), [], ["'llama'", "supported", "qwen3"]),
    "unknown_type": (lambda d: _edit_config(d, lambda c: c.update(model_type="frobnicator")), [],
                     ["'frobnicator'", "supported", "qwen3"]),
    "yarn_v4": (lambda d: _edit_config(d, lambda c: (c.pop("rope_parameters"), c.update(
        rope_theta=1e6, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}))),
                [], ["rope_scaling", "yarn"]),
    "linear_v5": (lambda d: _edit_config(d, lambda c: c.update(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                                 "rope_theta": 1e4})),
                  [], ["rope_parameters", "linear"]),
    "vpp": (lambda d: None, ["--pp", "2", "--vpp", "2"], ["num_hidden_layers=2", "vpp=2"]),
    # no Megatron params dtype: refused naming the file, the dtype, the supported ones and the way out
    "float64": (lambda d: _edit_weights(d, lambda t: t.update({n: w.double() for n, w in t.items()})), [],
                ["model.safetensors", "weights are float64", "float32, bfloat16, float16", "--dtype float32"]),
    # serving engines pick the class by `architectures`; an export would copy the wrong one
    "llama_architectures": (lambda d: _edit_config(d, lambda c: c.update(architectures=["LlamaForCausalLM"])), [],
                            ["config.json", "architectures=['LlamaForCausalLM']", "model_type='qwen3'",
                             "expected ['Qwen3ForCausalLM']"]),
    "vl_architectures": (lambda d: _edit_config(d, lambda c: c.update(
        architectures=["Qwen3_5ForConditionalGeneration"])), [],
                         ["architectures=['Qwen3_5ForConditionalGeneration']", "expected ['Qwen3ForCausalLM']"]),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_bad_input_is_refused_before_any_rank(single_file, tmp_path, capsys, case):
    breakage, args, needles = BROKEN[case]
    breakage(single_file)
    out = tmp_path / "outs" / "ckpt"
    rc = main(["hf-to-mcore", "--hf", str(single_file), "--out", str(out), "--no-progress", *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert "Traceback" not in err and not (tmp_path / "outs").exists()


def test_a_failure_inside_the_staged_output_leaves_nothing(tmp_path):
    """Input checks now stop bad checkpoints before the ranks start; this is the path a failing rank takes."""
    from ckpt_tools.ranks import ToolError, staged_output

    out = tmp_path / "new" / "deeper" / "out"
    with pytest.raises(ToolError, match="a rank failed"):
        with staged_output(out) as tmp:
            (tmp / "half-written.distcp").write_bytes(b"x")
            raise ToolError("a rank failed")
    assert not (tmp_path / "new").exists()
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "mine.txt").write_text("mine")
    with pytest.raises(ToolError, match="not empty"):
        with staged_output(keep):
            pass
    assert os.listdir(keep) == ["mine.txt"] and sorted(os.listdir(tmp_path)) == ["keep"]


def test_single_file_source_layout_is_recorded_and_written_back(single_file, hf_v4, tmp_path):
    """An export reproduces the layout it was given: one model.safetensors without an index when the source was
    one and everything fits one file; shards and an index otherwise (and for checkpoints that recorded nothing)."""
    from ckpt_tools.hf_io import ShardedSafetensorsWriter
    from megatron_rl.bridge import HFCheckpointError
    from megatron_rl.bridge.hf_dir import SOURCE_LAYOUT_FILE, load_source_layout
    from megatron_rl.checkpoint import copy_hf_assets

    for src, single in ((single_file, True), (hf_v4, False)):
        assets = tmp_path / f"assets_{src.name}"
        assert SOURCE_LAYOUT_FILE in copy_hf_assets(src, assets)
        assert load_source_layout(assets) == {"single_file": single}
    assert load_source_layout(tmp_path / "nothing_recorded") == {"single_file": False}
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / SOURCE_LAYOUT_FILE).write_text('{"single_file": "yes"}')
    with pytest.raises(HFCheckpointError, match="single_file"):
        load_source_layout(tmp_path / "bad")

    tensors = read_weights(single_file)
    for name, max_bytes, single in (("one", 10**9, True), ("many", 20_000, True), ("sharded", 10**9, False)):
        writer = ShardedSafetensorsWriter(tmp_path / name, max_bytes, single_file=single)
        writer.add_all(tensors.items())
        files = writer.close()
        if name == "one":
            assert files == ["model.safetensors"] and os.listdir(tmp_path / name) == ["model.safetensors"]
        else:  # does not fit one file, or the source was sharded: shards + index
            assert files[0].startswith("model-00001-of-") and (tmp_path / name / "model.safetensors.index.json").exists()
        back = read_weights(tmp_path / name)
        assert sorted(back) == sorted(tensors) and all(torch.equal(back[n], t) for n, t in tensors.items())


def test_processor_side_files_travel_to_the_export(tmp_path):
    """A Qwen3.5 / Qwen3-VL hub repo's side files go into the checkpoint's assets and out again on export."""
    from ckpt_tools.hf_io import copy_assets
    from megatron_rl.checkpoint import copy_hf_assets

    src, assets, out = tmp_path / "src", tmp_path / "assets", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    side = ["generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
            "chat_template.jinja", "preprocessor_config.json", "video_preprocessor_config.json",
            "processor_config.json"]
    for name in side + ["config.json"]:
        (src / name).write_text(f'{{"name": "{name}"}}')
    copy_hf_assets(src, assets)
    assert sorted(copy_assets(assets, out)) == sorted(side)   # config.json is regenerated, never copied
    for name in side:
        assert (out / name).read_text() == (src / name).read_text(), name


def test_additional_chat_templates_folder_travels_atomically(tmp_path, monkeypatch):
    """A release's ``additional_chat_templates/`` goes into the checkpoint's assets and out again: its regular files
    (a hub cache's symlinks to them included) and nothing else; a copy replaces an older folder whole, and a failing
    one leaves the destination as it was, with no temp folder beside it."""
    import shutil

    from ckpt_tools.hf_io import copy_assets
    from megatron_rl.checkpoint import copy_hf_assets

    src, assets, out = tmp_path / "src", tmp_path / "assets", tmp_path / "out"
    folder = src / "additional_chat_templates"
    (folder / "nested").mkdir(parents=True)
    (folder / "tool_use.jinja").write_text("{{ tools }}")
    (folder / "nested" / "skip.jinja").write_text("not carried")
    (tmp_path / "blob").write_text("{{ docs }}")
    os.symlink(tmp_path / "blob", folder / "rag.jinja")
    os.symlink(tmp_path / "missing", folder / "dangling.jinja")
    (src / "chat_template.jinja").write_text("{{ messages }}")
    want = {"rag.jinja": "{{ docs }}", "tool_use.jinja": "{{ tools }}"}

    assert "additional_chat_templates/tool_use.jinja" in copy_hf_assets(src, assets)
    (out / "additional_chat_templates").mkdir(parents=True)
    (out / "additional_chat_templates" / "stale.jinja").write_text("old")
    assert sorted(copy_assets(assets, out)) == ["additional_chat_templates/rag.jinja",
                                                "additional_chat_templates/tool_use.jinja", "chat_template.jinja"]
    for d in (assets, out):
        got = d / "additional_chat_templates"
        assert {f.name: f.read_text() for f in got.iterdir()} == want
        assert not any(f.is_symlink() for f in got.iterdir())
        assert sorted(p.name for p in d.iterdir() if p.name.startswith(".")) == []

    real_copy = shutil.copy2

    def failing_copy(a, b, **kw):  # rag.jinja is in the new folder when tool_use.jinja fails
        if str(a).endswith("tool_use.jinja"):
            raise OSError("disk full")
        return real_copy(a, b, **kw)

    (folder / "tool_use.jinja").write_text("{{ new tools }}")
    monkeypatch.setattr(shutil, "copy2", failing_copy)
    with pytest.raises(OSError, match="disk full"):
        copy_assets(src, out)
    monkeypatch.undo()
    assert {f.name: f.read_text() for f in (out / "additional_chat_templates").iterdir()} == want
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_a_failing_forward_is_bad_input_naming_its_side(single_file):
    """Either side's forward failing is exit 2 naming the model, not a raw traceback (exit 1 means 'logits
    differ')."""
    from ckpt_tools.ranks import ToolError
    from ckpt_tools.verify import hf_forward, megatron_forward

    out_of_vocab = torch.full((1, 4), 10_000)
    with pytest.raises(ToolError, match="the transformers forward failed") as err:
        hf_forward(str(single_file), out_of_vocab, torch.float32)
    assert str(single_file) in str(err.value)
    with pytest.raises(ToolError, match=r"^/ckpt/iter_0000000: the Megatron forward failed"):
        megatron_forward([], out_of_vocab, "/ckpt/iter_0000000")


def test_a_rank_tool_error_reaches_the_cli_without_its_class_name(monkeypatch):
    import megatron_rl.parallel as parallel
    from torch.multiprocessing.spawn import ProcessRaisedException

    from ckpt_tools.ranks import ToolError, run_ranks

    def failing(*_args, **_kw):
        raise ProcessRaisedException("Traceback (most recent call last):\n  ...\nckpt_tools.ranks.ToolError: "
                                     "/ckpt: the Megatron forward failed (ValueError: x)", 0, 1)

    monkeypatch.setattr(parallel, "spawn", failing)
    with pytest.raises(ToolError) as err:
        run_ranks(None, 1)
    assert str(err.value) == "/ckpt: the Megatron forward failed (ValueError: x)"


def test_weights_decide_the_dtype_not_a_disagreeing_config(single_file, capsys):
    from ckpt_tools.convert import _resolve_dtype
    from megatron_rl.bridge.hf_dir import check_hf_input
    from megatron_rl.models import ParallelSizes

    _edit_config(single_file, lambda c: c.update(dtype="bfloat16"))  # the weights are float32
    cfg, bridge, state = check_hf_input(str(single_file), ParallelSizes())
    assert _resolve_dtype(None, cfg, state, bridge) == torch.float32
    assert "declares dtype bfloat16 but the weights are float32" in capsys.readouterr().err
    assert _resolve_dtype("bf16", cfg, state, bridge) == torch.bfloat16


def test_exported_config_serves_transformers_4_and_5_readers(tmp_path):
    from ckpt_tools.hf_io import write_hf_config
    from megatron_rl.bridge.hf_dir import load_hf_config

    cfg = tiny_config(tied=True, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    cfg._name_or_path = "/somewhere/local"
    write_hf_config(tmp_path, cfg.to_dict(), torch.float16, ("Qwen3ForCausalLM",))
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["dtype"] == raw["torch_dtype"] == "float16" and raw["rope_theta"] == 5e5
    assert "_name_or_path" not in raw or not raw["_name_or_path"]
    back = load_hf_config(tmp_path)
    assert back.dtype == torch.float16 and back.tie_word_embeddings
    assert back.rope_parameters["rope_theta"] == 5e5 and back.head_dim == 16


@pytest.mark.slow
def test_v4_bf16_untuned_shape_end_to_end(hf_v4, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    mcore, release = tmp_path / "mcore", tmp_path / "release"
    assert main(["hf-to-mcore", "--hf", str(hf_v4), "--out", str(mcore), "--tp", "2", "--no-progress"]) == 0
    meta = json.loads((mcore / "iter_0000000" / "meta.json").read_text())
    assert meta["params_dtype"] == "bfloat16" and meta["tp"] == 2
    assert main(["mcore-to-hf", "--ckpt", str(mcore), "--out", str(release), "--no-progress"]) == 0

    original, exported = read_weights(hf_v4), read_weights(release)
    assert sorted(exported) == sorted(original)
    for name, t in original.items():
        assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], t), name
    cfg = json.loads((release / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16" and cfg["rope_theta"] == 1000000
    assert cfg["rope_parameters"]["rope_theta"] == 1000000 and cfg["head_dim"] == 16
    for name, text in ASSETS.items():
        assert (release / name).read_text() == text, name

    ref = AutoModelForCausalLM.from_pretrained(hf_v4, attn_implementation="eager").eval()
    back = AutoModelForCausalLM.from_pretrained(release, attn_implementation="eager").eval()
    assert back.dtype == ref.dtype == torch.bfloat16
    ids = tokens(SHAPE["vocab"])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ref(ids).logits)

    # the same weights with layers 0 and 1 swapped: verify must fail (exit 1), not pass on shapes alone
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    shutil.copy(hf_v4 / "config.json", swapped / "config.json")
    flip = {"model.layers.0.": "model.layers.1.", "model.layers.1.": "model.layers.0."}
    save_file({next((n.replace(a, b, 1) for a, b in flip.items() if n.startswith(a)), n): t
               for n, t in original.items()}, str(swapped / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["verify", "--hf", str(swapped), "--ckpt", str(mcore)]) == 1
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    report = json.loads(lines[-1])
    assert not report["ok"] and report["max_abs_logit_diff"] > report["tol"]
    # on a CPU, verify widens the bf16 checkpoint to float32 on both sides (the 1e-4 bound)
    assert (report["checkpoint_dtype"], report["dtype"], report["tol"]) == ("bfloat16", "float32", 1e-4)

    # --hf pointing at a model of another architecture: named before any rank or HF forward runs
    other = tmp_path / "other"
    tiny_model(tiny_config(**{**SHAPE, "vocab": 300})).save_pretrained(other)
    capsys.readouterr()
    assert main(["verify", "--hf", str(other), "--ckpt", str(mcore)]) == 2
    err = capsys.readouterr().err
    assert "different architectures" in err and "vocab_size: 100 vs 300" in err
