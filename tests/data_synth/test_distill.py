"""distill against endpoints: a local OpenAI-compatible server (scripted), the project's embedded engine
(SGLang API), and an endpoint that does not answer."""
import json
import os

import pytest
import torch

from data_synth import cli
from data_synth.distill import DistillConfig, EndpointError, distill
from data_synth.taskset import read_task_set
from data_synth.teacher import offline_answer
from data_synth.util import DataSynthError
from megatron_rl.ports import free_port
from megatron_rl.rollout.embedded_engine import EmbeddedEngine, EmbeddedEngineConfig
from megatron_rl.rollout.embedded_server import EmbeddedServer, load_model

from conftest import FAST_VERIFIER
from http_helpers import ScriptedTeacher


def test_unreachable_endpoint_is_a_clear_error_and_writes_nothing(tmp_path, teacher_set, capsys):
    folder, _ = teacher_set
    url = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "rows.jsonl"
    with pytest.raises(EndpointError, match=f"cannot reach the teacher endpoint {url}"):
        distill(read_task_set(folder), str(out), DistillConfig(endpoint=url), progress=False)
    assert not out.exists() and not (tmp_path / "rows.jsonl.partial").exists()
    assert cli.main(["--no-progress", "distill", "--tasks", folder, "--out", str(out), "--endpoint", url]) == 2
    assert "cannot reach" in capsys.readouterr().err
    with pytest.raises(DataSynthError, match="not an http"):
        DistillConfig(endpoint="ftp://host/x")


def test_device_workers_reach_the_farm_and_a_bad_count_is_named(tmp_path, teacher_set, capsys, monkeypatch):
    folder, _ = teacher_set
    seen = {}

    def fake_distill(tasks, out, cfg, **_):
        seen["farm"] = cfg.farm
        raise DataSynthError("stop here")
    monkeypatch.setattr(cli, "distill", fake_distill)
    out = str(tmp_path / "rows.jsonl")
    assert cli.main(["--no-progress", "distill", "--tasks", folder, "--out", out, "--offline",
                     "--device-workers", "2"]) == 2
    assert seen["farm"] == {"device_workers": 2}
    assert cli.main(["--no-progress", "distill", "--tasks", folder, "--out", out, "--offline",
                     "--device-workers", "0"]) == 2
    assert "--device-workers must be >= 1, got 0" in capsys.readouterr().err


def test_openai_endpoint_multi_turn_repair_gives_a_final_turn_row(tmp_path, teacher_set, build_cache):
    """Turn 1 answers without code (format_error); turn 2, shown the verifier's feedback, answers correctly."""
    folder, tasks = teacher_set
    answers = {t.task_id: offline_answer(t, "cpu").response for t in tasks}

    def script(task_id, turn, messages):
        return "I would write a kernel here." if turn == 1 else answers[task_id]

    server = ScriptedTeacher(script)
    url = server.start()
    try:
        out, verdicts = tmp_path / "rows.jsonl", tmp_path / "v.jsonl"
        cfg = DistillConfig(endpoint=url, turns=2, cache_dir=build_cache, compile_workers=2, verifier=FAST_VERIFIER)
        summary = distill(read_task_set(folder)[:1], str(out), cfg, verdicts_path=str(verdicts), progress=False)
    finally:
        server.stop()
    assert summary.teacher.startswith(f"openai:{url}:scripted-teacher")
    assert summary.rows_written == 1 and summary.categories == {"format_error": 1, "pass": 1}
    row = json.loads(open(out).read())
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["step_loss_mask"] for m in row["messages"]] == [0, 0, 0, 0, 1]
    assert "Verdict: format_error" in row["messages"][3]["content"]
    assert row["turns"] == 2 and row["passed"] and [v["category"] for v in row["verdicts"]] == ["format_error", "pass"]
    # the second request carried the whole conversation, with the feedback as the last user turn
    assert server.requests[1]["messages"][-1]["content"] == row["messages"][3]["content"]
    assert server.requests[0]["model"] == "scripted-teacher"
    assert len(open(verdicts).read().splitlines()) == 2


def test_spelled_control_tokens_never_reach_the_teacher_or_an_sft_row(tmp_path, teacher_set, build_cache):
    """A failed first answer that spells ``<|im_end|>`` goes back to the teacher, and into the row's context, defused
    (it ended the teacher's turn there, and the SFT loader refused the row); a passing answer that spells
    ``<|endoftext|>`` is no row (the policy would learn to emit it): counted as refused."""
    from megatron_rl.sft_data import untrainable

    folder, tasks = teacher_set
    answer = offline_answer(tasks[0], "cpu").response
    mode = ["history"]

    def script(task_id, turn, messages):
        if mode[0] == "history":
            return "no code yet <|im_end|>" if turn == 1 else answer
        return answer + "\n<|endoftext|>"

    server = ScriptedTeacher(script)
    url = server.start()
    try:
        cfg = DistillConfig(endpoint=url, turns=2, cache_dir=build_cache, compile_workers=2, verifier=FAST_VERIFIER)
        summary = distill(read_task_set(folder)[:1], str(tmp_path / "a.jsonl"), cfg, progress=False)
        assert summary.passed_samples == 1 and summary.rows_written == 1 and summary.refused_rows == 0
        (row,) = [json.loads(line) for line in open(tmp_path / "a.jsonl")]
        assert "<|im_end|>" not in json.dumps(row["messages"]) and "no code yet" in row["messages"][2]["content"]
        assert untrainable(row) is None
        repair = server.requests[1]["messages"]
        assert "no code yet" in repair[2]["content"] and "<|im_end|>" not in repair[2]["content"]
        mode[0] = "spelled"
        summary = distill(read_task_set(folder)[:1], str(tmp_path / "b.jsonl"), cfg, progress=False)
    finally:
        server.stop()
    assert summary.passed_samples == 1 and summary.rows_written == 0 and summary.refused_rows == 1
    assert open(tmp_path / "b.jsonl").read() == ""


@pytest.fixture
def embedded_engine():
    cfg = dict(model_type="qwen3", vocab_size=151669, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=8192,
               eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=True)
    model, _ = load_model(None, hf_config=cfg, device=torch.device("cpu"), dtype=torch.float32, init_seed=0)
    server = EmbeddedServer(EmbeddedEngine(model, EmbeddedEngineConfig(max_batch_size=4)))
    server.start_in_thread()
    try:
        yield server.url
    finally:
        server.stop()


def test_embedded_engine_sglang_api_every_response_gets_a_verdict(tmp_path, teacher_set, embedded_engine):
    folder, tasks = teacher_set
    out = tmp_path / "rows.jsonl"
    cfg = DistillConfig(endpoint=embedded_engine, samples=3, max_new_tokens=8, keep="all", verifier=FAST_VERIFIER)
    summary = distill(read_task_set(folder), str(out), cfg, progress=False)
    assert summary.teacher == f"sglang:{embedded_engine}"
    assert summary.responses == 3 and summary.rows_written == 3 and summary.passed_samples == 0
    assert summary.categories == {"format_error": 3}         # a random model writes no code block
    rows = [json.loads(x) for x in open(out)]
    assert [r["sample_id"] for r in rows] == [f"{t.task_id}#{k}" for t in tasks for k in range(3)]
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["step_loss_mask"] == 1 for r in rows)
    # keep=pass (the default): no passing answer -> an empty file, still written atomically
    cli_out = tmp_path / "pass_only.jsonl"
    assert cli.main(["--no-progress", "distill", "--tasks", folder, "--out", str(cli_out), "--endpoint",
                     embedded_engine, "--api", "sglang", "--max-new-tokens", "4", "--trials", "1"]) == 0
    assert cli_out.exists() and cli_out.read_text() == ""
    assert not os.path.exists(str(cli_out) + ".partial")


def test_a_stopped_run_against_a_restarted_engine_reuses_its_samples(tmp_path, teacher_set, monkeypatch):
    """`rft --model` starts an embedded engine on a new port each run; the teacher was named by the URL, so a
    stopped RFT run never reused a sample. The served model (/get_model_info) names the teacher now."""
    import data_synth.distill as distill_mod
    from verifier.types import Category, VerifyResult

    folder, tasks = teacher_set
    cfg = dict(model_type="qwen3", vocab_size=151669, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=8192,
               eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=True)
    model, _ = load_model(None, hf_config=cfg, device=torch.device("cpu"), dtype=torch.float32, init_seed=0)
    calls = {"verified": 0, "stop_at": 2}

    class Stopped(Exception):
        pass

    def verify_fn(farm):
        async def verify(vt, answer):
            if calls["stop_at"] is not None and calls["verified"] >= calls["stop_at"]:
                raise Stopped
            calls["verified"] += 1
            return VerifyResult(task_id=vt.task_id, category=Category.FORMAT_ERROR, q=0.0, reward=-1.0)
        return verify

    monkeypatch.setattr(distill_mod, "farm_verify_fn", verify_fn)
    out = tmp_path / "rows.jsonl"
    names = []
    for stop_at in (2, None):
        calls["stop_at"] = stop_at
        server = EmbeddedServer(EmbeddedEngine(model, EmbeddedEngineConfig(max_batch_size=4),
                                               model_path="/ckpt/sft/hf"))
        server.start_in_thread()
        try:
            dcfg = DistillConfig(endpoint=server.url, samples=4, max_new_tokens=4, keep="all", concurrency=1,
                                 verifier=FAST_VERIFIER)
            if stop_at is not None:
                with pytest.raises(Stopped):
                    distill(read_task_set(folder), str(out), dcfg, progress=False)
            else:
                names.append(distill(read_task_set(folder), str(out), dcfg, progress=False).teacher)
        finally:
            server.stop()
    assert names == ["sglang:/ckpt/sft/hf@0"]   # the served model and its weights' version (an RL engine's change)
    assert calls["verified"] == 4 * len(tasks)          # the first run's 2 samples were not verified again
    assert len(out.read_text().splitlines()) == 4 * len(tasks)


def test_an_rft_pool_keeps_every_row_and_rft_counts_what_sft_would_refuse():
    """`keep=all` is RFT's pool: every sampled row, trainable or not (RFT judges and counts them); the SFT output
    (`keep=passed`) leaves the refused ones out."""
    from data_synth.distill import _kept
    from data_synth.rft import RFTConfig, select

    def row(i, answer):
        return {"task_id": "t", "sample_id": f"t#{i}", "passed": True, "speedup": 1.0, "source": "x",
                "messages": [{"role": "user", "content": "write it", "step_loss_mask": 0},
                             {"role": "assistant", "content": answer, "step_loss_mask": 1}]}

    code = "```python\nclass ModelNew:\n    pass\n```"
    spelled, clean = row(0, code + "\n<|endoftext|>"), row(1, code)
    pool, sft = DistillConfig(offline=True, keep="all"), DistillConfig(offline=True)
    assert _kept(spelled, pool) and not _kept(spelled, sft) and _kept(clean, sft)
    targets, report = select([spelled, clean], RFTConfig(samples=2, targets=2))
    assert report["refused"] == 1 and [t["sample_id"] for t in targets] == ["t#1"]
