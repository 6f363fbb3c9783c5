"""The colocated actor's offload: pinned host copies that round-trip bitwise and are reused, and the auto rule
that keeps the actor on the GPU when the engines' cache for a step fits beside it."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_rl import plan as P
from megatron_rl.actor.optim import HostStash
from megatron_rl.cluster import rollout_cache_need
from megatron_rl.config import REPO_ROOT, load_config


def test_host_stash_round_trips_bitwise_and_reuses_its_buffers():
    stash = HostStash()
    t = torch.randn(1000, dtype=torch.float32)
    h = stash.put(("p", "exp_avg"), t)
    assert torch.equal(h, t) and h.data_ptr() != t.data_ptr()
    back = stash.take(h, torch.device("cpu"))
    assert torch.equal(back, t) and back.data_ptr() != h.data_ptr()
    t2 = torch.randn(1000)
    assert stash.put(("p", "exp_avg"), t2).data_ptr() == h.data_ptr()     # refilled in place
    assert torch.equal(h, t2)
    other = stash.put(("p", "exp_avg"), torch.zeros(3, dtype=torch.bfloat16))   # a new shape: a new buffer
    assert other.dtype == torch.bfloat16 and other.shape == (3,)


def test_rollout_cache_bytes_counts_kv_per_token_and_the_gdn_state_per_request():
    dense = P.known_shape("qwen3-8b")
    per_token = 2 * 36 * 8 * 128 * 2
    assert P.rollout_cache_bytes(dense, 16, 1000) == 16 * 1000 * per_token
    assert P.rollout_cache_bytes(dense, 16, 1000, dtype_bytes=4) == 2 * 16 * 1000 * per_token
    hybrid = P.known_shape("qwen3.5-9b")
    assert P.rollout_cache_bytes(hybrid, 2, 0) == 2 * hybrid.gdn_state_bytes() > 0


def _cfg(tmp_path, hf: dict, overrides: list[str]):
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return load_config(str(REPO_ROOT / "configs" / "quickstart.yaml"), overrides)


def test_cache_need_follows_the_step_the_context_and_the_engine_share(tmp_path):
    hf = {**P.KNOWN_SHAPES["qwen3-8b"], "max_position_embeddings": 40960}
    base = ["data.prompts_per_step=4", "agent.group_size=4", "agent.max_concurrency=64", "agent.max_turns=1",
            "agent.sampling.max_new_tokens=256", "agent.max_prompt_tokens=8192", "rollout.engine_dtype=bfloat16"]
    per_token = P.known_shape("qwen3-8b").kv_bytes_per_token()
    need = rollout_cache_need(_cfg(tmp_path, hf, base), str(tmp_path))
    assert need == pytest.approx(16 * (8192 + 256) * per_token / 0.6, rel=1e-9)
    # two engines split the requests; a larger cache share needs less free memory
    two = rollout_cache_need(_cfg(tmp_path, hf, base + ["rollout.num_engines=2",
                                                        "rollout.sglang.kv_cache_fraction=0.9"]), str(tmp_path))
    assert two == pytest.approx(8 * (8192 + 256) * per_token / 0.9, rel=1e-9)
    # the model's context bounds a turn; the engine's max running requests bound the batch
    long = ["agent.sampling.max_new_tokens=100000", "agent.max_concurrency=100", "data.prompts_per_step=64"]
    cfg = _cfg(tmp_path, hf, base + long)
    bound = min(cfg.agent.max_context_tokens, 40960)    # the agent's bound (the config resolves it) or the model's
    assert rollout_cache_need(cfg, str(tmp_path)) == pytest.approx(32 * bound * per_token / 0.6, rel=1e-9)
    need = rollout_cache_need(_cfg(tmp_path, hf, base + long + ["agent.max_context_tokens=12000"]), str(tmp_path))
    assert need == pytest.approx(32 * 12000 * per_token / 0.6, rel=1e-9)


def test_engine_metrics_are_one_rollouts_differences_summed_over_engines():
    from megatron_rl.cluster.rollout_manager import _engine_metrics

    before = [{"prefill_s": 1.0, "prefill_tokens": 100, "decode_s": 2.0, "decode_steps": 10, "decode_rows": 40,
               "decode_rows_discarded": 3},
              {"prefill_s": 0.0, "prefill_tokens": 0, "decode_s": 0.0, "decode_steps": 0, "decode_rows": 0,
               "decode_rows_discarded": 0}]
    after = [{"prefill_s": 1.5, "prefill_tokens": 300, "decode_s": 3.0, "decode_steps": 20, "decode_rows": 80,
              "decode_rows_discarded": 7},
             {"prefill_s": 0.5, "prefill_tokens": 50, "decode_s": 1.0, "decode_steps": 10, "decode_rows": 20,
              "decode_rows_discarded": 2}]
    m = _engine_metrics(before, after)
    assert m["engine/decode_rows_discarded"] == 6
    assert m["engine/prefill_s"] == pytest.approx(1.0) and m["engine/prefill_tokens"] == 250
    assert m["engine/decode_steps"] == 20 and m["engine/mean_batch"] == pytest.approx(3.0)
    assert m["engine/decode_ms_per_step"] == pytest.approx(100.0)
    assert _engine_metrics([], []) == {} and _engine_metrics(before, after[:1]) == {}   # SGLang / a lost engine


def test_cache_need_reads_null_and_aliased_engine_settings_and_counts_oversampled_groups(tmp_path):
    hf = {**P.KNOWN_SHAPES["qwen3-8b"], "max_position_embeddings": 40960}
    base = ["data.prompts_per_step=4", "agent.group_size=4", "agent.max_concurrency=64", "agent.max_turns=1",
            "agent.sampling.max_new_tokens=256", "agent.max_prompt_tokens=8192", "rollout.engine_dtype=bfloat16"]
    per_seq = (8192 + 256) * P.known_shape("qwen3-8b").kv_bytes_per_token()
    # null passthrough values are the engine's defaults (args_to_flags drops them), not a crash
    nulls = base + ["rollout.sglang.max_running_requests=null", "rollout.sglang.kv_cache_fraction=null"]
    assert rollout_cache_need(_cfg(tmp_path, hf, nulls), str(tmp_path)) == pytest.approx(16 * per_seq / 0.6)
    # the embedded server's own name for the batch bound
    alias = base + ["rollout.sglang.max-batch-size=8"]
    assert rollout_cache_need(_cfg(tmp_path, hf, alias), str(tmp_path)) == pytest.approx(8 * per_seq / 0.6)
    # dynamic sampling keeps over-drawn groups in flight
    dyn = base + ["agent.dynamic_sampling=true", "agent.max_oversample_rounds=1"]
    assert rollout_cache_need(_cfg(tmp_path, hf, dyn), str(tmp_path)) == pytest.approx(32 * per_seq / 0.6)


class _Train:
    def __init__(self, free: list[int], train_extra: list[int] | None = None):
        self.free, self.train_extra = free, train_extra

    def min_free_device_bytes(self) -> int:
        return self.free.pop(0)

    def max_train_extra_bytes(self) -> int:
        return self.train_extra.pop(0) if self.train_extra else 0


def _cluster(tmp_path, overrides, free):
    from megatron_rl.cluster import Cluster

    (tmp_path / "config.json").write_text(json.dumps({**P.KNOWN_SHAPES["qwen3-8b"], "max_position_embeddings": 4096}))
    c = object.__new__(Cluster)   # only the fields offload_actor reads: no engines, no actor
    c.cfg = load_config(str(REPO_ROOT / "configs" / "quickstart.yaml"),
                        ["kernel_backend=cuda", "agent.max_turns=1", "agent.sampling.max_new_tokens=256",
                         "agent.max_prompt_tokens=1024", "rollout.engine_dtype=bfloat16", *overrides])
    c.use_gpu, c.model_dir, c.train = True, str(tmp_path), _Train(free)
    c._offload, c._offload_need = None, None
    return c


def test_the_auto_rule_decides_before_every_rollout_with_the_farms_share(tmp_path):
    from megatron_rl.cluster import farm_device_reserve, rollout_cache_need

    c = _cluster(tmp_path, [], [])
    need = rollout_cache_need(c.cfg, c.model_dir) + farm_device_reserve(c.cfg)
    assert farm_device_reserve(c.cfg) == 3 * (8 << 30)
    c.train.free = [need + 1, need - 1, need + 1]
    assert [c.offload_actor() for _ in range(3)] == [False, True, False]   # the actor grew after step 1, then not
    assert _cluster(tmp_path, ["cluster.offload_actor=true"], []).offload_actor() is True
    assert _cluster(tmp_path, ["cluster.offload_actor=false"], []).offload_actor() is False
    assert _cluster(tmp_path, ["rollout.engine=sglang"], []).offload_actor() is True
    cpu = _cluster(tmp_path, [], [])
    cpu.use_gpu = False
    assert cpu.offload_actor() is False


def test_a_train_step_that_needs_more_than_the_room_left_offloads_the_next_rollout(tmp_path):
    """The rollout's need alone kept a 20-layer 8B slice resident, and its second train step ran out of memory
    beside the engines' weights: the last train step's own need counts too."""
    from megatron_rl.cluster import farm_device_reserve, rollout_cache_need

    c = _cluster(tmp_path, [], [])
    need = rollout_cache_need(c.cfg, c.model_dir) + farm_device_reserve(c.cfg)
    c.train.free = [need + 1, need + 1, need + 1, 2 * need]
    c.train.train_extra = [0, need // 2, need + 2, need + 2]   # before step 1, then three train steps
    assert [c.offload_actor() for _ in range(4)] == [False, False, True, False]


def test_an_estimate_that_cannot_be_made_offloads_instead_of_stopping_the_run(tmp_path):
    c = _cluster(tmp_path, [], [0])
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))   # no layer count: no shape
    assert c.offload_actor() is True and c.train.free == [0]   # nothing measured


def test_engine_metrics_leave_out_an_engine_that_did_not_answer_or_restarted():
    from megatron_rl.cluster.rollout_manager import _engine_metrics

    ok_b = {"prefill_s": 1.0, "prefill_tokens": 10, "decode_s": 1.0, "decode_steps": 10, "decode_rows": 10}
    ok_a = {"prefill_s": 2.0, "prefill_tokens": 20, "decode_s": 2.0, "decode_steps": 20, "decode_rows": 30}
    restarted = {"prefill_s": 0.1, "prefill_tokens": 1, "decode_s": 0.1, "decode_steps": 1, "decode_rows": 1}
    m = _engine_metrics([ok_b, {}, ok_b], [ok_a, ok_a, restarted])
    assert m["engine/decode_steps"] == 10 and m["engine/mean_batch"] == pytest.approx(2.0)


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _StubRollout:
    """The rollout manager's two calls the residency rule makes (what `resolve` passes through locally)."""
    def __init__(self):
        self.resumed = []
        self.resume_memory = _Remote(lambda tags: self.resumed.append(tuple(tags)))


class _StubTrain:
    def __init__(self, free):
        self.free = free

    def min_free_device_bytes(self):
        return self.free

    def max_train_extra_bytes(self):
        return 0


def _async_cluster(tmp_path, free: int, need: int, offload_actor=None, engine="embedded"):
    """A colocated async Cluster on a 'GPU' without starting anything: the roles are stubs."""
    from megatron_rl.cluster import Cluster

    cfg = _cfg(tmp_path, P.KNOWN_SHAPES["qwen3-8b"], ["cluster.async_rollout=true", f"rollout.engine={engine}"])
    cfg.cluster.offload_actor = offload_actor
    c = Cluster.__new__(Cluster)
    c.cfg, c.colocated, c.use_gpu, c.model_dir = cfg, True, True, str(tmp_path)
    c._offload, c._offload_need, c._engines_resident = None, need, False
    c.rollout_mgr, c.train = _StubRollout(), _StubTrain(free)
    return c


def test_colocated_async_keeps_the_engines_resident_only_when_they_fit_beside_the_actor(tmp_path):
    fits = _async_cluster(tmp_path, free=40 << 30, need=30 << 30)
    fits._keep_engines_resident()
    assert fits._engines_resident and fits.rollout_mgr.resumed == [("kv_cache",)]

    tight = _async_cluster(tmp_path, free=20 << 30, need=30 << 30)
    with pytest.raises(RuntimeError, match=r"need 30\.0 GiB beside it and 20\.0 GiB are free"):
        tight._keep_engines_resident()
    assert tight.rollout_mgr.resumed == []         # nothing resumed for a run that cannot go on

    # SGLang's static share cannot be measured: the user sizes it and says so with offload_actor=false
    sglang = _async_cluster(tmp_path, free=1 << 30, need=30 << 30, engine="sglang")
    with pytest.raises(RuntimeError, match="mem_fraction_static"):
        sglang._keep_engines_resident()
    trusted = _async_cluster(tmp_path, free=1 << 30, need=30 << 30, offload_actor=False, engine="sglang")
    trusted._keep_engines_resident()
    assert trusted.rollout_mgr.resumed == [("kv_cache",)]


class _RecordingRollout:
    """The rollout manager's calls around a synchronous rollout, recorded in order."""
    def __init__(self):
        self.calls = []
        self.resume_memory = _Remote(lambda tags: self.calls.append(("resume", tuple(tags))))
        self.release_memory = _Remote(lambda tags: self.calls.append(("release", tuple(tags))))
        self.generate = _Remote(lambda step: self.calls.append(("generate", step)) or f"rollout {step}")


class _OffloadingTrain(_StubTrain):
    def __init__(self, free):
        super().__init__(free)
        self.moves = []

    def offload(self):
        self.moves.append("offload")

    def onload(self):
        self.moves.append("onload")


@pytest.mark.parametrize("room", ["fits", "tight"])
def test_a_synchronous_colocated_rollout_moves_the_engines_weights_only_with_the_actor(tmp_path, room):
    """Moving an engine's weights to the host and back took ~5 s a step on the H200; when the actor stays resident,
    the engines' weights do too and only their cache is released for training."""
    from megatron_rl.cluster import Cluster
    from megatron_rl.observability import PhaseTimer

    cfg = _cfg(tmp_path, P.KNOWN_SHAPES["qwen3-8b"], [])
    c = Cluster.__new__(Cluster)
    c.cfg, c.colocated, c.use_gpu, c.model_dir = cfg, True, True, str(tmp_path)
    c._offload, c._offload_need = None, 30 << 30
    c.rollout_mgr = _RecordingRollout()
    c.train = _OffloadingTrain((40 if room == "fits" else 20) << 30)
    timer = PhaseTimer()
    assert c._rollout_synchronously(3, timer) == "rollout 3"
    released = ("kv_cache",) if room == "fits" else ("kv_cache", "weights")
    assert c.rollout_mgr.calls == [("resume", ("kv_cache",)), ("generate", 3), ("release", released)]
    assert c.train.moves == ([] if room == "fits" else ["offload", "onload"])
