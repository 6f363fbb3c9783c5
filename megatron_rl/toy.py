"""A task a tiny random model can learn on a CPU, run through the whole RL stack.

It exists to prove the loop learns end to end (Ray, the embedded engine over HTTP, the Megatron
actor, weight sync, GRPO) in minutes on two cores, which a kernel task cannot do with a random
model. `ToyEnvironment` is the second implementation of the rollout's environment interface
(`megatron_rl.rollout.environment`, ``data.environment: toy``): every response gets a declared toy
verdict (a pass, so nothing is ever fed back or buffered for repair), and it brings:

* tokenizer: characters (a-z, digits, a little punctuation) plus ChatML control tokens, so a model
  with a vocabulary of ~60 can be trained from scratch;
* score: the fraction of generated tokens that are in the target set (the first 5 letters), which a
  uniform random policy hits about 11% of the time and a trained one nearly always.
"""
from __future__ import annotations

import dataclasses
import string

from verifier.types import Category, VerifyResult

TARGET_CHARS = "abcde"
_CHARS = string.ascii_lowercase + string.digits + " .,:?!\n"
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
PROMPTS = ["say something.", "write a line.", "go on:", "tell me a story.", "what now?", "continue:",
           "pick letters.", "answer:"]


def build_tokenizer():
    """A character-level `PreTrainedTokenizerFast` with a ChatML template (built in memory, offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_SPECIALS + list(_CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", additional_special_tokens=_SPECIALS)
    fast.chat_template = CHATML
    return fast


@dataclasses.dataclass(frozen=True)
class ToyTask:
    task_id: str
    prompt: str
    level: int = 0
    op_family: str = "toy"

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompt}]


def toy_tasks() -> list[ToyTask]:
    return [ToyTask(task_id=f"toy_{i}", prompt=p) for i, p in enumerate(PROMPTS)]


class ToyEnvironment:
    """The toy task behind the environment interface: its own tokenizer, prompts, verdicts and score."""

    @classmethod
    def from_config(cls, cfg, *, use_gpu: bool = False) -> "ToyEnvironment":
        return cls()

    @staticmethod
    def config_problems(cfg) -> list[str]:
        return []

    @staticmethod
    def own_tokenizer():
        return build_tokenizer()

    def tasks(self) -> list[ToyTask]:
        return toy_tasks()

    def prompt(self, task: ToyTask) -> list[dict[str, str]]:
        return task.messages()

    async def verify(self, task: ToyTask, response: str) -> VerifyResult:
        return toy_verdict(task, response)

    def score(self, outcome) -> float:
        return target_fraction_reward(outcome)

    def feedback(self, verdict: VerifyResult) -> str:
        return ""

    def repair_prompt(self, task, entry) -> None:
        return None

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def target_token_ids(tokenizer) -> set[int]:
    return {tokenizer.convert_tokens_to_ids(c) for c in TARGET_CHARS}


def toy_verdict(task, response_text: str) -> VerifyResult:
    """The toy task has nothing to verify: every response is a legal answer (one turn, no feedback)."""
    return VerifyResult(task_id=task.task_id, category=Category.PASS, q=1.0, speedup=None, reward=None,
                        feedback="", backend="toy")


_TARGET_IDS: frozenset[int] | None = None


def target_fraction_reward(outcome) -> float:
    """Per-turn reward: fraction of generated tokens in the target set (0 for an empty answer)."""
    global _TARGET_IDS
    if _TARGET_IDS is None:
        _TARGET_IDS = frozenset(target_token_ids(build_tokenizer()))
    ids = outcome.response_ids or []
    if not ids:
        return 0.0
    return sum(1 for t in ids if t in _TARGET_IDS) / len(ids)
