"""The embedded engine serving the Qwen3.5 hybrid (Gated DeltaNet + gated attention): batched, left-padded,
cached decode gives the logprobs of a full forward pass; A_log/dt_bias stay fp32; weight updates accept
the multimodal checkpoint's names."""
import asyncio

import torch

from megatron_rl.rollout.protocol import SamplingParams
from rollout_helpers import reference_logprobs, run, start_server

HYBRID = dict(model_type="qwen3_5_text", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, max_position_embeddings=512,
              initializer_range=0.3, eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
PROMPTS = [[5, 17, 3], [9], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42, 42]]


def _model(dtype=torch.float32):
    from megatron_rl.rollout.embedded_server import load_model

    model, _ = load_model(None, hf_config=HYBRID, device=torch.device("cpu"), dtype=dtype, init_seed=0)
    return model


def test_hybrid_batched_decode_matches_full_forward():
    from megatron_rl.rollout.client import EngineClient

    model = _model()
    server = start_server(model, max_batch_size=8)
    client = EngineClient(server.url)
    try:
        async def go():
            return await asyncio.gather(*[  # different lengths: requests leave the batch at different steps
                client.generate(p, SamplingParams(temperature=1.0, max_new_tokens=4 + 3 * i, seed=7 + i))
                for i, p in enumerate(PROMPTS)])

        results = run(go(), client)
    finally:
        server.stop()
    for i, (p, r) in enumerate(zip(PROMPTS, results)):
        assert r.finish_reason == "length" and len(r.token_ids) == 4 + 3 * i
        ref = reference_logprobs(model, p, r.token_ids, 1.0)
        # decode runs GDN's token-by-token recurrence, the reference its chunked form: fp32 rounding of two
        # algorithms (7e-5 seen on the 12-token prompt, with no padding at all); a layout or padding bug is O(1)
        assert max(abs(a - b) for a, b in zip(ref, r.logprobs)) < 3e-4, (p, ref, r.logprobs)


def test_gdn_decay_params_stay_fp32_and_multimodal_names_are_accepted():
    from megatron_rl.rollout.embedded_engine import EmbeddedEngine, EmbeddedEngineConfig

    model = _model(torch.bfloat16)
    params = dict(model.named_parameters())
    assert params["model.layers.0.linear_attn.A_log"].dtype == torch.float32
    assert params["model.layers.0.linear_attn.dt_bias"].dtype == torch.float32
    assert params["model.layers.0.linear_attn.in_proj_qkv.weight"].dtype == torch.bfloat16
    engine = EmbeddedEngine(model, EmbeddedEngineConfig())
    a_log = torch.linspace(0.1, 2.7, 4, dtype=torch.float32) + 1e-4  # not representable in bf16
    engine.update_weights([("model.language_model.layers.0.linear_attn.A_log", a_log)], weight_version="v2")
    assert torch.equal(params["model.layers.0.linear_attn.A_log"], a_log) and engine.weight_version == "v2"
