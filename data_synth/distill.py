"""Teacher data: sample answers for every task, verify each with the verifier farm, write SFT rows.

Teachers:
* an endpoint: an OpenAI-compatible server (``POST /v1/chat/completions``) or an SGLang server (native
  ``POST /generate`` on token ids rendered with the tokenizer's chat template: the rollout engines' API, so
  the project's embedded engine serves too). Both go through ``megatron_rl.rollout.client.EngineClient``;
* the offline template teacher (``data_synth.teacher``), no LLM.

The prompt is the RL prompt (``megatron_rl.rollout.prompts.initial_messages``), so SFT and RL see the same
text. With ``turns > 1`` a failed answer gets the verifier's feedback as the next user turn
(``feedback_text``), as in multi-turn RL. A row's ``messages`` mark every turn but the final assistant answer
with ``step_loss_mask: 0`` (loss on the final assistant turn only).

Nothing is written for an unreachable endpoint (the error names the URL and what failed); every finished sample is
appended to ``OUT.partial`` (kept or not, with its verdicts), and the kept rows are written to ``OUT``, in task order,
at the end. A run that was stopped (Ctrl-C, a kill, a lost node) leaves its finished samples in ``OUT.partial`` (and,
stopped twice, ``OUT.partial.resume``); run the same command again and they are reused (each only where the teacher,
the sampling and verifier settings and the task's prompt are the same, and its verification was not infra). One run
writes an OUT at a time: a second one is refused while the first runs (`megatron_rl.fsutil.output_lock`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
import zlib
from typing import Any, Sequence
from urllib.parse import urlparse

from tqdm import tqdm

from megatron_rl.fsutil import named_os_error, output_lock
from megatron_rl.rollout.agent import ConversationCodec, farm_verify_fn
from megatron_rl.rollout.client import EngineClient, EngineError
from megatron_rl.rollout.prompts import DEFAULT_SYSTEM_PROMPT, defuse_control_tokens, feedback_text, initial_messages
from megatron_rl.rollout.protocol import SamplingParams
from megatron_rl.sft_data import untrainable
from megatron_rl.tokenizer import load_tokenizer
from verifier.config import PRECISIONS, VerifierConfig
from verifier.farm import TASK_FAULT_RULES, FarmConfig, VerifierFarm
from verifier.samples import ResultsWriter
from verifier.types import Category, VerifyResult

from .generate import GeneratedTask
from .taskset import verifier_task
from .compact import compact_answer
from .teacher import Unsupported, offline_answer
from .util import DataSynthError, atomic_write_jsonl, stable_hash

log = logging.getLogger("data_synth")
ROW_FORMAT = "data_synth.sft/1"


class EndpointError(RuntimeError):
    """The teacher endpoint is unreachable or answered something that is not a completion."""


@dataclasses.dataclass
class DistillConfig:
    endpoint: str | None = None
    offline: bool = False
    api: str = "auto"                  # auto | sglang | openai
    model: str | None = None           # OpenAI-compatible: the served model name
    tokenizer: str = "qwen3-offline"   # SGLang: chat template and token ids
    backend: str = "cpu"
    samples: int = 1
    turns: int = 1
    temperature: float = 0.7
    top_p: float = 0.95
    max_new_tokens: int = 4096
    concurrency: int = 8
    seed: int = 0
    keep: str = "pass"                 # pass | all
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    cache_dir: str | None = None
    compile_workers: int | None = None
    timing_trials: int | None = None
    trials: int | None = None
    size_profile: str | None = None
    precision: str = "auto"            # auto: each task at its manifest dtype; or float32 | float16 | bfloat16
    style: str = "full"                # offline teacher: full (data_synth.teacher) | compact (data_synth.compact)
    compact_styles: tuple[str, ...] = ("index", "pointer")   # compact: the loop styles answers are drawn from
    request_timeout_s: float = 1800.0
    infra_retries: int = 2
    verifier: dict[str, Any] = dataclasses.field(default_factory=dict)   # extra VerifierConfig fields
    farm: dict[str, Any] = dataclasses.field(default_factory=dict)       # extra FarmConfig fields

    def __post_init__(self) -> None:
        if self.offline == (self.endpoint is not None):
            raise DataSynthError("give exactly one teacher: --endpoint URL or --offline")
        if self.api not in ("auto", "sglang", "openai"):
            raise DataSynthError(f"--api must be auto, sglang or openai, got {self.api!r}")
        if self.precision != "auto" and self.precision not in PRECISIONS:
            raise DataSynthError(f"--precision must be auto or one of {PRECISIONS}, got {self.precision!r}")
        if self.style not in ("full", "compact"):
            raise DataSynthError(f"--style must be full or compact, got {self.style!r}")
        if self.keep not in ("pass", "all"):
            raise DataSynthError(f"--keep must be pass or all, got {self.keep!r}")
        for name in ("samples", "turns", "concurrency", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise DataSynthError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.temperature >= 0:
            raise DataSynthError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DataSynthError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.size_profile:
            from verifier.size_profiles import parse_fit_profile

            try:
                parse_fit_profile(self.size_profile)
            except ValueError as e:
                raise DataSynthError(f"--size-profile: {e}") from None
        if self.endpoint is not None:
            u = urlparse(self.endpoint if "://" in self.endpoint else "http://" + self.endpoint)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise DataSynthError(f"--endpoint {self.endpoint!r} is not an http(s) URL")

    def precision_of(self, task: GeneratedTask) -> str:
        if self.precision != "auto":
            return self.precision
        p = (task.precisions or ["float32"])[0]
        return p if p in PRECISIONS else "float32"

    def verifier_config(self, precision: str = "float32") -> VerifierConfig:
        kw: dict[str, Any] = {"backend": self.backend, "precision": precision}
        if self.trials is not None:
            kw["num_correct_trials"] = self.trials
        if self.timing_trials is not None:
            kw["num_timing_trials"] = self.timing_trials
        if self.cache_dir is not None:
            kw["build_cache_dir"] = self.cache_dir
        kw.update(self.verifier)
        try:
            return VerifierConfig(**kw)
        except (TypeError, ValueError) as e:
            raise DataSynthError(f"invalid verifier configuration: {e}") from None


@dataclasses.dataclass
class DistillSummary:
    out: str
    teacher: str
    tasks: int = 0
    responses: int = 0
    passed_samples: int = 0
    rows_written: int = 0
    refused_rows: int = 0              # would be kept, but the SFT loader refuses them (`sft_data.untrainable`)
    infra_samples: int = 0
    skipped_tasks: dict[str, str] = dataclasses.field(default_factory=dict)
    categories: dict[str, int] = dataclasses.field(default_factory=dict)
    mean_speedup: float | None = None
    verdicts_out: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------ teachers

class _Teacher:
    name = "teacher"

    async def respond(self, task: GeneratedTask, messages: list[dict[str, str]], seed: int) -> str | None:
        raise NotImplementedError

    async def close(self) -> None:
        return None


class OfflineTeacher(_Teacher):
    """Template kernels: one answer per task; no repair of a failed answer (it would be the same). ``compact``:
    the short fixed-template answers of `data_synth.compact` (tiny models, the CPU recipe)."""

    def __init__(self, backend: str, style: str = "full", seed: int = 0,
                 compact_styles: Sequence[str] = ("index", "pointer")):
        self.backend, self.style, self.seed, self.compact_styles = backend, style, seed, tuple(compact_styles)
        self.name = f"offline:{backend}" + (":compact" if style == "compact" else "")
        self.recipes: dict[str, str] = {}

    def answer(self, task):
        if self.style == "compact":
            return compact_answer(task, self.backend, self.seed, self.compact_styles)
        return offline_answer(task, self.backend)

    async def respond(self, task, messages, seed):
        if len(messages) > 1 + (messages[0]["role"] == "system"):
            return None
        ans = self.answer(task)
        self.recipes[task.task_id] = ans.recipe
        return ans.response


class SGLangTeacher(_Teacher):
    """SGLang native API: chat template rendered here, ``/generate`` on token ids."""

    def __init__(self, client: EngineClient, tokenizer: Any, cfg: DistillConfig, model_path: str | None = None):
        self.client, self.cfg = client, cfg
        self.codec = ConversationCodec(tokenizer)
        # the served model names the teacher where the server says it (/get_model_info): the URL of an engine
        # started for this run (rft --model) has a new port every time, and a stopped run's samples are reused only
        # under the same teacher name
        self.name = f"sglang:{model_path or client.url}"

    async def respond(self, task, messages, seed):
        ids = self.codec.prompt_ids(messages)
        sp = SamplingParams(temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                            max_new_tokens=self.cfg.max_new_tokens, stop_token_ids=list(self.codec.stop_token_ids),
                            seed=seed)
        res = await self.client.generate(ids, sp, return_logprob=False)
        return self.codec.decode_response(res.token_ids)

    async def close(self) -> None:
        await self.client.close()


class OpenAITeacher(_Teacher):
    """OpenAI-compatible ``/v1/chat/completions`` (vLLM, SGLang's OpenAI server, hosted APIs)."""

    def __init__(self, client: EngineClient, model: str, cfg: DistillConfig):
        self.client, self.model, self.cfg = client, model, cfg
        self.name = f"openai:{client.url}:{model}"

    async def respond(self, task, messages, seed):
        body = {"model": self.model, "messages": messages, "temperature": self.cfg.temperature,
                "top_p": self.cfg.top_p, "max_tokens": self.cfg.max_new_tokens, "seed": seed}
        out = await self.client.request("POST", "/v1/chat/completions", json_body=body, idempotent=False,
                                        timeout_s=self.cfg.request_timeout_s)
        try:
            return str(out["choices"][0]["message"]["content"] or "")
        except (KeyError, IndexError, TypeError):
            raise EndpointError(f"{self.client.url}/v1/chat/completions answered without choices[0].message."
                                f"content: {str(out)[:300]}") from None

    async def close(self) -> None:
        await self.client.close()


async def _probe(client: EngineClient, path: str) -> Any:
    return await client.request("GET", path, idempotent=False, timeout_s=15)


async def connect(cfg: DistillConfig) -> _Teacher:
    """The endpoint teacher; raises :class:`EndpointError` naming the URL when nothing answers."""
    url = cfg.endpoint or ""
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    url = url.rstrip("/")
    api = cfg.api
    if url.endswith("/v1"):
        url, api = url[:-3], "openai" if api == "auto" else api
    client = EngineClient(url)
    errors = []
    models = None
    if api in ("auto", "openai"):
        try:
            models = await _probe(client, "/v1/models")
            api = "openai"
        except EngineError as e:
            errors.append(f"GET /v1/models: {e}")
            if api == "openai":
                await client.close()
                raise EndpointError(f"cannot reach the OpenAI-compatible endpoint {url}: {e}") from None
    if api in ("auto", "sglang"):
        try:
            await _probe(client, "/health")
            api = "sglang"
        except EngineError as e:
            errors.append(f"GET /health: {e}")
            await client.close()
            raise EndpointError(f"cannot reach the teacher endpoint {url} ({'; '.join(errors)})") from None
    if api == "openai":
        model = cfg.model
        if model is None:
            data = models.get("data") if isinstance(models, dict) else None
            model = data[0].get("id") if isinstance(data, list) and data and isinstance(data[0], dict) else "default"
        return OpenAITeacher(client, str(model), cfg)
    try:
        tokenizer = load_tokenizer(cfg.tokenizer)
    except (OSError, ValueError) as e:
        await client.close()
        raise DataSynthError(f"--tokenizer {cfg.tokenizer!r}: {e}") from None
    try:
        info = await _probe(client, "/get_model_info")
    except EngineError:   # optional: the URL names the teacher then
        info = None
    info = info if isinstance(info, dict) else {}
    model = str(info["model_path"]) if info.get("model_path") else None
    if model and info.get("weight_version") is not None:   # an RL engine's weights change under one path
        model += f"@{info['weight_version']}"
    return SGLangTeacher(client, tokenizer, cfg, model)


# ------------------------------------------------------------------------------------------ the loop

def _verdict_summary(v: VerifyResult) -> dict[str, Any]:
    return {"category": v.category.value, "q": v.q, "speedup": v.speedup, "reward": v.reward,
            "speedup_compile": v.speedup_compile, "t_ref_ms": v.t_ref_ms, "t_cand_ms": v.t_cand_ms,
            "rule": v.rule, "feedback": v.feedback}


def _kept(row: dict[str, Any], cfg: DistillConfig) -> bool:
    """A row OUT gets: every row with ``keep=all`` (a pool, as RFT's: it judges trainability itself), else a passed
    one that the SFT trainer takes (`sft_data.untrainable`)."""
    return cfg.keep == "all" or (row["passed"] and untrainable(row) is None)


def sft_messages(prompt: list[dict[str, str]], turns: list[tuple[str, str | None]]) -> list[dict[str, Any]]:
    """Prompt + (answer, feedback) turns as chat messages; only the final assistant turn has loss. Earlier answers
    are context, defused as the teacher saw them (and as the RL agent's history holds them): a failed answer that
    spelled ``<|im_end|>`` made the whole row one the SFT loader refuses."""
    msgs = [dict(m, step_loss_mask=0) for m in prompt]
    for k, (answer, feedback) in enumerate(turns):
        final = k == len(turns) - 1
        msgs.append({"role": "assistant", "content": answer if final else defuse_control_tokens(answer),
                     "step_loss_mask": 1 if final else 0})
        if feedback is not None and k < len(turns) - 1:
            msgs.append({"role": "user", "content": feedback, "step_loss_mask": 0})
    return msgs


async def _sample(task: GeneratedTask, k: int, teacher: _Teacher, verify, cfg: DistillConfig,
                  vt: Any) -> dict[str, Any] | None:
    prompt = initial_messages(vt, cfg.backend, cfg.system_prompt)
    messages = list(prompt)
    turns: list[tuple[str, str | None]] = []
    verdicts: list[VerifyResult] = []
    for turn in range(1, cfg.turns + 1):
        seed = zlib.crc32(f"{cfg.seed}/{task.task_id}/{k}/{turn}".encode()) & 0x7FFFFFFF
        answer = await teacher.respond(task, messages, seed)
        if answer is None:
            break
        v = None
        for _ in range(cfg.infra_retries + 1):
            v = await verify(vt, answer)
            if v.category != Category.INFRA or v.rule in TASK_FAULT_RULES:   # the task's fault: it would repeat
                break
        assert v is not None
        verdicts.append(v)
        fb = None if v.passed else feedback_text(v.category.value, v.q, v.feedback)
        turns.append((answer, fb))
        if v.passed or v.category == Category.INFRA:
            break
        # the teacher's own answer back in its history, defused: spelled control tokens would end its turn there
        messages += [{"role": "assistant", "content": defuse_control_tokens(answer)}, {"role": "user", "content": fb}]
    if not turns:
        return None
    final = verdicts[-1]
    return {"format": ROW_FORMAT, "task_id": task.task_id, "sample_id": f"{task.task_id}#{k}",
            "messages": sft_messages(prompt, turns), "passed": final.passed, "speedup": final.speedup,
            "verdict": _verdict_summary(final), "verdicts": [_verdict_summary(v) for v in verdicts],
            "turns": len(turns), "source": teacher.name, "backend": cfg.backend, "stage": task.stage,
            "families": task.families, "ops": task.ops, "level": task.stage,
            "_verify_results": verdicts}


# how the work is run, not what a sample is (the teacher's name stands for the endpoint: the served model where the
# server says it, `SGLangTeacher`)
_NOT_IN_RESUME_KEY = ("offline", "samples", "concurrency", "keep", "cache_dir", "compile_workers",
                      "request_timeout_s", "farm", "endpoint")


def _resume_key(cfg: DistillConfig, teacher: str, prompt: str, k: int) -> str:
    """What a finished sample depends on: a row of an earlier run's ``OUT.partial`` is reused only under the same
    key (teacher, sampling and verifier settings, the task's rendered prompt, the sample index)."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in _NOT_IN_RESUME_KEY}
    return stable_hash(json.dumps({**fields, "teacher": teacher, "prompt": prompt, "k": k}, sort_keys=True,
                                  default=str), 32)


def _previous_rows(paths: Sequence[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Finished samples of an earlier, stopped run (its ``.partial`` rows; a torn last line is skipped):
    ``{sample_id: {resume_key: row}}`` with the verdicts back as `VerifyResult`s."""
    from verifier.samples import read_result_rows

    out: dict[str, dict[str, dict[str, Any]]] = {}
    for path in paths:
        if not os.path.isfile(path):
            continue
        for r in read_result_rows(path):
            try:
                verdicts = [VerifyResult.from_dict(v) for v in r.pop("_verify_results")]
                key = r.pop("_resume_key")
                out.setdefault(str(r["sample_id"]), {})[key] = {**r, "_verify_results": verdicts}
            except (KeyError, TypeError, ValueError, AttributeError):
                continue   # a row of an older format or another tool: sampled again
    return out


async def _run(tasks: Sequence[GeneratedTask], teacher: _Teacher, farm: VerifierFarm, cfg: DistillConfig,
               writer: ResultsWriter, summary: DistillSummary, progress: bool,
               previous: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    verify = farm_verify_fn(farm)
    sem = asyncio.Semaphore(cfg.concurrency)
    jobs: list[tuple[int, GeneratedTask, int]] = []
    order = 0
    samples = 1 if isinstance(teacher, OfflineTeacher) else cfg.samples
    vtasks = {}
    for t in tasks:
        if isinstance(teacher, OfflineTeacher):
            try:
                teacher.answer(t)
            except Unsupported as e:
                summary.skipped_tasks[t.task_id] = f"offline teacher: {e}"
                log.warning("skip %s: offline teacher: %s", t.task_id, e)
                continue
        vtasks[t.task_id] = verifier_task(t)
        for k in range(samples):
            jobs.append((order, t, k))
            order += 1
    results: list[dict[str, Any] | None] = [None] * len(jobs)
    bar = tqdm(total=len(jobs), desc="distill", unit="sample", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)

    prompts = {tid: stable_hash(json.dumps(initial_messages(vt, cfg.backend, cfg.system_prompt), sort_keys=True))
               for tid, vt in vtasks.items()}

    async def one(idx: int, t: GeneratedTask, k: int) -> None:
        key = _resume_key(cfg, teacher.name, prompts[t.task_id], k)
        row = previous.pop(f"{t.task_id}#{k}", {}).get(key)
        if row is not None and any(v.category == Category.INFRA for v in row["_verify_results"]):
            row = None   # verified while the farm failed (the stop may have been a lost node): sampled again
        if row is None:
            async with sem:
                row = await _sample(t, k, teacher, verify, cfg, vtasks[t.task_id])
        results[idx] = row
        if row is not None:   # every finished sample, kept or not, so a rerun need not redo it
            try:
                writer.append({**{n: v for n, v in row.items() if not n.startswith("_")}, "_resume_key": key,
                               "_verify_results": [v.to_dict() for v in row["_verify_results"]]})
            except OSError as e:   # a full disk: say which file (a rerun skips a torn line and reuses the rest)
                if e.filename is not None:
                    raise
                raise named_os_error(e, writer.partial_path) from e
        bar.update(1)

    try:
        await asyncio.gather(*(one(i, t, k) for i, t, k in jobs))
    finally:
        bar.close()
    return [r for r in results if r is not None]


def _check_size_profile(profile: str | None, tasks: Sequence[GeneratedTask]) -> None:
    """A manifest size profile that no task has would verify every task at its default sizes without a word."""
    from verifier.size_profiles import ManifestError, find_manifest_entry, parse_fit_profile

    if profile in (None, "", "cpu", "default") or parse_fit_profile(profile) is not None:
        return

    def sizes(t: GeneratedTask) -> dict:   # the farm finds a manifest entry by the task's path, as here
        if t.sizes or not t.path:
            return t.sizes or {}
        try:
            entry = find_manifest_entry(t.path)
        except ManifestError:
            return {}
        return entry.sizes if entry is not None else {}

    known = [sizes(t) for t in tasks]
    if not any(profile in k for k in known):
        have = sorted({p for k in known for p in k})
        raise DataSynthError(f"--size-profile {profile}: no task of --tasks has this profile (profiles there: "
                             f"{', '.join(have) or 'none'}); fit, fit:<MiB> or fit:<MiB>:<GFLOP> shrinks any task")


def distill(tasks: Sequence[GeneratedTask], out: str, cfg: DistillConfig, *, verdicts_path: str | None = None,
            progress: bool = True, farm_config: FarmConfig | None = None) -> DistillSummary:
    """Sample, verify and write SFT rows for ``tasks`` (read with ``taskset.read_task_set``)."""
    if not tasks:
        raise DataSynthError("no tasks to distill")
    missing = [t.task_id for t in tasks if t.path is None]
    if missing:
        raise DataSynthError(f"tasks must be on disk (write the task set first): {', '.join(missing[:5])}")
    _check_size_profile(cfg.size_profile, tasks)
    t0 = time.time()
    groups: dict[str, list[GeneratedTask]] = {}
    for t in tasks:
        groups.setdefault(cfg.precision_of(t), []).append(t)
    vcfgs = {p: cfg.verifier_config(p) for p in groups}
    summary = DistillSummary(out=out, teacher="offline" if cfg.offline else str(cfg.endpoint), tasks=len(tasks))

    async def main() -> tuple[_Teacher, list[dict[str, Any]]]:
        teacher = OfflineTeacher(cfg.backend, cfg.style, cfg.seed, cfg.compact_styles) if cfg.offline \
            else await connect(cfg)
        # an earlier stopped run's finished samples: its .partial moves aside, then the new .partial gets them back
        # as they are reused. A run stopped again before that leaves both files: the new rows are appended to the
        # aside file (which alone still holds the rest), never renamed over it
        partial, aside = out + ".partial", out + ".partial.resume"
        if os.path.isfile(partial) and os.path.isfile(aside):
            with open(aside, "ab") as dst, open(partial, "rb") as src:
                dst.write(b"\n")   # a torn last line stays one bad line (skipped), not glued to the next row
                shutil.copyfileobj(src, dst)
            os.unlink(partial)
        elif os.path.isfile(partial):
            os.replace(partial, aside)
        previous = _previous_rows([aside])
        if previous:
            log.warning("%s: reusing the finished samples of an earlier run where they match", partial)
        writer = ResultsWriter(out)
        finished = False
        rows: list[dict[str, Any]] = []
        try:
            for precision, group in groups.items():   # the farm verifies at one precision: one farm per dtype
                try:
                    farm = VerifierFarm(vcfgs[precision], farm_config or FarmConfig(
                        compile_workers=cfg.compile_workers, size_profile=cfg.size_profile, **cfg.farm))
                except (RuntimeError, ValueError, ImportError) as e:
                    raise RuntimeError(f"cannot start the verifier farm: {e}") from e
                done = False
                try:
                    rows += await _run(group, teacher, farm, cfg, writer, summary, progress, previous)
                    done = True
                finally:
                    farm.close(drain=done)
            finished = True
        finally:
            await teacher.close()
            if not finished:
                writer.close()
        order = {t.task_id: i for i, t in enumerate(tasks)}
        rows.sort(key=lambda r: (order[r["task_id"]], int(r["sample_id"].rsplit("#", 1)[1])))
        kept = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows if _kept(r, cfg)]
        writer.finish(kept)
        if os.path.isfile(aside):
            os.unlink(aside)
        return teacher, rows

    try:
        # one run per OUT: a second one moved the first's OUT.partial aside while it was appending to it, and the first
        # then removed the second's at its end
        with output_lock(out, "distill"):
            teacher, rows = asyncio.run(main())
    except EngineError as e:
        raise EndpointError(f"teacher endpoint failed: {e}") from None
    summary.teacher = teacher.name
    verdict_rows = []
    speedups = []
    for r in rows:
        for turn, v in enumerate(r["_verify_results"], 1):
            summary.responses += 1
            summary.categories[v.category.value] = summary.categories.get(v.category.value, 0) + 1
            verdict_rows.append({"sample_id": f"{r['sample_id']}/t{turn}", "task_id": r["task_id"],
                                 "level": r["stage"], "op_family": (r["families"] or [None])[0], **v.to_dict(),
                                 "meta": {"turn": turn, "source": r["source"]}})
        summary.passed_samples += int(r["passed"])
        summary.infra_samples += int(r["verdict"]["category"] == Category.INFRA.value)
        if r["passed"] and r["speedup"] is not None:
            speedups.append(r["speedup"])
    summary.rows_written = sum(1 for r in rows if _kept(r, cfg))
    summary.refused_rows = sum(1 for r in rows if r["passed"] and not _kept(r, cfg))
    summary.mean_speedup = round(sum(speedups) / len(speedups), 4) if speedups else None
    if verdicts_path:
        atomic_write_jsonl(verdicts_path, verdict_rows)
        summary.verdicts_out = verdicts_path
    log.info("distill: %d rows in %.1fs", summary.rows_written, time.time() - t0)
    return summary
