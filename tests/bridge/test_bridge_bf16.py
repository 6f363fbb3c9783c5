"""bf16 models on CPU: every parameter (norms included) is bf16, and the HF round trip keeps dtype and bits."""
import torch

from megatron_rl.parallel import spawn


def _bf16_round_trip():
    from megatron_rl.bridge import get_bridge
    from megatron_rl.models import BuildOptions, ParallelSizes, build_model
    from megatron_rl.parallel import init_parallel
    from tests.bridge.tiny_qwen3 import hf_tensors, tiny_config, tiny_model

    init_parallel(1, 1)
    cfg = tiny_config(tied=False, layers=2)
    ref = hf_tensors(tiny_model(cfg, dtype=torch.bfloat16))
    chunks = build_model(cfg, ParallelSizes(1, 1), BuildOptions(params_dtype=torch.bfloat16,
                                                                perform_initialization=False))
    wrong = [n for c in chunks for n, p in c.named_parameters() if p.dtype != torch.bfloat16]
    assert not wrong, f"parameters not in params_dtype: {wrong}"
    bridge = get_bridge(cfg)
    bridge.load_hf_into(chunks, ref)
    for name, t in bridge.export_hf(chunks):
        assert t.dtype == torch.bfloat16 and torch.equal(t, ref[name]), name


def test_bf16_params_and_round_trip_on_cpu():
    spawn(_bf16_round_trip, 1)
