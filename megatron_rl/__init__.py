"""RL trainer for kernel-writing LLMs: Megatron actor, rollout engines, algorithms, Ray driver."""
