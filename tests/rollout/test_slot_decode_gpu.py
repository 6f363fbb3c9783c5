"""The slot decoder's CUDA-graph path on a GPU: graphed decode gives the DynamicCache path's tokens and a full
forward's logprobs (fp32 tiny models, dense and hybrid), through joins, leaves and a length growth, and every
batch bucket used was captured (no silent eager fallback)."""
import inspect
from unittest import mock

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

from rollout_helpers import TINY
from test_rollout_hybrid import HYBRID
from test_slot_decode import JOBS, _generate


@pytest.mark.gpu
@pytest.mark.parametrize("cfg,compile_decode", [(TINY, False), (TINY, True), (HYBRID, False)],
                         ids=["dense", "dense-compiled", "hybrid"])
def test_graphed_slot_decode_matches_dynamic_and_full_forward(cfg, compile_decode):
    from megatron_rl.rollout.embedded_engine import EmbeddedEngine, EmbeddedEngineConfig
    from megatron_rl.rollout.embedded_server import load_model

    model, _ = load_model(None, hf_config=cfg, device=torch.device("cuda"), dtype=torch.float32, init_seed=0)
    jobs = JOBS + [(list(range(10, 200)), 150, 12)]            # the last one grows the slots mid-run
    # compiled blocks would also run inside the reference's forward (same model): their test is the bf16 one below
    graphed = EmbeddedEngine(model, EmbeddedEngineConfig(max_batch_size=5, gather_ms=0, decode="slots",
                                                         compile_decode=compile_decode, compile_blocks=False))
    a = _generate(graphed, jobs, stagger_s=0.01)
    dynamic = EmbeddedEngine(model, EmbeddedEngineConfig(max_batch_size=5, gather_ms=0, decode="dynamic",
                                                         compile_blocks=False))
    b = _generate(dynamic, jobs, stagger_s=0.01)
    info = graphed.decode_info()
    assert info["cuda_graphs"] and info["graphs_captured"] >= 2 and info["graph_failures"] == 0, info
    assert info["compiled"] == compile_decode
    assert info["resizes"] >= 1
    for (prompt, n, _), x, y in zip(jobs, a, b):
        lp_x = [v[0] for v in x["meta_info"]["output_token_logprobs"]]
        lp_y = [v[0] for v in y["meta_info"]["output_token_logprobs"]]
        assert len(x["output_ids"]) == n
        # TF32 may differ between a graphed and an eager kernel choice: compare logprobs, and tokens while they agree
        same = next((i for i, (s, t) in enumerate(zip(x["output_ids"], y["output_ids"])) if s != t), n)
        assert max([abs(p - q) for p, q in zip(lp_x[:same], lp_y[:same])] + [0]) < 2e-3
        ref = _reference(model, prompt, x["output_ids"])
        # the engine's hybrid prefill runs fla's chunked kernel, whose fp32 dot products are TF32 (the decode runs
        # fla's recurrent kernel, no dot products); the reference is transformers' torch path in true fp32
        err = max(abs(p - q) for p, q in zip(ref, lp_x))
        assert err < (1e-2 if cfg is HYBRID else 5e-3), (prompt, err)


@torch.no_grad()
def _reference(model, prompt, tokens):
    """Logprobs of ``tokens`` from one full forward in fp32; the Gated DeltaNet layers on transformers' torch
    path (fla's chunked kernel rounds its fp32 dot products to TF32: 9e-2 off after 12 tokens on the tiny hybrid)."""
    ids = torch.tensor([list(prompt) + list(tokens)], device="cuda")
    torch_paths = {name: inspect.unwrap(getattr(modeling_qwen3_5, name))
                   for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")}
    with mock.patch.multiple(modeling_qwen3_5, **torch_paths):
        lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


@pytest.mark.gpu
def test_flash_varlen_decode_attention_matches_the_reference_on_the_gpu():
    """PyTorch's flash varlen kernel under the slot layout and `[3, n + 1]` mask: each row reads its own length
    (GQA 4, head_dim 128 and 256, bf16), as the plain-torch reference does."""
    from megatron_rl.rollout.slot_decode import grouped_decode_sdpa
    from test_slot_decode import _varlen_reference

    class Attn(torch.nn.Module):
        num_key_value_groups = 4
        is_causal = True

    torch.manual_seed(0)
    for d in (128, 256):
        n, hkv, length = 5, 2, 1024
        keys = torch.randn(8, length, hkv, d, device="cuda", dtype=torch.bfloat16)
        values = torch.randn(8, length, hkv, d, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(n, hkv * 4, 1, d, device="cuda", dtype=torch.bfloat16)
        used = torch.tensor([1, 1024, 700, 129, 64], dtype=torch.int32, device="cuda")
        offsets = torch.arange(n + 1, dtype=torch.int32, device="cuda")
        varlen = torch.stack([torch.cat([used, used.new_ones(1)]), offsets, offsets * length])
        ours, _ = grouped_decode_sdpa(Attn(), q, keys[:n].transpose(1, 2), values[:n].transpose(1, 2), varlen,
                                      scaling=d ** -0.5)
        k = keys[:n].reshape(n * length, hkv, d).float()
        v = values[:n].reshape(n * length, hkv, d).float()
        ref = _varlen_reference(q[:, :, 0].float(), k, v, cu_seq_q=varlen[1].cpu(), cu_seq_k=varlen[2].cpu(),
                                max_k=length, seqused_k=used.cpu(), scale=d ** -0.5)
        torch.testing.assert_close(ours[:, 0].float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("compile_decode,compile_blocks", [(False, False), (False, True), (True, False)],
                         ids=["graphs", "graphs+blocks", "graphs+compile"])
def test_bf16_slot_decode_uses_flash_varlen_and_is_as_close_to_fp32_as_sdpa(compile_decode, compile_blocks):
    """bf16 on the GPU: the engine picks flash varlen and captures its graphs, and its logprobs are as close to an
    fp32 forward of the same weights and tokens as the SDPA + mask path's are (bf16 noise is the yardstick); with
    compiled norm/MLP blocks too (inductor's fused kernels inside the graphs)."""
    import copy

    from megatron_rl.rollout.embedded_engine import EmbeddedEngine, EmbeddedEngineConfig
    from megatron_rl.rollout.embedded_server import load_model

    model, _ = load_model(None, hf_config=TINY, device=torch.device("cuda"), dtype=torch.bfloat16, init_seed=0)
    truth = copy.deepcopy(model).float()
    jobs = JOBS + [(list(range(10, 200)), 150, 12)]
    errors = {}
    for flash in (True, False):
        engine = EmbeddedEngine(model, EmbeddedEngineConfig(max_batch_size=5, gather_ms=0, decode="slots",
                                                            compile_decode=compile_decode,
                                                            compile_blocks=compile_blocks))
        assert engine._slots.flash, engine._slots.flash_reason
        assert (engine.compiled_blocks > 0) == compile_blocks
        engine._slots.flash = flash
        outs = _generate(engine, jobs, stagger_s=0.01)
        info = engine.decode_info()
        assert info["graphs_captured"] >= 2 and info["graph_failures"] == 0, info
        assert info["decode_attention"].startswith("flash" if flash else "sdpa")
        diffs = []
        for (prompt, n, _), x in zip(jobs, outs):
            assert len(x["output_ids"]) == n
            lp = [v[0] for v in x["meta_info"]["output_token_logprobs"]]
            diffs += [abs(p - q) for p, q in zip(_reference(truth, prompt, x["output_ids"]), lp)]
        errors[flash] = (sum(diffs) / len(diffs), max(diffs))
    # on the CPU with a torch stand-in for the kernel: mean 0.0206 (flash) vs 0.0199 (sdpa), max 0.12 vs 0.11
    assert errors[True][0] <= 1.5 * errors[False][0] + 5e-3 and errors[True][1] < 0.3, errors


@pytest.mark.gpu
def test_overlapped_graphed_decode_gives_the_one_step_at_a_time_tokens():
    """overlap_decode on a GPU (pinned host copies behind each graph replay, an event per step): the tokens and
    logprobs of the one-step-at-a-time path, through joins, leaves and slot moves."""
    from megatron_rl.rollout.embedded_engine import EmbeddedEngine, EmbeddedEngineConfig
    from megatron_rl.rollout.embedded_server import load_model

    model, _ = load_model(None, hf_config=TINY, device=torch.device("cuda"), dtype=torch.float32, init_seed=0)
    kw = dict(max_batch_size=3, gather_ms=0, decode="slots", compile_blocks=False)
    runs = []
    for overlap in (False, True):
        engine = EmbeddedEngine(model, EmbeddedEngineConfig(overlap_decode=overlap, **kw))
        runs.append((_generate(engine, JOBS, stagger_s=0.01), engine.decode_info()["engine_stats"]))
    (a, stats_a), (b, stats_b) = runs
    assert stats_a["decode_rows_discarded"] == 0 and stats_b["decode_rows_discarded"] > 0
    for (prompt, n, _), x, y in zip(JOBS, a, b):
        assert len(x["output_ids"]) == len(y["output_ids"]) == n
        lp_x = [v[0] for v in x["meta_info"]["output_token_logprobs"]]
        lp_y = [v[0] for v in y["meta_info"]["output_token_logprobs"]]
        # a stopped request's extra row changes a step's batch bucket, so TF32 kernels may round differently
        same = next((i for i, (s, t) in enumerate(zip(x["output_ids"], y["output_ids"])) if s != t), n)
        assert same >= min(n, 5) and max([abs(p - q) for p, q in zip(lp_x[:same], lp_y[:same])] + [0]) < 2e-3
