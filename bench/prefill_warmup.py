"""Where a hybrid engine's slow prefills come from, and whether the warm-up removes them.

    python bench/prefill_warmup.py [--shape 9b_hybrid] [--layers 8] [--new-tokens 64] [--out FILE]

One random bf16 model of the given shape (cut to ``--layers``) serves in-process through the embedded engine.
Waves of 16 seeded requests (4 prompt lengths x 4, as an RL step's 4 prompts x 4 samples) run with the engine's
memory released and resumed between them, as the synchronous colocated RL step does. The first waves run
after the warm-up request only; then the warm-up's prefill shapes (``EmbeddedEngine._warm_prefill_buckets``,
``prefill_warm_shapes``) run; then more waves, including widths no earlier wave met. Per wave: the engine's
prefill seconds and the wall time. With ``TRITON_PRINT_AUTOTUNING=1`` the log shows each of fla's autotuning
runs with its key next to the wave that paid for it.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import emit_json  # noqa: E402
from bench.sync_8b import hf_config_dict  # noqa: E402

#: each wave's prompt lengths (x4): the largest sets the padded width of its prefill chunk
WAVES_BEFORE = [("A", [520, 560, 600, 640]), ("A", [520, 560, 600, 640]), ("B", [520, 560, 600, 900]),
                ("C", [530, 570, 610, 910]), ("A", [520, 560, 600, 640])]
WAVES_AFTER = [("D", [530, 570, 610, 1100]), ("E", [530, 570, 610, 1150]), ("D", [530, 570, 610, 1100]),
               ("B", [520, 560, 600, 900])]


def main() -> int:
    import torch

    from megatron_rl.rollout.embedded_engine import EmbeddedEngine, EmbeddedEngineConfig
    from megatron_rl.rollout.embedded_server import load_model
    from megatron_rl.rollout.sampling import RequestSampling

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="9b_hybrid")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    cfg = hf_config_dict(args.shape)
    cfg["num_hidden_layers"] = args.layers
    cfg.pop("layer_types", None)   # transformers derives them for the cut model (every 4th layer attention)
    model, _ = load_model(None, hf_config=cfg, device=torch.device(args.device), dtype=torch.bfloat16, init_seed=0)
    engine = EmbeddedEngine(model, EmbeddedEngineConfig(max_batch_size=32, gather_ms=5, decode="slots"))
    warm_shapes = engine._warm_prefill_buckets
    engine._warm_prefill_buckets = lambda: []   # the request-only warm-up first; the shapes run between waves
    engine.start()
    t = time.perf_counter()
    engine.warm_up()
    result = {"bench": "prefill_warmup", "shape": args.shape, "layers": args.layers, "device": args.device,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "warm_up_request_s": round(time.perf_counter() - t, 2), "waves": []}
    gen = torch.Generator().manual_seed(0)

    def wave(tag: str, lengths: list[int], phase: str) -> None:
        events = []
        before = dict(engine.decode_info()["engine_stats"])
        t0 = time.perf_counter()
        for i, n in enumerate(lengths * 4):
            ev = threading.Event()
            events.append(ev)
            prompt = torch.randint(10, engine.vocab_size, (n,), generator=gen).tolist()
            sampling = RequestSampling(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0,
                                       max_new_tokens=args.new_tokens, stop_token_ids=frozenset(), stop_strings=(),
                                       ignore_eos=True, seed=i)
            engine.submit(engine.new_request(prompt, sampling, return_logprob=True, on_done=lambda o, ev=ev: ev.set()))
        for ev in events:
            if not ev.wait(600):
                raise RuntimeError(f"wave {tag} did not finish in 600 s")
        after = engine.decode_info()["engine_stats"]
        row = {"wave": tag, "phase": phase, "longest_prompt": max(lengths), "wall_s": round(time.perf_counter() - t0, 3),
               "prefill_s": round(after["prefill_s"] - before["prefill_s"], 3),
               "prefills": after["prefills"] - before["prefills"]}
        result["waves"].append(row)
        print(f"[prefill_warmup] {row}", flush=True)
        engine.release_memory(["kv_cache"])
        engine.resume_memory(["kv_cache"])

    for tag, lengths in WAVES_BEFORE:
        wave(tag, lengths, "request-only warm-up")
    t = time.perf_counter()
    result["warm_shapes"] = warm_shapes()   # none on a CPU, where fla's kernels are not used
    result["warm_shapes_s"] = round(time.perf_counter() - t, 2)
    for tag, lengths in WAVES_AFTER:
        wave(tag, lengths, "after the prefill shapes")
    engine.shutdown()
    result["command"] = " ".join(["bench/prefill_warmup.py"] + sys.argv[1:])
    emit_json(result, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
