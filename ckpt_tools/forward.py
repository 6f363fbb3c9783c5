"""Run a (TP/PP/VPP-split) Megatron GPT model forward outside the training schedules.

Why not the pipeline schedules: verification only needs one forward pass with full-vocab logits on
every rank; plain point-to-point sends between stages are enough and keep the tool free of the
trainer's micro-batching machinery.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


@torch.no_grad()
def megatron_logits(model_chunks, input_ids: Tensor) -> Tensor:
    """Full-vocab logits ``[b, s, V_padded]`` (float32) on every rank of the model-parallel group.

    `input_ids` must be identical on all ranks. Chunks are run in pipeline order
    (virtual stage v of PP rank p is step ``v * pp + p``), hidden states travel by send/recv.
    """
    from megatron.core import parallel_state as ps
    from megatron_rl.bridge.base import unwrap

    pp = ps.get_pipeline_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    tp = ps.get_tensor_model_parallel_world_size()
    pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()) if pp > 1 else [dist.get_rank()]
    models = [unwrap(c) for c in model_chunks]
    cfg = models[0].config
    device = next(models[0].parameters()).device
    input_ids = input_ids.to(device)
    b, s = input_ids.shape
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    steps = len(models) * pp
    hidden_shape = (s, b, cfg.hidden_size)
    out = None
    for step in range(steps):
        v, stage = divmod(step, pp)
        if stage != pp_rank:
            continue
        model = models[v]
        if step > 0:
            recv = torch.empty(hidden_shape, dtype=cfg.pipeline_dtype or cfg.params_dtype, device=device)
            dist.recv(recv, src=pp_ranks[(step - 1) % pp])
            model.set_input_tensor(recv)
        y = model(input_ids, position_ids, attention_mask=None)
        if step < steps - 1:
            dist.send(y.contiguous(), dst=pp_ranks[(step + 1) % pp])
        else:
            out = y
    if pp_rank == pp - 1:
        logits = out.float().contiguous()
        if tp > 1:
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits, group=ps.get_tensor_model_parallel_group())
            logits = torch.cat(parts, dim=-1)
    else:
        logits = torch.empty((b, s, models[0].vocab_size), dtype=torch.float32, device=device)
    if pp > 1:
        dist.broadcast(logits, src=pp_ranks[-1], group=ps.get_pipeline_model_parallel_group())
    return logits
