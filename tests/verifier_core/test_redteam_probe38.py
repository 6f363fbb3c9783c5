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

- The inputs' addresses (found here, fixed in session 39). A timed batch's inputs were made together before it, at a
  fixed stride, so "this input lies one stride past the previous one" held for the timed calls after the first and for
  no trial: a candidate ran ``torch.relu`` there and its kernel everywhere else, and passed. (A review then found that
  "at an address a timed call had" told them apart too.) Each input set is now made after a gap of random size, and
  each hidden trial (and its ablation trial) is one call, at a secret position, of the candidate's batch in a round
  made and run as a timed trial is (``DeviceSession.trial`` with ``prepared``); the allocator's statistics are out of
  a forward's reach.
"""
import pytest

from verifier.evaluate import verify
from verifier.tasks import load_task
from verifier.types import Category

from .candidates import RELU, compiled, task_path

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


# "in a timed batch", made loud: four calls in a row whose inputs lie one stride apart (the fourth timed call of a batch
# before the fix, where a candidate ran torch.relu and passed level1/7_ReLU, or returned allowed data movement beside a
# token native call on a transpose)
POINTER_PROBE = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.prev = 0
        self.deltas = [0, 0, 0]

    def forward(self, x):
        p = x.data_ptr()
        d = p - self.prev
        self.prev = p
        self.deltas = self.deltas[1:] + [d]
        if d != 0 and len(set(self.deltas)) == 1:
            raise ValueError("inputs at one stride: a timed batch")
        return ext.relu(x)
'''


@pytest.mark.slow
def test_a_batchs_inputs_lie_at_no_stride(make_cfg):
    """A trial's input sets are made in a random order, each after a gap of random size (``_child.SPACER_BYTES``), so
    "one stride past the last input" marks no call (it fired in the first timed batch before)."""
    r = verify(load_task(task_path("relu")), compiled(POINTER_PROBE), make_cfg())
    assert r.category == Category.PASS, (r.category, r.rule, r.feedback)


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


@pytest.mark.parametrize("call", ["torch.cuda.memory_allocated()", "torch.cuda.memory.memory_stats()",
                                  "torch.accelerator.memory_reserved()", "torch.cuda.mem_get_info()[0]"])
def test_the_allocators_statistics_are_out_of_a_forwards_reach(call):
    """A hidden trial's batch is made while the timed trial's inputs and outputs are still alive, so the memory in
    use tells it from a timed batch: reading the allocator's statistics is refused at the static stage."""
    from verifier.config import VerifierConfig
    from verifier.static_checks import check_candidate
    code = ("import torch\nimport torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n"
            f"        used = {call}\n        return x\n")
    assert "profiler_probe" in {f.rule for f in check_candidate(code, VerifierConfig())}
    honest = code.replace(f"used = {call}", "torch.cuda.empty_cache()")
    assert not check_candidate(honest, VerifierConfig())


# torch where the input lies where the previous call's lay (a timed call of one call per batch: ``prepare`` frees the
# last trial's inputs first), the kernel in the calls before timing (CALLS_BEFORE_TIMING)
SAME_ADDRESS_TELL = '''
_seen = {"n": 0, "prev": 0}


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        _seen["n"] += 1
        p = x.data_ptr()
        told = _seen["n"] > CALLS_BEFORE_TIMING and p == _seen["prev"]
        _seen["prev"] = p
        if told:
            return torch.relu(x)
        return ext.relu(x)
'''


@pytest.mark.slow
def test_one_call_per_batch_hidden_trials_are_rounds_too(make_cfg):
    """Review of the fix: with one call per timed batch (slow or large tasks, or once outputs were shared) hidden
    trials were still calls of their own, made while the timed trial's inputs were alive, so never at the address of
    the call before; a forward that ran torch where its input lay where the last one had passed. They are rounds now."""
    # where the tell fires depends on the allocator (a quarter to a half of the timed calls here): with every trial
    # audited, a round that fires it comes with near certainty (each round fires it as often as a timed trial does)
    cfg = make_cfg(max_timing_reps=1, num_timing_trials=20, num_timing_audits=20, time_budget_s=60.0)
    before = cfg.num_correct_trials + 1 + cfg.num_warmup   # correctness trials, the ablation trial, the warm-up
    code = SAME_ADDRESS_TELL.replace("CALLS_BEFORE_TIMING", str(before))
    r = verify(load_task(task_path("relu")), compiled(code), cfg)
    assert r.category == Category.CHEATING and r.rule == "forbidden_op", (r.category, r.rule, r.feedback)


def _record_requests(monkeypatch) -> list:
    """The parent's requests to the child during a real check, in order."""
    from verifier.evaluate import _DeviceStage
    sent, ask = [], _DeviceStage._ask

    def recording(self, msg, expect):
        sent.append(dict(msg))
        return ask(self, msg, expect)
    monkeypatch.setattr(_DeviceStage, "_ask", recording)
    return sent


@pytest.mark.slow
def test_a_hidden_trial_and_its_ablation_trial_share_one_round(make_cfg, monkeypatch):
    """A round of its own for the ablation trial, always the round after the hidden trial's, cost a second round per
    audited trial and was a round a candidate that recognised rounds could expect to be ablated. Where the batch has
    two calls or more, both are judged calls of one round's batch, the ablation call at a secret position after the
    hidden one's (a round of its own where the hidden call is the batch's last); the ablation call's report is asked
    for afterwards (``stashed``) without another round. The verdicts stay: honest passes, a decoy
    that counts its calls is still caught among the timed calls (probe 34b)."""
    sent = _record_requests(monkeypatch)
    r = verify(load_task(task_path("relu")), compiled(RELU), make_cfg(num_timing_audits=2))
    assert r.category == Category.PASS, (r.category, r.rule, r.feedback)
    assert r.details["ablation"]["conclusive"] is True
    timed_from = next(i for i, m in enumerate(sent) if m["op"] == "warmup")
    rounds = [i for i, m in enumerate(sent) if m["op"] == "trial" and m.get("prepared") and not m.get("ablate")]
    assert 2 <= len(rounds) <= 3   # the audited trials (two random ones and the last, which may coincide)
    for i in rounds:
        m = sent[i]
        prep = max(j for j in range(timed_from, i) if sent[j]["op"] == "prepare")
        cand = sent[prep]["seeds"]["cand"]
        assert len(cand) >= 2 and cand[m["at"]] == m["seed"]
        if "also" not in m:   # the hidden call was the batch's last: the ablation trial is a round of its own
            assert m["at"] == len(cand) - 1
            assert next(x for x in sent[i + 1:] if x["op"] == "trial").get("ablate") is True
            continue
        also = m["also"]
        assert also["ablate"] is True and "ablate" not in m
        assert also["at"] > m["at"] and cand[also["at"]] == also["seed"]   # after it: an ablation seen warns nothing
        assert all(sent[j]["op"] in ("call", "collect") for j in range(prep + 1, i))   # runners drawn before it
        stashed = next(sent[j] for j in range(i + 1, len(sent)) if sent[j]["op"] == "trial")
        assert stashed.get("stashed") is True and stashed["seed"] == also["seed"] and "prepared" not in stashed
        between = [sent[j]["op"] for j in range(i + 1, sent.index(stashed, i + 1))]
        assert "prepare" not in between and "call" not in between   # no round of its own
    # with one call per batch there is no second position: two rounds, as before
    sent.clear()
    r = verify(load_task(task_path("relu")), compiled(RELU), make_cfg(num_timing_audits=2, max_timing_reps=1))
    assert r.category == Category.PASS, (r.category, r.rule, r.feedback)
    rounds = [m for m in sent if m["op"] == "trial" and m.get("prepared")]
    assert rounds and all("also" not in m for m in rounds)
    assert sum(bool(m.get("ablate")) for m in rounds) == len(rounds) // 2 and not any(m.get("stashed") for m in sent)


# torch in every timed call until the candidate sees an ablation (a native call's write into a scratch tensor of its own,
# which the ablation overwrites and nothing restores), then its kernel for good; the kernel before timing
ABLATION_WARNS = '''
_S = {"n": 0, "honest": False}
_SCRATCH = torch.zeros(1)
_ZERO = torch.zeros(1)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        _S["n"] += 1
        n = _S["n"]
        ext.add_out(torch.empty(1).fill_(float(n)), _ZERO, _SCRATCH)
        if n > CALLS_BEFORE_TIMING and _SCRATCH[0].item() != float(n):
            _S["honest"] = True   # ablated: a judged call may follow
        if n > CALLS_BEFORE_TIMING and not _S["honest"]:
            return torch.relu(x)
        return ext.relu(x)
'''


@pytest.mark.slow
def test_an_ablation_call_never_comes_before_its_rounds_hidden_call(make_cfg):
    """Review of the shared round: with the two judged calls at any two positions, the ablation call came first in half
    the rounds, and a candidate that recognised it (its own scratch overwritten) behaved for the hidden call after it:
    a pass in about half the checks. The ablation call now always follows the hidden one, and the batch ends with it,
    so the first hidden call always meets the torch path."""
    cfg = make_cfg()
    code = ABLATION_WARNS.replace("CALLS_BEFORE_TIMING", str(cfg.num_correct_trials + 1 + cfg.num_warmup))
    for _ in range(3):
        r = verify(load_task(task_path("relu")), compiled(code), cfg)
        assert r.category == Category.CHEATING and r.rule == "forbidden_op", (r.category, r.rule, r.feedback)


def test_reading_the_models_tensors_runs_no_torch_function_hook():
    """The ablation trial's walk of the model's tensors (``_model_tensors``) read storages through
    ``TensorBase.untyped_storage``, which runs a tensor subclass's ``__torch_function__``: since the walk runs right
    before the ablated call, such a hook would name that call (review of session 40). It runs with the hooks off now,
    and a tensor without a storage (sparse) is left out instead of failing the trial."""
    import types

    import torch

    from verifier._child import DeviceSession

    hooked = []

    class Spy(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types_, args=(), kwargs=None):
            hooked.append(getattr(func, "__name__", str(func)))
            return super().__torch_function__(func, types_, args, kwargs or {})

    model = torch.nn.Linear(2, 2)
    model.spy = torch.zeros(3).as_subclass(Spy)
    model.sparse = torch.zeros(3, 3).to_sparse()
    session = types.SimpleNamespace(torch=torch, _tb=torch._C.TensorBase, new_model=model,
                                    _no_torch_function=torch._C.DisableTorchFunctionSubclass)
    found = DeviceSession._model_tensors(session)
    assert hooked == []
    assert found == {t.untyped_storage().data_ptr() for t in (model.weight, model.bias)} | {
        torch._C.TensorBase.untyped_storage(model.spy).data_ptr()}
