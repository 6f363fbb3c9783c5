"""HF <-> Megatron distributed-checkpoint conversion (the `hf-to-mcore` / `mcore-to-hf` commands).

Both directions spawn tp*pp ranks, build the Megatron model for the HF config with
`megatron_rl.models.build_model`, and move weights with the bridge (`load_hf_into` /
`export_hf`). Checkpoints are written with `megatron_rl.checkpoint.save_checkpoint`, so the
trainer loads them with `load_checkpoint` at any TP/PP.

Everything that can be checked before ranks start (directories, config fields against the model
spec and the TP/PP sizes, safetensors headers and tensor names) is checked in the parent, so bad
input fails fast with a message naming the file or field.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from megatron_rl.bridge import BridgeError, HFCheckpointError, LazyHFState, get_bridge
from megatron_rl.bridge.hf_dir import (check_architectures, check_hf_input, follow_source_dtypes,
                                      load_fp32_source_dtypes, load_hf_config, load_passthrough, load_source_layout,
                                      load_source_weight_map)
from megatron_rl.checkpoint import (HF_ASSETS_DIR, META_FILE, CheckpointError, check_files, read_meta,
                                   resolve_checkpoint)
from megatron_rl.models import ConfigMismatchError, ParallelSizes

from .hf_io import (DEFAULT_MAX_SHARD_BYTES, PARAMS_DTYPES, ShardedSafetensorsWriter, config_dtype,
                    config_from_dict, copy_assets, dtype_name, follow_weight_map, parse_dtype, write_hf_config)
from .ranks import ToolError, limit_threads, run_ranks, staged_output

INPUT_ERRORS = (HFCheckpointError, ConfigMismatchError, BridgeError, CheckpointError, ValueError)


@dataclasses.dataclass(frozen=True)
class HFToMcore:
    hf_dir: str
    out_dir: str
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    dtype: str | None = None  # None: the HF config's dtype (else the weights' dtype)
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class McoreToHF:
    ckpt_dir: str
    out_dir: str
    tp: int = 1
    pp: int = 1
    dtype: str | None = None  # None: the checkpoint's params dtype
    #: None: the source release's shard files (names and contents) when the checkpoint recorded them, else
    #: `DEFAULT_MAX_SHARD_BYTES`; a size packs the export into shards of at most that many bytes
    max_shard_bytes: int | None = None
    iteration: int | None = None
    progress: bool = True


def _tqdm(**kw):
    from tqdm import tqdm

    return tqdm(file=sys.stderr, dynamic_ncols=True, **kw)


def _resolve_dtype(requested: str | None, cfg, state: LazyHFState, bridge) -> torch.dtype:
    """Megatron params dtype: `requested`, else the weights' own dtype.

    The weights win over config.json's ``dtype``/``torch_dtype`` because a Megatron model has one
    params dtype and converting in the weights' dtype is what keeps HF -> Megatron -> HF bitwise;
    trusting a config that says bfloat16 over float32 weights would silently round them. A
    checkpoint mixing dtypes cannot round-trip exactly: it is converted in the config's dtype (or
    the most common one) with a warning naming the tensors that get cast. Tensors the architecture keeps
    in fp32 are left out of the count: they neither mix the dtypes nor get cast."""
    if requested is not None:
        return parse_dtype(requested)
    # fp32-kept tensors (GDN's A_log) get no vote: the model holds them in fp32 whatever the params dtype
    names = [n for u in bridge.export_units() if not bridge.keeps_fp32(u) for n in u.hf_names if n in state]
    by_dtype: dict[torch.dtype, list[str]] = {}
    for n in names:
        by_dtype.setdefault(state.dtype(n), []).append(n)
    declared = config_dtype(cfg)
    if len(by_dtype) == 1:
        (dtype,) = by_dtype
        _check_params_dtype(dtype, by_dtype[dtype], state)
        if declared is not None and declared != dtype:
            print(f"warning: {Path(state.path) / 'config.json'} declares dtype {dtype_name(declared)} but the "
                  f"weights are {dtype_name(dtype)}; converting in {dtype_name(dtype)} "
                  f"(pass --dtype to choose)", file=sys.stderr)
        return dtype
    dtype = declared if declared in by_dtype else max(by_dtype, key=lambda d: len(by_dtype[d]))
    _check_params_dtype(dtype, by_dtype[dtype], state)
    cast = [n for d, ns in by_dtype.items() if d != dtype for n in ns]
    print(f"warning: {state.path}: weights mix dtypes {sorted(dtype_name(d) for d in by_dtype)}; converting in "
          f"{dtype_name(dtype)}, which casts {cast[:5]}{' and more' if len(cast) > 5 else ''} "
          f"(pass --dtype to choose)", file=sys.stderr)
    return dtype


def _check_params_dtype(dtype: torch.dtype, names: list[str], state: LazyHFState) -> None:
    """Refuse, before any rank starts, a weights dtype the Megatron model cannot be built in (float64): the
    ranks would otherwise fail on it without naming the checkpoint. ``--dtype`` converts such weights."""
    if dtype not in PARAMS_DTYPES:
        supported = ", ".join(map(dtype_name, PARAMS_DTYPES))
        raise HFCheckpointError(f"{state.file_of(names[0])}: weights are {dtype_name(dtype)} (e.g. {names[0]!r}); "
                                f"Megatron params dtypes supported: {supported}; pass --dtype float32 to convert "
                                f"them in float32 (the export is then float32)")


def hf_to_mcore(job: HFToMcore) -> Path:
    par = ParallelSizes(job.tp, job.pp, job.vpp)
    try:
        cfg, bridge, state = check_hf_input(job.hf_dir, par)
        dtype = _resolve_dtype(job.dtype, cfg, state, bridge)
    except INPUT_ERRORS as e:
        raise ToolError(str(e)) from None
    with staged_output(job.out_dir) as tmp:
        run_ranks(_hf_to_mcore_rank, job.tp * job.pp, str(Path(job.hf_dir).absolute()), str(tmp),
                  job.tp, job.pp, job.vpp, dtype_name(dtype), job.progress)
    return Path(job.out_dir)


def _hf_to_mcore_rank(hf_dir, out_root, tp, pp, vpp, dtype, progress):
    from megatron_rl.checkpoint import save_checkpoint
    from megatron_rl.models import BuildOptions, build_model
    from megatron_rl.parallel import init_parallel

    limit_threads(tp * pp)
    info = init_parallel(tp, pp, vpp=vpp)
    cfg = load_hf_config(hf_dir)
    chunks = build_model(cfg, ParallelSizes(tp, pp, vpp),
                         BuildOptions(params_dtype=parse_dtype(dtype), perform_initialization=False))
    state = LazyHFState(hf_dir)
    bridge = get_bridge(cfg, hf_names=state.keys())  # names under the prefix the weights use
    n_params = sum(1 for c in chunks for _ in c.parameters())
    bar = _tqdm(total=n_params, desc="hf-to-mcore: load", unit="param", disable=not progress or info.rank != 0)
    bridge.load_hf_into(chunks, state, on_param=lambda _name: bar.update())
    bar.close()
    if progress and info.rank == 0:
        print("hf-to-mcore: writing distributed checkpoint", file=sys.stderr, flush=True)
    save_checkpoint(out_root, 0, chunks, hf_config=cfg, hf_assets_dir=hf_dir)


def mcore_to_hf(job: McoreToHF) -> Path:
    par = ParallelSizes(job.tp, job.pp)
    try:
        _it, ckpt = resolve_checkpoint(job.ckpt_dir, job.iteration)
        meta = read_meta(ckpt)
        if not meta.get("hf_config"):
            raise CheckpointError(f"{ckpt / 'meta.json'}: has no hf_config; save the checkpoint with "
                                  f"hf_config= to export it")
        check_files(ckpt)
        cfg = config_from_dict(meta["hf_config"])
        layout = load_source_layout(ckpt / HF_ASSETS_DIR)
        # the names the source used (its prefix, a tied lm_head it stored anyway), checked before any rank starts
        bridge = get_bridge(cfg, layout=layout)
        bridge.hf_param_names()
        bridge.validate(par)
        # a checkpoint converted before `load_hf_config` checked them may still carry wrong ones into the export
        check_architectures(cfg, f"{ckpt / META_FILE}: hf_config")
        out_dtype = parse_dtype(job.dtype) if job.dtype else parse_dtype(meta.get("params_dtype", "float32"))
        if job.max_shard_bytes is not None and job.max_shard_bytes <= 0:
            raise ValueError(f"max shard size must be positive, got {job.max_shard_bytes}")
        single_file = layout["single_file"]
        weight_map = load_source_weight_map(ckpt / HF_ASSETS_DIR) if job.max_shard_bytes is None else None
    except INPUT_ERRORS as e:
        raise ToolError(str(e)) from None
    with staged_output(job.out_dir) as tmp:
        run_ranks(_mcore_to_hf_rank, job.tp * job.pp, str(Path(job.ckpt_dir).absolute()), job.iteration,
                  str(tmp), job.tp, job.pp, dtype_name(out_dtype), job.max_shard_bytes or DEFAULT_MAX_SHARD_BYTES,
                  single_file, weight_map, job.progress)
        write_hf_config(tmp, meta["hf_config"], out_dtype, bridge.hf_architectures)
        copy_assets(ckpt / HF_ASSETS_DIR, tmp)
    return Path(job.out_dir)


def _mcore_to_hf_rank(ckpt_root, iteration, out_dir, tp, pp, out_dtype, max_shard_bytes, single_file, weight_map,
                      progress):
    from megatron_rl.checkpoint import load_checkpoint
    from megatron_rl.models import BuildOptions, build_model
    from megatron_rl.parallel import init_parallel

    limit_threads(tp * pp)
    info = init_parallel(tp, pp)
    _it, ckpt = resolve_checkpoint(ckpt_root, iteration)
    meta = read_meta(ckpt)
    cfg = config_from_dict(meta["hf_config"])
    params_dtype = parse_dtype(meta.get("params_dtype", "float32"))
    chunks = build_model(cfg, ParallelSizes(tp, pp),
                         BuildOptions(params_dtype=params_dtype, perform_initialization=False))
    load_checkpoint(ckpt_root, chunks, iteration=iteration, load_optimizer=False)
    bridge = get_bridge(cfg, layout=load_source_layout(ckpt / HF_ASSETS_DIR))  # the source's names
    passthrough = load_passthrough(ckpt / HF_ASSETS_DIR) if info.rank == 0 else {}
    # a source that was one model.safetensors comes back as one when it fits, a sharded one as the same shard
    # files and index when they hold exactly the exported tensors (`load_source_layout`)
    weight_map = follow_weight_map(weight_map, [*bridge.hf_param_names(), *passthrough])
    writer = (ShardedSafetensorsWriter(out_dir, max_shard_bytes, single_file, weight_map=weight_map)
              if info.rank == 0 else None)
    bar = _tqdm(total=len(bridge.hf_param_names()), desc="mcore-to-hf", unit="tensor",
                disable=not progress or info.rank != 0)
    # fp32-kept tensors (GDN's A_log) that the source stored in the output dtype go back in it, byte for byte
    stream = follow_source_dtypes(bridge.export_hf(chunks, dtype=parse_dtype(out_dtype)),
                                  load_fp32_source_dtypes(ckpt / HF_ASSETS_DIR), parse_dtype(out_dtype))
    for name, tensor in stream:
        if writer is not None:
            writer.add(name, tensor)
        bar.update()
    bar.close()
    if writer is not None:
        # tensors the model does not hold (a multimodal checkpoint's vision tower, MTP), byte for byte
        writer.add_all(passthrough.items())
        writer.close()
