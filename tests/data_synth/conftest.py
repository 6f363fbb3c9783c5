"""Shared task sets for the data_synth tests: generated once per session (validation included)."""
import pytest

from data_synth.decontam import Decontaminator, Reference
from data_synth.generate import GenConfig
from data_synth.pipeline import generate_task_set
from data_synth.taskset import write_task_set
from data_synth.validate import ValidationConfig

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
