"""Probe 38: telling a checked call from a timed one by when garbage is collected, and an ablation trial by the
harness's own calls into the model.

Fixed here (wrong before):
- A forward could learn whether the collector was on: drop a cycle holding a ``__del__`` (allowed: no forbidden name),
  allocate ~1500 objects, and see whether ``__del__`` ran. Timed batches ran with the collector off, trials (the
  hidden ones included) with it on, so a candidate ran its kernel where it was profiled and ATen in the timed calls,
  whose outputs the audits check by value only: a pass timed on ``F.silu`` (level1/10_Swish at its own size). Every
  model call now starts right after a full collection and runs with the collector off (``_child.settle_garbage``;
  the harness's objects are frozen before the candidate is imported, so a collection costs microseconds).
- The ablation trial read the candidate model's tensors through ``modules()`` and ``state_dict(keep_vars=True)``, which
  a ``ModelNew`` may override (or hook): they ran in ablation trials only, so a decoy ran its kernel for real exactly
  there and returned allowed data movement beside a token native call everywhere else. The tensors are now read
  from the modules' instance dicts, without any code of the candidate's (``_child.DeviceSession._model_tensors``).

Found and still open (xfail below): the inputs' addresses. A timed batch's inputs are made together before it, at a
fixed stride, so "this input lies one stride past the previous one" holds for the timed calls after the first and for
no trial: a candidate ran ``torch.relu`` there and its kernel everywhere else, and passed. Closing it needs a hidden
trial that is one call of a timed batch, or inputs laid out at random (see verifier/README.md, Known limits).
"""
import pytest

from verifier.evaluate import verify
from verifier.tasks import load_task
from verifier.types import Category

from .candidates import compiled, task_path

FINALIZER = '''
class Probe:
    def __init__(self, box):
        self.box = box
        self.me = self      # a cycle: freed only by the collector

    def __del__(self):
        self.box[0] = True
'''

# kernel where a collection could run during the forward (trials, before the fix), torch.relu where none could
# (timed batches): the audits compare values only, so this passed
GC_TELL_EXPLOIT = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        box = [False]
        Probe(box)
        junk = [[k] for k in range(1500)]
        if box[0]:
            return ext.relu(x)
        return torch.relu(x)
'''

# the same questions, raising where the answer differs from the first call's (a correctness trial): during the call,
# and whether the previous call's garbage was collected before this one (the first call of a timed batch followed
# harness work with the collector on, the later ones did not)
GC_TELL_PROBE = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = None
        self.previous = [True]

    def forward(self, x):
        before = self.previous[0]
        self.previous = [False]
        Probe(self.previous)
        box = [False]
        Probe(box)
        junk = [[k] for k in range(1500)]
        seen = (before, box[0])
        if self.first is None:
            self.first = seen
        if seen != self.first:
            raise ValueError(f"told a call apart: {seen} != {self.first}")
        return ext.relu(x)
'''

# real work only in the call right after the harness read the model's state (the ablation trial, and construction)
STATE_DICT_DECOY = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.ablating = False

    def state_dict(self, *args, **kwargs):
        self.ablating = True
        return super().state_dict(*args, **kwargs)

    def forward(self, x):
        if self.ablating:
            self.ablating = False
            return ext.transpose2d(x)
        _ = ext.transpose2d(x[:1, :1].contiguous())
        return x.t().contiguous()
'''

# an honest kernel that leaves cyclic garbage with finalizers behind every call
HONEST_WITH_GARBAGE = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.box = [False]

    def forward(self, x):
        Probe(self.box)
        return ext.relu(x)
'''


@pytest.mark.slow
def test_a_forward_cannot_use_torch_where_no_collection_runs(make_cfg):
    r = verify(load_task(task_path("relu")), compiled(GC_TELL_EXPLOIT, prelude=FINALIZER), make_cfg())
    assert r.category == Category.CHEATING and r.rule == "forbidden_op", (r.category, r.rule, r.feedback)


@pytest.mark.slow
def test_trials_and_timed_calls_collect_garbage_alike(make_cfg):
    r = verify(load_task(task_path("relu")), compiled(GC_TELL_PROBE, prelude=FINALIZER), make_cfg())
    assert r.category == Category.PASS, (r.category, r.rule, r.feedback)


@pytest.mark.slow
def test_the_ablation_trial_runs_no_code_of_the_model(make_cfg):
    r = verify(load_task(task_path("transpose")), compiled(STATE_DICT_DECOY), make_cfg())
    assert r.category == Category.CHEATING and r.rule == "decoy_kernel", (r.category, r.rule, r.feedback)


@pytest.mark.slow
def test_an_honest_kernel_that_leaves_finalizers_behind_passes(make_cfg):
    r = verify(load_task(task_path("relu")), compiled(HONEST_WITH_GARBAGE, prelude=FINALIZER), make_cfg())
    assert r.category == Category.PASS, (r.category, r.rule, r.feedback)


# torch.relu where the input lies one stride past the previous call's (a timed call after the first of its batch)
POINTER_TELL = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.prev = 0
        self.delta = 0

    def forward(self, x):
        p = x.data_ptr()
        d = p - self.prev
        batch = d != 0 and d == self.delta
        self.prev, self.delta = p, d
        if batch:
            return torch.relu(x)
        return ext.relu(x)
'''


@pytest.mark.slow
@pytest.mark.xfail(reason="open: a timed batch's inputs lie at a fixed stride, trials' do not (README, Known limits)")
def test_a_forward_cannot_tell_a_timed_call_by_its_inputs_addresses(make_cfg):
    r = verify(load_task(task_path("relu")), compiled(POINTER_TELL), make_cfg())
    assert r.category == Category.CHEATING and r.rule == "forbidden_op", (r.category, r.rule, r.feedback)


def test_a_collection_before_a_call_scans_only_what_the_last_call_left():
    """Review of the fix above: a collection over every live object before each timed call let a candidate keep
    millions of objects alive through the reference's batch (~0.5-0.8 s a collection), slowing the reference's flush
    intervals, whose time the timer subtracts from the candidate's span (work hidden outside its timed calls). What
    survives a collection is frozen: the next one scans only what was made since, whoever made the rest."""
    import gc

    from verifier._child import settle_garbage

    kept = [[i] for i in range(300_000)]   # a candidate's objects, alive through the next batch
    try:
        settle_garbage()
        assert gc.get_freeze_count() >= len(kept)
        assert len(gc.get_objects()) < 50_000   # what the next collection scans: none of the kept ones
    finally:
        gc.unfreeze()
    assert len(kept) == 300_000
