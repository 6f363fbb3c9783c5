"""The actor's fp32 logits under tensor parallelism (2 ranks, gloo, CPU): bf16 params of a real megatron
ColumnParallelLinear, sequence parallelism on and off, checkpointed chunks. The logprobs must be the exact fp32
logprobs of the bf16 hidden states and weight (vocab sharded, never gathered), and the gradients those of the
layer's own bf16 path up to bf16 rounding (the input gradient all-reduced over the TP group)."""
import pytest
import torch

from megatron_rl.parallel import spawn

pytestmark = pytest.mark.slow


def _ranks():
    import torch.distributed as dist
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_rl.actor.logprobs import LogprobRequest, chunked_logprobs
    from megatron_rl.parallel import init_parallel

    init_parallel(2, 1)
    rank = dist.get_rank()
    hidden, vocab_padded, vocab, seq = 64, 200, 190, 24
    for sp in (False, True):
        cfg = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sp, params_dtype=torch.bfloat16,
                                  use_cpu_initialization=True, perform_initialization=True)
        torch.manual_seed(0)
        layer = ColumnParallelLinear(hidden, vocab_padded, config=cfg, bias=False, gather_output=False,
                                     init_method=lambda w: torch.nn.init.normal_(w, std=0.3))
        shards = [torch.empty_like(layer.weight) for _ in range(2)]
        dist.all_gather(shards, layer.weight.detach())
        weight = torch.cat(shards)[:vocab]
        torch.manual_seed(1)
        full = torch.randn(seq, 1, hidden, dtype=torch.bfloat16) * 3
        rows = torch.arange(seq - 1)
        labels = torch.randint(0, vocab, (len(rows),))
        expected = torch.log_softmax(full[:-1, 0].float() @ weight.float().t(), -1).gather(-1, labels[:, None])[:, 0]
        got = {}
        for fp32 in (False, True):
            layer.weight.grad = None
            h = (full.chunk(2, 0)[rank] if sp else full).clone().requires_grad_(True)
            req = LogprobRequest(rows=rows, labels=labels, vocab_size=vocab, chunk_size=8, with_entropy=True,
                                 recompute=True, fp32_logits=fp32)
            out = chunked_logprobs(h, layer, None, req)
            (out[:, 0].sum() + 0.1 * out[:, 1].sum()).backward()
            got[fp32] = (out.detach(), h.grad.float(), layer.weight.grad.float())
        lp, gx, gw = got[True]
        assert (lp[:, 0] - expected).abs().max() < 1e-4, (sp, (lp[:, 0] - expected).abs().max())
        # the bf16 path rounds these logits (|z| up to ~20) by up to 0.06
        assert (got[False][0][:, 0] - expected).abs().max() > 1e-3
        for mine, plain in ((gx, got[False][1]), (gw, got[False][2])):
            assert (mine - plain).abs().max() <= 0.05 * plain.abs().max(), sp


def test_fp32_logits_at_tp2_with_and_without_sequence_parallel():
    spawn(_ranks, 2)
