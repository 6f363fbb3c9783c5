"""Running a tool's work on tp*pp local ranks, and staging its output directory.

`run_ranks` turns a failure on any rank into one readable `ToolError` (the last line of that
rank's traceback, e.g. ``BridgeError: model.layers.0.self_attn.q_proj.weight: ...``).
`staged_output` guarantees that a failed command leaves no output directory behind: work happens
in a hidden sibling temp dir that is renamed into place only on success, under the output's lock.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

from megatron_rl.fsutil import OutputBusyError, output_lock, write_problem


class ToolError(RuntimeError):
    """Bad input or a failed conversion; the CLI prints it and exits non-zero."""


def limit_threads(world_size: int) -> None:
    """Share the CPU cores between local ranks instead of oversubscribing them."""
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world_size)))


def run_ranks(fn: Callable, world_size: int, *args) -> None:
    from torch.multiprocessing.spawn import ProcessRaisedException, ProcessExitedException

    from megatron_rl.parallel import spawn

    try:
        spawn(fn, world_size, *args)
    except ProcessRaisedException as e:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        last = lines[-1].strip() if lines else "a rank failed"
        # a rank's own ToolError already names the file; its class name adds nothing
        raise ToolError(last.removeprefix(f"{ToolError.__module__}.{ToolError.__qualname__}: ")) from None
    except ProcessExitedException as e:
        raise ToolError(f"a rank died: {e}") from None


@contextlib.contextmanager
def staged_output(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp dir next to `out_dir`; on success rename it to `out_dir`, else delete it.

    Refuses an existing non-empty `out_dir`, and one that another conversion is writing (`output_lock`: the second
    of two conversions into one output stopped only at its final rename, its work lost). A failed write is named
    with what the disk says (a full one: "No space left on device", which safetensors reports without the path).
    Parent directories created here are removed again on failure.
    """
    out = Path(out_dir).absolute()
    if out.is_symlink():
        # a link to the directory to fill (on another disk, say): the finished output replaces the link's target.
        # Renaming onto the link itself fails (an empty directory through a link cannot be removed), and only
        # after the whole conversion ran
        try:
            target = out.resolve()
        except (OSError, RuntimeError) as e:  # a loop of links
            raise ToolError(f"output {out}: cannot follow the symbolic link ({e})") from None
        if not target.parent.is_dir():   # a link into an unmounted disk: never fill the mount point's root disk
            raise ToolError(f"output {out} is a symbolic link to {target}, whose folder {target.parent} does not "
                            f"exist (an unmounted disk?)")
        out = target
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ToolError(f"output {out} already exists and is not empty; refusing to overwrite it")
    created: list[Path] = []
    p = out.parent
    while not p.exists():
        created.append(p)
        p = p.parent
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    lock = contextlib.ExitStack()
    try:
        for d in reversed(created):
            d.mkdir()
        lock.enter_context(output_lock(out, "conversion"))
        if out.exists() and (not out.is_dir() or any(out.iterdir())):   # filled while this one waited for the lock
            raise OutputBusyError(f"output {out} already exists and is not empty; refusing to overwrite it")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except (OSError, OutputBusyError) as e:
        lock.close()
        for d in created:
            with contextlib.suppress(OSError):
                d.rmdir()
        raise ToolError(f"cannot create the output next to {out}: {e}" if isinstance(e, OSError) else str(e)) from None
    try:
        with lock:
            try:
                yield tmp
            except Exception as e:
                problem = write_problem(tmp)   # while the partial output still fills the disk
                if problem is None:
                    raise
                raise ToolError(f"writing {out}: {problem.strerror} (nothing was written; {e})") from e
            try:
                if out.exists():
                    out.rmdir()  # empty when checked above; not if another run filled it meanwhile
                os.replace(tmp, out)
            except OSError as e:
                raise ToolError(f"cannot move the finished output into place at {out}: {e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in created:
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
