"""Scripted stand-ins for the engine (and, in the unit tests, the verifier)."""
import asyncio
import dataclasses

from megatron_rl.rollout.protocol import GenerateResult
from verifier.types import Category, VerifyResult

IM_START, IM_END, ASSISTANT = 151644, 151645, 77091


@dataclasses.dataclass
class Task:
    """A KernelBench-format task whose model returns its input: the loop's tests need a task, not its meaning."""
    task_id: str
    source: str = "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n" \
                  "def get_inputs():\n    return [torch.randn(4, 8)]\ndef get_init_inputs():\n    return []\n"
    path: str = "<t>"


def assistant_turns(ids) -> int:
    return sum(1 for a, b in zip(ids, ids[1:]) if a == IM_START and b == ASSISTANT)


def token_logprobs(n, offset=0):
    return [-0.001 * (offset + k + 1) for k in range(n)]


class ScriptedEngine:
    """``generate`` that answers scripted texts: ``script(turn, call_index) -> text``.

    The returned token ids are the tokenizer's encoding of the text plus ``<|im_end|>`` (what an
    engine stopping on the EOS id returns); logprobs are distinct deterministic values.
    """

    def __init__(self, tok, script, finish_reason="stop", delay=0.0, end_token=IM_END):
        self.tok, self.script, self.finish_reason, self.delay, self.end_token = tok, script, finish_reason, delay, end_token
        self.calls = []          # (input_ids, params, output_ids)
        self.in_flight = 0
        self.max_in_flight = 0

    async def __call__(self, input_ids, params):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            turn = assistant_turns(input_ids)
            text = self.script(turn, len(self.calls))
            ids = self.tok.encode(text, add_special_tokens=False)
            finish = self.finish_reason(turn) if callable(self.finish_reason) else self.finish_reason
            if finish == "stop" and self.end_token is not None:
                ids = ids + [self.end_token]
            self.calls.append((list(input_ids), params, ids))
            return GenerateResult(token_ids=ids, logprobs=token_logprobs(len(ids), 100 * turn),
                                  finish_reason=finish, weight_version=3)
        finally:
            self.in_flight -= 1


@dataclasses.dataclass
class MarkerVerifier:
    """Verdict from markers in the response text (unit tests only; the real verifier has its own tests)."""

    delay: float = 0.0
    calls: list = dataclasses.field(default_factory=list)
    in_flight: int = 0
    infra_budget: int = 0        # how many INFRA verdicts to return before judging

    async def __call__(self, task, text):
        self.in_flight += 1
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            self.calls.append((task.task_id, text))
            tid = task.task_id
            if "INFRA" in text or self.infra_budget > 0:
                self.infra_budget = max(0, self.infra_budget - 1)
                return VerifyResult(task_id=tid, category=Category.INFRA, feedback="device worker died")
            if "PASS" in text:
                return VerifyResult(task_id=tid, category=Category.PASS, q=1.0, speedup=2.0, feedback="ok 2.0x")
            if "WRONG" in text:
                return VerifyResult(task_id=tid, category=Category.CORRECTNESS_ERROR, q=0.4,
                                    feedback=f"FEEDBACK-{tid}: mismatch at index 3")
            return VerifyResult(task_id=tid, category=Category.FORMAT_ERROR, feedback="no ```python block found")
        finally:
            self.in_flight -= 1
