"""bf16 on a CUDA device: bridge parity with HF and the ckpt_tools round trip over NCCL."""
import glob
import json
import os

import pytest
import torch

from megatron_rl.parallel import spawn

pytestmark = pytest.mark.gpu


def _bf16_parity():
    from ckpt_tools.forward import megatron_logits
    from ckpt_tools.verify import default_tol
    from megatron_rl.bridge import get_bridge
    from megatron_rl.models import BuildOptions, ParallelSizes, build_model
    from megatron_rl.parallel import init_parallel
    from tests.bridge.tiny_qwen3 import hf_tensors, tiny_config, tiny_model, tokens

    init_parallel(1, 1)
    for tied in (False, True):
        cfg = tiny_config(tied=tied, layers=3)
        hf = tiny_model(cfg, dtype=torch.bfloat16).cuda()
        ref = hf_tensors(hf)
        chunks = build_model(cfg, ParallelSizes(1, 1), BuildOptions(params_dtype=torch.bfloat16,
                                                                    perform_initialization=False))
        bridge = get_bridge(cfg)
        bridge.load_hf_into(chunks, {k: v.cpu() for k, v in ref.items()})
        for c in chunks:
            c.eval()
        ids = tokens(cfg.vocab_size)
        got = megatron_logits(chunks, ids)[..., : cfg.vocab_size].cpu()
        with torch.no_grad():
            want = hf(ids.cuda()).logits.float().cpu()
        diff = (got - want).abs().max().item()
        assert diff <= default_tol(torch.bfloat16, want.abs().max().item()), diff
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
        for name, t in bridge.export_hf(chunks):
            assert t.is_cuda and t.dtype == torch.bfloat16 and torch.equal(t, ref[name]), name


def test_bf16_parity_on_gpu():
    spawn(_bf16_parity, 1)


def test_cli_round_trip_bf16_on_gpu(tmp_path, capsys):
    from safetensors.torch import load_file

    from ckpt_tools.__main__ import main
    from tests.bridge.tiny_qwen3 import tiny_config, tiny_model

    hf_dir = tmp_path / "hf"
    tiny_model(tiny_config(), dtype=torch.bfloat16).save_pretrained(hf_dir)
    tp = min(2, torch.cuda.device_count())
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "mc"), "--tp", str(tp)]) == 0
    assert main(["verify", "--hf", str(hf_dir), "--ckpt", str(tmp_path / "mc")]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["dtype"] == "bfloat16" and report["ok"]
    assert main(["mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "out")]) == 0
    a = load_file(str(hf_dir / "model.safetensors"))
    b = {}
    for f in glob.glob(os.path.join(tmp_path / "out", "*.safetensors")):
        b.update(load_file(f))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
