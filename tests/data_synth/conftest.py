"""Shared task sets for the data_synth tests: generated once per session (validation included)."""
import pytest

from data_synth.decontam import Decontaminator, Reference
from data_synth.generate import GenConfig, generate_candidate
from data_synth.ops import Binary, Reduce, Unary, get_op
from data_synth.pipeline import generate_task_set
from data_synth.taskset import write_task_set
from data_synth.validate import ValidationConfig, validate_task

# verifier settings that keep a CPU verification to seconds once the extension is built
FAST_VERIFIER = {"num_correct_trials": 2, "num_timing_trials": 3, "time_budget_s": 0.5, "num_warmup": 1}


@pytest.fixture(scope="session")
def kb_reference():
    return Reference.load_index()


@pytest.fixture(scope="session")
def stage_sets(tmp_path_factory, kb_reference):
    """{stage: (folder, tasks, records)} for stages 1-3, generated with validation and decontamination."""
    out = {}
    for stage, n in ((1, 10), (2, 5), (3, 4)):
        cfg = GenConfig(stage=stage, n=n, seed=11)
        tasks, records = generate_task_set(cfg, validation=ValidationConfig(), decontam=Decontaminator([kb_reference]),
                                           progress=False)
        folder = write_task_set(tasks, str(tmp_path_factory.mktemp(f"stage{stage}") / "tasks"))
        out[stage] = (folder, tasks, records)
    return out


@pytest.fixture(scope="session")
def teacher_set(tmp_path_factory, kb_reference):
    """One task the offline teacher writes, on disk: a stage-2 chain with a reduction and an elementwise op, so
    one extension build exercises both templates (a build costs tens of CPU seconds)."""
    cfg = GenConfig(stage=2, n=1, seed=3, families=("reduction", "elementwise"), teacher_only=True,
                    dtypes={"float32": 1.0}, max_ops=3)
    for index in range(200):
        t = generate_candidate(cfg, index)
        ops = [get_op(n.op) for n in t.graph.nodes]
        if any(isinstance(o, Reduce) for o in ops) and any(isinstance(o, (Unary, Binary)) for o in ops):
            break
    assert validate_task(t).ok
    folder = write_task_set([t], str(tmp_path_factory.mktemp("teacher") / "tasks"))
    return folder, [t]
