"""Distributed checkpoints of the Megatron actor (megatron-core ``dist_checkpointing``).

Layout (Megatron-LM compatible)::

    <root>/latest_checkpointed_iteration.txt      "123"  (or "release")
    <root>/iter_0000123/                          dist-ckpt files (torch_dist: *.distcp, .metadata, metadata.json)
    <root>/iter_0000123/meta.json                 HF config, tp/pp/vpp/world at save, bridge name, contents
    <root>/iter_0000123/extra/rank_00000.pt       the trainer's opaque `extra` dict, one file per rank
    <root>/iter_0000123/hf_assets/                config/tokenizer/generation files, passthrough tensors and
                                                  the source release's layout (optional)

Why this shape:
- Weights are stored as global tensors, so a checkpoint saved at one TP/PP reloads at another.
  The optimizer uses the ``fully_reshardable`` sharding type for the same reason.
- Atomic: everything is written into ``<root>/.iter_0000123.tmp``, fsynced, renamed, and only then
  is ``latest_checkpointed_iteration.txt`` replaced (temp file + rename). A crash leaves either the
  old checkpoint or the new one, never a half-written directory under the final name.
- ``extra`` is per rank (RNG states differ per rank); on a different world size every rank gets
  rank 0's copy.

`save_checkpoint` and `load_checkpoint` are collective over the default process group: call them on
every rank. The path helpers (`latest_iteration`, `resolve_checkpoint`, `read_meta`) are not.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import queue
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException as DCPException   # a BaseException

from megatron_rl.fsutil import describe_os_error, fsync_dir, write_problem, write_text_atomic

log = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
META_FILE = "meta.json"
EXTRA_DIR = "extra"
HF_ASSETS_DIR = "hf_assets"
DIST_CKPT_MARKER = "metadata.json"  # written by dist_checkpointing.save
#: 1: the first layout. 2: a Gated DeltaNet layer's output norm holds HF's plain gain ``w``. Format-1 checkpoints
#: saved before the code changed to the plain gain (`GDN_PLAIN_GAIN_SINCE`) hold ``w - 1`` (the norm was
#: zero-centred like every other one), which `load_checkpoint` converts on load.
FORMAT_VERSION = 2
#: when the plain GDN output gain landed (commit df24adc); format 2 came hours later, so format-1 checkpoints saved
#: between the two already hold ``w``. A format-1 checkpoint's ``saved_at`` tells which it is.
GDN_PLAIN_GAIN_SINCE = datetime.datetime(2026, 12, 5, 1, 49, 17, tzinfo=datetime.timezone.utc)
#: the Megatron parameters whose meaning changed in format 2 (only a GDN mixer has an ``out_norm``)
_GDN_OUT_NORM_SUFFIX = "self_attention.out_norm.weight"

#: HF files worth carrying with a checkpoint so it can be exported as an HF release: the side files of a Qwen3 /
#: Qwen3.5 / Qwen3-VL hub repo, under transformers' names (CONFIG_NAME, GENERATION_CONFIG_NAME, the tokenizer's
#: files, CHAT_TEMPLATE_FILE and its legacy .json, and the multimodal processor's IMAGE_PROCESSOR_NAME,
#: VIDEO_PROCESSOR_NAME and PROCESSOR_NAME, without which the exported release loads no AutoProcessor).
HF_ASSET_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "video_preprocessor_config.json",
    "processor_config.json",
)
#: HF folders carried the same way, their regular files only: the named chat templates a release ships beside
#: chat_template.jinja (transformers' CHAT_TEMPLATE_DIR), which ``apply_chat_template(chat_template=name)`` reads
HF_ASSET_DIRS = ("additional_chat_templates",)


class CheckpointError(RuntimeError):
    """A missing, corrupt or incompatible checkpoint (the message names the file or directory)."""


def iteration_dir_name(iteration: int | str) -> str:
    if iteration == "release":
        return "release"
    if not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be a non-negative int or 'release', got {iteration!r}")
    return f"iter_{iteration:07d}"


def checkpoint_dir(ckpt_root: str | os.PathLike, iteration: int | str) -> Path:
    return Path(ckpt_root) / iteration_dir_name(iteration)


def latest_iteration(ckpt_root: str | os.PathLike) -> int | None:
    """The iteration recorded in ``latest_checkpointed_iteration.txt`` (0 for 'release'), or None."""
    path = Path(ckpt_root) / LATEST_FILE
    if not path.exists():
        return None
    text = path.read_text().strip()
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number or 'release', got {text[:40]!r}") from None


def _latest_dir(root: Path) -> tuple[int, Path]:
    path = root / LATEST_FILE
    if not path.exists():
        raise CheckpointError(f"{path}: not found; {root} holds no checkpoint")
    it = latest_iteration(root)
    if path.read_text().strip() == "release":
        return 0, root / "release"
    return it, checkpoint_dir(root, it)


def read_meta(ckpt_dir: str | os.PathLike) -> dict:
    path = Path(ckpt_dir) / META_FILE
    if not path.exists():
        raise CheckpointError(f"{path}: missing (not a complete checkpoint)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt ({e})") from None


def resume_problem(ckpt_root: str | os.PathLike) -> str | None:
    """Why ``--resume`` cannot continue from `ckpt_root` (no checkpoint, an unreadable latest-iteration file), or
    None: what a launcher reports as a usage error before it writes or starts anything."""
    try:
        found = latest_iteration(ckpt_root) is not None
    except CheckpointError as e:
        return f"--resume: {e}"
    return None if found else f"--resume: no checkpoint under {ckpt_root} (train.ckpt_dir)"


def resolve_checkpoint(ckpt_root: str | os.PathLike, iteration: int | None = None) -> tuple[int, Path]:
    """(iteration, directory) of the latest or the given checkpoint; raises CheckpointError."""
    root = Path(ckpt_root)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    if iteration is None:
        it, d = _latest_dir(root)
    else:
        it, d = iteration, checkpoint_dir(root, iteration)
        if not d.exists() and iteration == 0 and (root / "release").is_dir():
            d = root / "release"
    if not d.is_dir() and (d.parent / f".{d.name}.old" / META_FILE).is_file():
        # a re-save of this iteration was killed between moving the old copy aside and renaming the new one in:
        # the old copy is complete (the next save of this iteration removes it)
        log.warning("%s: missing; reading the copy a killed re-save moved aside, %s", d, f".{d.name}.old")
        d = d.parent / f".{d.name}.old"
    if not d.is_dir():
        raise CheckpointError(f"{d}: checkpoint directory not found")
    if not (d / DIST_CKPT_MARKER).exists():
        raise CheckpointError(f"{d / DIST_CKPT_MARKER}: missing; {d} is not a distributed checkpoint")
    return it, d


def check_files(ckpt_dir: str | os.PathLike) -> None:
    """Cheap structural check of a torch_dist checkpoint: every data file the index refers to
    exists and is long enough. Catches missing and truncated shards (a crashed copy, a full
    disk) before any rank reads, whichever parts each rank would read."""
    from torch.distributed.checkpoint import FileSystemReader

    d = Path(ckpt_dir)
    index = d / ".metadata"
    if not index.exists():
        raise CheckpointError(f"{index}: missing (incomplete checkpoint)")
    try:
        storage = FileSystemReader(str(d)).read_metadata().storage_data
    except Exception as e:  # noqa: BLE001 - unpickling garbage raises anything
        raise CheckpointError(f"{index}: corrupt ({type(e).__name__}: {e})") from None
    need: dict[str, int] = {}
    for info in storage.values():
        end = int(info.offset) + int(info.length)
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for rel, end in sorted(need.items()):
        path = d / rel
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in {index.name})")
        size = path.stat().st_size
        if size < end:
            raise CheckpointError(f"{path}: truncated ({size} bytes, the index needs {end})")


# ----------------------------------------------------------------------------------------------
def _sharded_metadata() -> dict:
    """The flags megatron-core's sharded_state_dict() methods read (same as Megatron-LM's)."""
    return {
        "distrib_optim_sharding_type": "fully_reshardable",
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
    }


def _with_groups(metadata: dict) -> dict:
    from megatron.core import parallel_state as ps

    return {**metadata, "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}


def _model_state(model_chunks, metadata: dict) -> dict:
    from megatron_rl.bridge.base import unwrap

    state = {}
    for i, chunk in enumerate(model_chunks):
        key = "model" if len(model_chunks) == 1 else f"model{i}"
        state[key] = unwrap(chunk).sharded_state_dict(metadata=metadata)
    return state


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_tree(path: Path) -> None:
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def _hf_config_dict(hf_config) -> dict | None:
    if hf_config is None:
        return None
    if isinstance(hf_config, dict):
        return hf_config
    return hf_config.to_dict()


def _params_dtype(model_chunks) -> str:
    from megatron_rl.bridge.base import unwrap

    return str(unwrap(model_chunks[0]).config.params_dtype).removeprefix("torch.")


def _parallel_meta(model_chunks) -> dict:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "vpp": len(model_chunks) if len(model_chunks) > 1 else None,
        "dp": ps.get_data_parallel_world_size(),
        "world_size": _world(),
    }


def _in_process_write_results() -> None:
    """Our saves are synchronous: megatron's writer threads report their results in this process, so they get an
    in-process queue. Left unset, megatron creates a ``multiprocessing.Manager`` queue from a *spawned* server
    process on the first save: a fresh interpreter importing torch, 5-6 s of every process that saves (SFT, RFT
    and RL runs; most checkpoint tests). Set only while megatron has none (an async caller's queue is kept)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(ckpt_root: str | os.PathLike, iteration: int, model_chunks, optimizer=None,
                    opt_param_scheduler=None, extra: dict | None = None, hf_config=None, *,
                    hf_assets_dir: str | os.PathLike | None = None) -> str:
    """Save model (+ optimizer, scheduler, per-rank `extra`) as ``<root>/iter_XXXXXXX``; returns it.

    `hf_config` (a transformers config or its dict) goes into meta.json so the checkpoint can be
    exported to HF without other inputs; `hf_assets_dir` (an HF model dir) contributes its
    config/tokenizer/generation files. Collective.
    """
    from megatron.core import dist_checkpointing

    root = Path(ckpt_root)
    final = checkpoint_dir(root, iteration)
    tmp = root / f".{final.name}.tmp"
    rank = _rank()
    error: list[str] = [""]
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            # this save's temp dir, and any a killed save left (of another iteration when a resumed run saves at
            # other steps): saves are synchronous and one run writes a root, so none of them is in use. (A
            # ``.iter_*.old`` may be the only copy of a checkpoint whose re-save was killed: it stays.)
            for stale in root.glob(".iter_*.tmp"):
                shutil.rmtree(stale)
            tmp.mkdir()
        except OSError as e:
            error[0] = f"cannot create {tmp}: {e}"
    _raise_if_any(error[0])

    metadata = _sharded_metadata()
    state: dict[str, Any] = _model_state(model_chunks, _with_groups(metadata))
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=False, metadata=_with_groups(metadata))
    if opt_param_scheduler is not None:
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    state["iteration"] = iteration
    _in_process_write_results()
    try:
        dist_checkpointing.save(state, str(tmp), content_metadata=metadata)
        (tmp / EXTRA_DIR).mkdir(exist_ok=True)
        extra_path = tmp / EXTRA_DIR / f"rank_{rank:05d}.pt"
        torch.save(dict(extra or {}), extra_path)
        with open(extra_path, "rb") as f:
            os.fsync(f.fileno())
    except (Exception, DCPException) as e:  # noqa: BLE001 - the writers raise anything for a full disk
        raise CheckpointError(_save_failure(final, tmp, e, rank)) from e
    _barrier()

    if rank == 0:
        try:
            from megatron_rl.bridge.registry import bridge_name_for

            cfg = _hf_config_dict(hf_config)
            meta = {
                "format_version": FORMAT_VERSION,
                "iteration": iteration,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **_parallel_meta(model_chunks),
                "num_model_chunks": len(model_chunks),
                "params_dtype": _params_dtype(model_chunks),
                "has_optimizer": optimizer is not None,
                "has_scheduler": opt_param_scheduler is not None,
                "bridge": bridge_name_for(cfg.get("model_type")) if cfg else None,
                "hf_config": cfg,
            }
            if hf_assets_dir is not None:
                copy_hf_assets(hf_assets_dir, tmp / HF_ASSETS_DIR)
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
            _fsync_tree(tmp)
            if final.exists():  # re-saving an iteration: move the old one aside first
                old = root / f".{final.name}.old"
                if old.exists():
                    shutil.rmtree(old)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old)
            else:
                os.replace(tmp, final)
                shutil.rmtree(root / f".{final.name}.old", ignore_errors=True)   # a killed re-save's copy
            fsync_dir(root)
            write_text_atomic(root / LATEST_FILE, str(iteration) if iteration != "release" else "release")
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error[0] = _save_failure(final, tmp, e, rank)
    _raise_if_any(error[0])
    return str(final)


def _save_failure(final: Path, tmp: Path, e: BaseException, rank: int) -> str:
    """One line on a failed save, once rank 0 removed its temp dir (a full disk gets its space back; the next save
    would remove it anyway). A full disk, a quota or a read-only or vanished folder is named as such
    (`write_problem`): torch's checkpoint writer reports one as ``unexpected pos 704 vs 598``. The pointer is not
    touched: ``--resume`` continues from the checkpoint it names, which the message says."""
    problem = write_problem(tmp.parent)   # not tmp: rank 0 removes it while the other ranks would probe it
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if problem is not None:
        why = problem.strerror or describe_os_error(problem)
    elif isinstance(e, OSError):
        why = describe_os_error(e)
    else:
        why = f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0][:300]
    try:
        latest = latest_iteration(final.parent)
    except CheckpointError:
        latest = None
    kept = (f"the latest checkpoint is still iteration {latest} ({final.parent / LATEST_FILE})" if latest is not None
            else "no earlier checkpoint")
    return f"saving {final} failed: {why}; {kept}"


def _raise_if_any(msg: str) -> None:
    """Rank 0 decides; every rank raises the same error (no rank is left waiting in a barrier)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [msg]
        dist.broadcast_object_list(box, src=0)
        msg = box[0]
    if msg:
        raise CheckpointError(msg)


def copy_hf_assets(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> list[str]:
    """Copy the HF config/tokenizer/generation files that exist in `src_dir`, the tensors of its checkpoint
    the Megatron model does not hold (`megatron_rl.bridge.hf_dir.save_passthrough`) and what an export needs to
    reproduce the release (the source dtypes of fp32-kept tensors, the weights' file layout); returns their names."""
    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in HF_ASSET_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    copied += copy_hf_asset_dirs(src, dst)
    # the bridge is imported here, not at the top: it registers every architecture (megatron-core specs), which
    # the checkpoint readers of the CLI tools do not need
    from megatron_rl.bridge.hf_dir import (FP32_SOURCE_DTYPES_FILE, PASSTHROUGH_FILE, SOURCE_LAYOUT_FILE,
                                           SOURCE_WEIGHT_MAP_FILE, save_fp32_source_dtypes, save_passthrough,
                                           save_source_layout)
    from megatron_rl.bridge.hf_state import INDEX_NAME

    # weights beside config.json, or wherever its index puts them (an index may name shards in a subfolder)
    if (src / "config.json").is_file() and (any(src.glob("*.safetensors")) or (src / INDEX_NAME).is_file()):
        if save_passthrough(src, dst):  # tensors the model does not hold (a vision tower), for the export
            copied.append(PASSTHROUGH_FILE)
        if save_fp32_source_dtypes(src, dst):  # the dtype a release stored A_log in, for the export
            copied.append(FP32_SOURCE_DTYPES_FILE)
        save_source_layout(src, dst)  # one model.safetensors, or which shard holds each tensor, for the export
        copied += [SOURCE_LAYOUT_FILE] + ([SOURCE_WEIGHT_MAP_FILE] if (dst / SOURCE_WEIGHT_MAP_FILE).is_file() else [])
    return copied


def copy_hf_asset_dirs(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> list[str]:
    """Copy each `HF_ASSET_DIRS` folder of `src_dir` that holds regular files (symlinks to them included, as in a
    hub cache) into `dst_dir`, built aside and renamed into place so a reader never sees half a folder;
    subfolders and other entries are left out. Returns the copied files' relative paths."""
    from megatron_rl.fsutil import replace_dir

    copied = []
    for name in HF_ASSET_DIRS:
        folder = Path(src_dir) / name
        files = sorted(f.name for f in folder.iterdir() if f.is_file()) if folder.is_dir() else []
        if not files:
            continue
        tmp = Path(dst_dir) / f".{name}.tmp{os.getpid()}"  # mkdir, not mkdtemp: the umask's mode, not 0700
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            for f in files:
                shutil.copy2(folder / f, tmp / f)
            replace_dir(tmp, Path(dst_dir) / name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        copied += [f"{name}/{f}" for f in files]
    return copied


def load_checkpoint(ckpt_root: str | os.PathLike, model_chunks, optimizer=None, opt_param_scheduler=None,
                    iteration: int | None = None, load_optimizer: bool = True) -> dict:
    """Load the latest (or given) checkpoint into `model_chunks` (+ optimizer/scheduler).

    The current TP/PP may differ from the saved one. Returns this rank's `extra` dict with
    ``iteration`` added. Raises CheckpointError (naming the file) when the checkpoint is
    missing or corrupt, or when optimizer state is requested from a weights-only checkpoint.
    """
    from megatron.core import dist_checkpointing
    from megatron_rl.bridge.base import unwrap

    it, d = resolve_checkpoint(ckpt_root, iteration)
    meta = read_meta(d)
    version = meta.get("format_version", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{d / META_FILE}: format_version {version!r} is newer than this code reads "
                              f"({FORMAT_VERSION}); load it with the version that wrote it")
    want_optimizer = optimizer is not None and load_optimizer
    if want_optimizer and not meta.get("has_optimizer", False):
        raise CheckpointError(f"{d}: has no optimizer state (saved without one, e.g. by hf-to-mcore); "
                              f"pass load_optimizer=False to load the weights only")
    check_files(d)
    try:
        saved_metadata = dist_checkpointing.load_content_metadata(str(d)) or _sharded_metadata()
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{d / '.metadata'}: unreadable checkpoint metadata ({e})") from None
    metadata = _with_groups(saved_metadata)
    state: dict[str, Any] = _model_state(model_chunks, metadata)
    if want_optimizer:
        _allocate_fresh_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=metadata)
    try:
        loaded = dist_checkpointing.load(state, str(d))
    except Exception as e:  # noqa: BLE001 - dist-ckpt raises many types for bad files
        raise CheckpointError(f"{d}: cannot load distributed checkpoint ({type(e).__name__}: {e})") from e
    for i, chunk in enumerate(model_chunks):
        key = "model" if len(model_chunks) == 1 else f"model{i}"
        unwrap(chunk).load_state_dict(loaded[key], strict=True)
    if want_optimizer:
        _follow_config_group_schedule(optimizer, loaded["optimizer"], d)
        optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(optimizer)
    if version < 2 and _holds_gdn_gain_minus_one(meta):
        _plain_gdn_out_norms(model_chunks, optimizer if want_optimizer else None, d)
    if opt_param_scheduler is not None and load_optimizer:
        if "opt_param_scheduler" not in loaded:
            raise CheckpointError(f"{d}: has no scheduler state; pass load_optimizer=False")
        _log_schedule_changes(opt_param_scheduler, loaded["opt_param_scheduler"], d)
        opt_param_scheduler.load_state_dict(loaded["opt_param_scheduler"])

    result = _load_extra(d, meta)
    result["iteration"] = it
    return result


#: a param group's fields that come from the config's LR and weight-decay settings (`optim.build_optimizer`)
_GROUP_SCHEDULE_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")


def _follow_config_group_schedule(optimizer, saved, ckpt_dir: Path) -> None:
    """Give each saved param group the current group's LR / weight-decay fields, so a resume runs at the config's
    values, as its scheduler does (`optim.build_scheduler`). megatron's distributed optimizer pairs saved and current
    groups by every field of `param_group_identifier_keys`, these included: a run resumed with another ``actor.lr``,
    ``min_lr`` or ``weight_decay`` stopped with ``KeyError: (None, 0.005, ...)``. Groups are paired here by their
    other (structural) fields; a pairing that is not one to one is left to megatron."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(inners) == 1:
        states = [saved]
    else:
        states = [v for _, v in sorted(saved.items())] if isinstance(saved, dict) else list(saved)
    structural = [k for k in param_group_identifier_keys if k not in _GROUP_SCHEDULE_KEYS]

    def key(group: dict) -> tuple:
        return tuple(group.get(k, group.get(f"pre_{k}")) for k in structural)

    changed: set[str] = set()
    for inner, state in zip(inners, states):
        saved_groups = ((state or {}).get("optimizer") or {}).get("param_groups") if isinstance(state, dict) else None
        current = getattr(getattr(inner, "optimizer", None), "param_groups", None)
        if not saved_groups or not current:
            continue
        by_key: dict[tuple, list[dict]] = {}
        for group in current:
            by_key.setdefault(key(group), []).append(group)
        if any(len(groups) > 1 for groups in by_key.values()):
            continue
        for group in saved_groups:
            match = by_key.get(key(group))
            if not match:
                continue
            for k in _GROUP_SCHEDULE_KEYS:
                if k in match[0] and group.get(k) != match[0][k]:
                    changed.add(f"{k} {group.get(k)} -> {match[0][k]}")
                    group[k] = match[0][k]
    if changed and _rank() == 0:
        log.warning("%s: the optimizer's param groups follow the config, not the checkpoint: %s", ckpt_dir,
                    ", ".join(sorted(changed)))


#: the LR schedule's fields a resume takes from the config (`optim.build_scheduler`), not from the checkpoint
_SCHEDULE_FIELDS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")


def _log_schedule_changes(scheduler, saved: dict, ckpt_dir: Path) -> None:
    """Name the schedule fields that differ from the checkpoint's: the config's win on resume (a longer run decays
    over its own horizon), which the log should say."""
    changed = [f"{k} {saved[k]} -> {getattr(scheduler, k)}" for k in _SCHEDULE_FIELDS
               if k in saved and getattr(scheduler, k, saved[k]) != saved[k]]
    if changed and _rank() == 0:
        log.warning("%s: the LR schedule follows the config, not the checkpoint: %s", ckpt_dir, ", ".join(changed))


def _holds_gdn_gain_minus_one(meta: dict) -> bool:
    """Whether a format-1 checkpoint stored GDN output norms as ``w - 1``: saved before `GDN_PLAIN_GAIN_SINCE` (or
    with no readable ``saved_at``, the oldest layout)."""
    try:
        saved = datetime.datetime.strptime(meta["saved_at"], "%Y-%m-%dT%H:%M:%S%z")
    except (KeyError, TypeError, ValueError):
        return True
    return saved < GDN_PLAIN_GAIN_SINCE


@torch.no_grad()
def _plain_gdn_out_norms(model_chunks, optimizer, ckpt_dir: Path) -> None:
    """Format 1 -> 2: a GDN output norm saved as ``w - 1`` becomes ``w``, in the model and, when the optimizer
    state was loaded, in its fp32 main copies of half-precision params (fp32 params' shards are views of the
    params, already done). Adam's moments need nothing: the gradient of ``w`` and of ``w - 1`` is the same."""
    from megatron_rl.bridge.base import unwrap

    norms = [p for chunk in model_chunks for name, p in unwrap(chunk).named_parameters()
             if name.endswith(_GDN_OUT_NORM_SUFFIX)]
    if not norms:
        return
    log.warning("%s: format 1 checkpoint of a Gated DeltaNet model; its output norms held w - 1 and are converted "
                "to HF's plain gain w (bits the old form lost for gains outside [0.5, 2] do not come back)", ckpt_dir)
    for p in norms:
        p.add_(1.0)
    targets = {id(p) for p in norms}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]) if optimizer is not None else []:
        for half_attr, main_attr in (("model_float16_groups", "shard_fp32_from_float16_groups"),
                                     ("float16_groups", "fp32_from_float16_groups")):
            for halves, mains in zip(getattr(opt, half_attr, []) or [], getattr(opt, main_attr, []) or []):
                for half, main in zip(halves, mains):
                    if id(half) in targets and main is not None:
                        main.add_(1.0)


def _allocate_fresh_optimizer_state(optimizer) -> None:
    """Give a never-stepped DistributedOptimizer its Adam state before a load.

    megatron-core 0.19 without TransformerEngine/Apex uses torch Adam, and
    ``DistributedOptimizer.state_dict()`` (called by ``sharded_state_dict(is_loading=True)``)
    asserts that every param state has a ``step``; a fresh optimizer has no state at all, so
    resuming fails. Allocating the state (its own ``init_state_fn``) with step 0 fixes that; the
    checkpoint overwrites all of it, step included.
    """
    from megatron.core.optimizer import distrib_optimizer as dopt

    if dopt.HAVE_APEX_OR_TE:
        return
    _patch_torch_adam_step_restore()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, dopt.DistributedOptimizer):
            continue
        inner = opt.optimizer
        if any("step" in s for s in inner.state.values()):
            continue
        if getattr(opt, "init_state_fn", None) is not None:
            opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.tensor(0.0))


def _unshare_adam_steps(optimizer) -> None:
    """Give every param its own torch-Adam ``step`` tensor after a load.

    megatron-core 0.19's DistributedOptimizer.load_state_dict (torch Adam path) assigns one
    ``step`` tensor object to all params; torch Adam increments each param's step in place, so a
    shared tensor advances once per parameter per iteration and the bias correction goes wrong
    after resuming. Cloning restores one counter per param (same value).
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for st in inner.state.values():
            step = st.get("step")
            if isinstance(step, torch.Tensor):
                st["step"] = step.clone()


class _NoneForMissing(dict):
    def __missing__(self, key):
        return None


def _patch_torch_adam_step_restore() -> None:
    """Fix for megatron-core 0.19 + torch Adam (no TE/Apex): fully_reshardable optimizer loads.

    ``DistributedOptimizer._set_main_param_and_optimizer_states`` copies every tensor of the
    param's optimizer state from the loaded ``tensors`` dict, but the loader deliberately leaves
    torch Adam's ``step`` out of that dict (``step`` is restored separately from the param groups),
    so the copy raises ``KeyError: 'step'``. The method already skips non-tensor entries; passing a
    dict that yields None for absent keys makes it skip ``step`` as intended. Idempotent.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_skips_missing_keys", False):
        return

    def set_states(self, model_param, tensors):
        return original(self, model_param, _NoneForMissing(tensors))

    set_states._skips_missing_keys = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _load_extra(d: Path, meta: dict) -> dict:
    rank = _rank()
    same_world = meta.get("world_size") == _world()
    path = d / EXTRA_DIR / f"rank_{rank if same_world else 0:05d}.pt"
    if not path.exists():
        raise CheckpointError(f"{path}: missing (incomplete checkpoint)")
    try:
        extra = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path}: corrupt ({type(e).__name__}: {e})") from None
    if not isinstance(extra, dict):
        raise CheckpointError(f"{path}: expected a dict, got {type(extra).__name__}")
    return extra
