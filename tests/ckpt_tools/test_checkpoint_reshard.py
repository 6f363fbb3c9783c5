"""megatron_rl.checkpoint: save at one TP/PP, resume at another, exactly; broken checkpoints are named."""
import json
import os
import queue

import pytest
import torch
import torch.distributed as dist

from megatron_rl.checkpoint import (CheckpointError, latest_iteration, load_checkpoint, read_meta,
                                    resolve_checkpoint, save_checkpoint)
from megatron_rl.parallel import spawn


def _trainer(cfg, tp, pp):
    """Megatron DDP + distributed Adam + warmup schedule (the state a resume must restore)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron_rl.models import BuildOptions, ParallelSizes, build_model
    from megatron_rl.parallel import init_parallel

    init_parallel(tp, pp)
    chunks = build_model(cfg, ParallelSizes(tp, pp), BuildOptions())
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    model = [DistributedDataParallel(c.config, ddp_cfg, c) for c in chunks]
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=0.0, use_distributed_optimizer=True,
                                                 params_dtype=torch.float32, clip_grad=0.0), model)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=0.0, lr_warmup_steps=4,
                                    lr_decay_steps=100, lr_decay_style="linear", start_wd=0.0, end_wd=0.0,
                                    wd_incr_steps=100, wd_incr_style="constant")
    return model, opt, sched


def _train_step(model, opt, sched, ids):
    m = model[0]
    m.zero_grad_buffer()
    opt.zero_grad()
    pos = torch.arange(ids.shape[1] - 1).expand(ids.shape[0], -1)
    loss = m(ids[:, :-1], pos, None, labels=ids[:, 1:]).float().mean()
    loss.backward()
    m.finish_grad_sync()
    opt.step()
    sched.step(1)
    return loss.item()


def _real_vocab_loss(chunks, ids, vocab):
    from ckpt_tools.forward import megatron_logits

    logits = megatron_logits(chunks, ids[:, :-1])[..., :vocab]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1)).item()


def _reshard_run(root):
    from megatron_rl.models import BuildOptions, ParallelSizes, build_model
    from megatron_rl.parallel import init_parallel
    from tests.bridge.tiny_qwen3 import tiny_config, tokens

    torch.set_num_threads(1)
    cfg = tiny_config(tied=False)
    ids = tokens(cfg.vocab_size, seq=13)

    # TP=1 (dp=2): two steps, save, then the reference continuation.
    model, opt, sched = _trainer(cfg, 1, 1)
    rank = dist.get_rank()
    for _ in range(2):
        _train_step(model, opt, sched, ids)
    if rank == 0:
        os.makedirs(os.path.join(root, ".iter_0000002.tmp", "junk"))  # a crashed earlier save
        os.makedirs(os.path.join(root, ".iter_0000001.tmp", "junk"))  # one of another iteration (other intervals)
    dist.barrier()
    path = save_checkpoint(root, 2, model, opt, sched, extra={"rank": rank, "data_pos": [7, 8]}, hf_config=cfg)
    assert path.endswith("iter_0000002") and latest_iteration(root) == 2
    assert not [p for p in os.listdir(root) if p.startswith(".")], "temp dirs left behind"
    # the save reported through an in-process queue: no multiprocessing Manager was spawned for it (5-6 s)
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    assert isinstance(filesystem_async._results_queue, queue.Queue)
    loss_at_save = _real_vocab_loss([m.module for m in model], ids, cfg.vocab_size)
    ref = [_train_step(model, opt, sched, ids) for _ in range(3)]

    # TP=2: same weights; save again straight away.
    model, opt, sched = _trainer(cfg, 2, 1)
    extra = load_checkpoint(root, model, opt, sched)
    assert extra == {"rank": rank, "data_pos": [7, 8], "iteration": 2}
    assert abs(_real_vocab_loss([m.module for m in model], ids, cfg.vocab_size) - loss_at_save) < 1e-5
    save_checkpoint(root, 3, model, opt, sched, extra={"rank": rank}, hf_config=cfg)

    # back at TP=1: model + optimizer + scheduler went through TP=2 bit-exactly.
    model, opt, sched = _trainer(cfg, 1, 1)
    assert load_checkpoint(root, model, opt, sched)["iteration"] == 3
    assert [_train_step(model, opt, sched, ids) for _ in range(3)] == ref

    # PP=2, weights only; iteration 2 as a re-save killed between its two renames left it: moved aside
    dist.barrier()
    if rank == 0:
        os.replace(os.path.join(root, "iter_0000002"), os.path.join(root, ".iter_0000002.old"))
    dist.barrier()
    init_parallel(1, 2)
    chunks = build_model(cfg, ParallelSizes(1, 2), BuildOptions())
    assert load_checkpoint(root, chunks, iteration=2)["iteration"] == 2
    assert abs(_real_vocab_loss(chunks, ids, cfg.vocab_size) - loss_at_save) < 1e-5
    save_checkpoint(root, 2, chunks, hf_config=cfg)   # saved again: the moved-aside copy goes
    assert os.path.isdir(os.path.join(root, "iter_0000002")) and not os.path.exists(os.path.join(root, ".iter_0000002.old"))
    dist.barrier()
    if rank == 0:   # the latest is 3 again for what follows
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("3")
    dist.barrier()

    # vocab 300 pads to 384 at TP=1 and 512 at TP=2: padding rows reshape on load.
    cfg300 = tiny_config(vocab=300)
    init_parallel(1, 1)
    chunks = build_model(cfg300, ParallelSizes(1, 1), BuildOptions())
    save_checkpoint(os.path.join(root, "v300"), 1, chunks, hf_config=cfg300)
    want = _real_vocab_loss(chunks, ids, 300)
    init_parallel(2, 1)
    chunks = build_model(cfg300, ParallelSizes(2, 1), BuildOptions())
    load_checkpoint(os.path.join(root, "v300"), chunks)
    assert abs(_real_vocab_loss(chunks, ids, 300) - want) < 1e-5

    # weights-only checkpoint asked for optimizer state; a corrupt shard file.
    model, opt, sched = _trainer(cfg300, 1, 1)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_checkpoint(os.path.join(root, "v300"), model, opt)
    dist.barrier()
    if rank == 0:
        shard = os.path.join(root, "iter_0000003", "__0_0.distcp")
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    dist.barrier()
    init_parallel(2, 1)
    chunks = build_model(cfg, ParallelSizes(2, 1), BuildOptions())
    with pytest.raises(CheckpointError, match="iter_0000003"):
        load_checkpoint(root, chunks)


@pytest.mark.slow
def test_save_tp1_resume_tp2_pp2_exactly(tmp_path):
    spawn(_reshard_run, 2, str(tmp_path))
    meta = read_meta(tmp_path / "iter_0000003")
    assert (meta["tp"], meta["pp"], meta["world_size"], meta["bridge"]) == (2, 1, 2, "qwen3")
    assert meta["has_optimizer"] and meta["hf_config"]["vocab_size"] == 250
    assert sorted(os.listdir(tmp_path / "iter_0000003" / "extra")) == ["rank_00000.pt", "rank_00001.pt"]


def test_missing_and_corrupt_checkpoints_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt"):
        resolve_checkpoint(tmp_path)
    assert latest_iteration(tmp_path) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("banana")
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt"):
        latest_iteration(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("12\n")
    with pytest.raises(CheckpointError, match="iter_0000012"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "iter_0000012").mkdir()
    with pytest.raises(CheckpointError, match="metadata.json"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "iter_0000012" / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    assert resolve_checkpoint(tmp_path) == (12, tmp_path / "iter_0000012")
    with pytest.raises(CheckpointError, match="meta.json"):
        read_meta(tmp_path / "iter_0000012")
    (tmp_path / "iter_0000012" / "meta.json").write_text("{")
    with pytest.raises(CheckpointError, match="meta.json"):
        read_meta(tmp_path / "iter_0000012")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    (tmp_path / "release").mkdir()
    (tmp_path / "release" / "metadata.json").write_text("{}")
    assert latest_iteration(tmp_path) == 0 and resolve_checkpoint(tmp_path) == (0, tmp_path / "release")
