"""Probe 34b: telling a checked call from a timed one by the Python stack.

Fixed here (wrong before):
- A forward can measure its stack depth with no forbidden name: recurse until RecursionError and swallow it in a
  context manager's ``__exit__``. A trial's forward ran one frame shallower than a warm-up or timed call's, and the
  hidden trials are trials, so a candidate ran its kernel in every checked call and ``torch.relu`` in the timed ones
  (whose outputs the audits check by value only): a pass timed on ATen. Every model call now starts at the same
  depth (``_child.at_call_depth``).
- The trial's call counter was a ``sys.setprofile`` hook: a Python frame below the deepest call, so a watched forward
  reached one frame less (a trial told apart again), and the RecursionError raised inside the hook removed it. It is a
  ``sys.monitoring`` callback of one frame now (``_child._watch_calls``), which reads C attributes only.
- The ablation trial was always the call after the last correctness trial: a decoy that counted its calls ran its
  kernel for real up to there and then returned ``x.t().contiguous()`` beside a token native call (the hidden trials
  were not ablated; the audits check values only). Each hidden trial is now followed by an ablation trial
  (``evaluate._DeviceStage._hidden_trial``).

Tried and already right (not pinned end to end): the C stack (the address of a local in the candidate's C++) is the
same in trials, warm-up and timed calls; metaclasses (a ``__module__`` property run by the old hook) are refused.
"""
import sys

import pytest

from verifier._child import CALL_DEPTH, _watch_calls, at_call_depth, call_once
from verifier.evaluate import verify
from verifier.tasks import load_task
from verifier.types import Category

from .candidates import compiled, task_path

PROBE = '''
class Swallow:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, trace):
        return True


class Diver:
    def __init__(self):
        self.n = 0

    def dive(self):
        self.n += 1
        self.dive()


def room():
    d = Diver()
    with Swallow():
        d.dive()
    return d.n
'''


def _room():
    ns: dict = {}
    exec(PROBE, ns)   # noqa: S102 - the probe's own code, trusted
    return ns["room"]


def test_trials_and_timed_calls_leave_a_forward_the_same_stack():
    room = _room()

    class Timer:            # the shape of CapturedTimer.time_batch: the model called through one lambda
        def time_batch(self, calls):
            return [fn() for fn in calls]

    def shallow():
        return at_call_depth(lambda: call_once(lambda: room()))

    def deep(k=20):
        return deep(k - 1) if k else at_call_depth(lambda: Timer().time_batch([lambda: room()]))

    hits = [0]
    stop = _watch_calls({"builtins"}, hits)
    try:
        watched = [shallow(), shallow()]   # the hook survives a RecursionError raised at its depth
        len("counted")
    finally:
        stop()
    assert watched == [deep()[0], deep()[0]] == [shallow(), shallow()], watched
    assert hits[0] > 0 and sys.getrecursionlimit() - watched[0] > CALL_DEPTH


def test_the_call_hook_runs_no_candidate_code():
    ran = []

    class Loud:
        def __hash__(self):
            ran.append("hash")
            return 0

        def __eq__(self, other):
            ran.append("eq")
            return True

    class Box(list):
        __module__ = Loud()   # what type(obj).__module__ gives for an object of this class

    hits = [0]
    stop = _watch_calls({"ext"}, hits)
    try:
        Box().append(1)
    finally:
        stop()
    assert ran == [] and hits[0] == 0


DEPTH_PROBE = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = None

    def forward(self, x):
        r = room()
        if self.first is None:
            self.first = r          # the first call is a correctness trial
        if r != self.first:         # before the fix: warm-up and timed calls, where ATen ran unprofiled
            raise ValueError(f"told a timed call apart: {r} != {self.first}")
        return ext.relu(x)
'''


@pytest.mark.slow
def test_a_forward_cannot_tell_a_trial_from_a_timed_call_by_its_depth(make_cfg):
    r = verify(load_task(task_path("relu")), compiled(DEPTH_PROBE, prelude=PROBE), make_cfg())
    assert r.category == Category.PASS, (r.category, r.rule, r.feedback)


# its ablation trial is always the sixth call: a real kernel until then, allowed data movement beside a token native call
# after it (the hidden trials among the timed calls were not ablated, and the audits check values only)
COUNTING_DECOY = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls <= 6:
            return ext.transpose2d(x)
        _ = ext.transpose2d(x[:1, :1].contiguous())
        return x.t().contiguous()
'''


@pytest.mark.slow
def test_a_decoy_that_counts_its_calls_meets_an_ablation_among_the_timed_calls(make_cfg):
    r = verify(load_task(task_path("transpose")), compiled(COUNTING_DECOY), make_cfg())
    assert r.category == Category.CHEATING and r.rule == "decoy_kernel", (r.category, r.rule, r.feedback)
