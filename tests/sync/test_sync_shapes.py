"""Weight sync of checkpoints shaped like nobody tuned for, and check_sync's answers to bad input.

One 2-rank run goes through several shapes (MQA at TP=2, head_dim != hidden / heads, vocabularies
that are not multiples of 128, tied and untied embeddings, an FFN size that only just divides by TP, a
bf16 checkpoint, TP=1 x PP=2), each with `check_sync`'s own rank code against an in-process embedded
engine that starts from a different random init, so every weight has to arrive through the sync.
Bad input must be refused before any engine or rank starts, naming the problem, without a traceback.
"""
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from safetensors import safe_open

from megatron_rl.check_sync import main as check_sync_main
from tests.bridge.tiny_qwen3 import tiny_config, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (name, tiny_config kwargs, checkpoint dtype, tp, pp); every case runs on the same 2 ranks
SHAPES = [
    ("mqa_headdim_tp2", dict(hidden=48, heads=4, kv_heads=1, head_dim=16, vocab=250, ffn=96), torch.float32, 2, 1),
    ("mha_tied_v100_ffn102_bf16_tp2", dict(heads=4, kv_heads=4, vocab=100, tied=True, ffn=102), torch.bfloat16, 2, 1),
    ("tied_v250_pp2", dict(tied=True, vocab=250, layers=2, ffn=102), torch.float32, 1, 2),
]


def _save(path, dtype=torch.float32, seed=0, **shape):
    cfg = tiny_config(**shape)
    cfg.max_position_embeddings = 128
    tiny_model(cfg, seed=seed, dtype=dtype).save_pretrained(path)
    return str(path)


def _ranks(cases, workdir):
    """Each rank: for every case, check_sync's own rank code; rank 0 serves the engine in-process."""
    import torch.distributed as dist

    from megatron_rl.check_sync import CheckArgs, _rank_main
    from megatron_rl.rollout.embedded_engine import EmbeddedEngine, EmbeddedEngineConfig
    from megatron_rl.rollout.embedded_server import EmbeddedServer, load_model

    rank = int(os.environ["RANK"])
    for case in cases:
        server, url = None, ""
        if rank == 0:
            with open(os.path.join(case["hf_dir"], "config.json")) as f:
                hf = json.load(f)
            model, _ = load_model(None, hf_config=hf, device=torch.device("cpu"), dtype=getattr(torch, case["dtype"]),
                                  init_seed=1)  # not the actor's weights: the sync has to move all of them
            server = EmbeddedServer(EmbeddedEngine(model, EmbeddedEngineConfig(gather_ms=0, fp32_lm_head=True)))
            url = server.start_in_thread()
        try:
            _rank_main(CheckArgs(tp=case["tp"], pp=case["pp"], hf_dir=case["hf_dir"], engine_url=url,
                                 transport="colocated", dtype=case["dtype"], prompt=case["prompt"], max_new_tokens=16,
                                 seed=3, result_path=os.path.join(workdir, case["name"] + ".json")))
        finally:
            if server is not None:
                server.stop()
        if dist.is_initialized():
            dist.barrier()


@pytest.mark.slow
def test_sync_parity_over_shapes_tp2_and_pp2(tmp_path):
    from megatron_rl.parallel import spawn

    cases = []
    for name, shape, dtype, tp, pp in SHAPES:
        hf_dir = _save(tmp_path / name, dtype, **shape)
        with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
            n_tensors = len(list(f.keys()))
        vocab = shape["vocab"]
        cases.append(dict(name=name, hf_dir=hf_dir, tp=tp, pp=pp, n_tensors=n_tensors,
                          dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
                          prompt=[vocab - 1, 0, 7, vocab // 2, 1, vocab - 2]))  # the vocabulary's edges too
    spawn(_ranks, 2, cases, str(tmp_path))
    for case in cases:
        r = json.loads((tmp_path / (case["name"] + ".json")).read_text())
        tol = 5e-2 if case["dtype"] == "bfloat16" else 1e-3
        assert r["tokens"] == 16, case["name"]
        assert r["max_abs_logprob_diff"] <= tol, (case["name"], r["max_abs_logprob_diff"])
        assert r["weight_version"] == "1" and r["served_weight_version"] == 1, case["name"]
        # every tensor of the checkpoint (tied: no lm_head.weight) went through the sync, once
        assert r["sync"]["num_tensors"] == case["n_tensors"], (case["name"], r["sync"]["num_tensors"])


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("good") / "hf", heads=4, kv_heads=2, vocab=250)


def _bad_inputs(root, good):
    missing = str(root / "does-not-exist")
    no_config = root / "no-config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes(open(os.path.join(good, "model.safetensors"), "rb").read())
    llama = root / "llama"
    llama.mkdir()
    cfg = json.load(open(os.path.join(good, "config.json")))
    (llama / "config.json").write_text(json.dumps(dict(cfg, model_type="llama")))
    (llama / "model.safetensors").write_bytes((no_config / "model.safetensors").read_bytes())
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text(json.dumps(cfg))
    (corrupt / "model.safetensors").write_bytes((no_config / "model.safetensors").read_bytes()[:3000])
    return [
        (["--model", missing], "does not exist"),
        (["--model", str(no_config)], "config.json: missing"),
        (["--model", str(llama)], "model_type='llama' is not supported"),
        (["--model", str(corrupt)], "not a readable safetensors file"),
        (["--model", good, "--tp", "3"], "num_attention_heads=4 is not divisible by tp=3"),
        (["--model", good, "--pp", "3"], "num_hidden_layers=2 is not divisible by pp=3"),
        (["--model", good, "--max-new-tokens", "0"], "--max-new-tokens"),
        (["--model", good, "--max-new-tokens", "500"], "context length 128"),
    ]


def test_bad_input_is_refused_up_front_naming_the_problem(tmp_path, good_dir, capsys, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))   # where check_sync makes its work directory
    for argv, needle in _bad_inputs(tmp_path, good_dir):
        code = check_sync_main(argv + ["--json"])
        out, err = capsys.readouterr()
        result = json.loads(out.strip().splitlines()[-1])
        assert code == 2 and result["ok"] is False, argv
        assert needle in result["error"] and needle in err, (argv, result["error"])
        assert "Traceback" not in out + err, argv
    assert list(scratch.iterdir()) == []   # refused input leaves no work directory behind


def test_cli_error_exit_code_and_no_traceback(good_dir):
    """The command line itself (not just `main`): exit 2 and the message on stderr."""
    out = subprocess.run([sys.executable, "-m", "megatron_rl.check_sync", "--model", good_dir, "--tp", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "num_attention_heads=4 is not divisible by tp=3" in out.stderr and "Traceback" not in out.stderr


def test_a_failed_check_keeps_its_work_directory_and_names_it(tmp_path, monkeypatch, capsys):
    """A failure after the ranks started (here: the rank spawn raises, as a crashed rank does) keeps the work
    directory, with what was written there, and stderr names it."""
    import megatron_rl.parallel

    def crashed_ranks(*args, **kwargs):
        raise RuntimeError("rank 0 crashed")

    monkeypatch.setattr(megatron_rl.parallel, "spawn", crashed_ranks)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = check_sync_main(["--arch", "qwen3", "--engine-url", "http://127.0.0.1:9", "--json"])
    out, err = capsys.readouterr()
    assert code == 2 and "rank 0 crashed" in json.loads(out.strip().splitlines()[-1])["error"]
    kept = [p for p in tmp_path.glob("check-sync-*") if not p.name.startswith("check-sync-error-")]   # not the traceback
    assert len(kept) == 1 and (kept[0] / "tiny-qwen3" / "config.json").exists()
    assert f"kept its work directory (engine log, rank output): {kept[0]}" in err
