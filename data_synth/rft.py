"""Diversity-preserving rejection fine-tuning data (MusaCoder §1.4): sample, verify, cluster, draw across clusters.

    python -m data_synth rft --tasks DIR --model SFT_HF_DIR --samples 8 --out rft.jsonl [--targets 2]

From the SFT model, ``k`` responses per task are sampled (the embedded engine serving ``--model``, or any
``--endpoint``, through ``data_synth.distill``: same prompts, verifier farm and row format), and only the verified
ones (parse, compile, correct, legal) that the SFT trainer takes (no spelled control tokens: `untrainable`) are
kept. Standard RFT would keep the best one per prompt; here the correct answers of each prompt are clustered into
implementation strategies and the SFT targets are drawn across clusters, so training on them does not collapse the
model onto one template before RL:

* exact duplicates (same normalised code) are merged first;
* a structural signature of the native code buckets the answers: kernels and launches, shared memory, warp
  shuffles, vectorised loads and SIMD, atomics, unrolling, tensor cores, grid-stride loops, pointer-walk versus
  indexed loops, extension count (`signature`);
* inside a bucket, answers whose MinHash Jaccard over normalised tokens (the native sources lexed by Pygments with
  identifiers mapped to ``ID`` except builtins and intrinsics, plus the alpha-renamed Python) is at least
  ``--jaccard`` (0.7) are one cluster (single linkage);
* targets: clusters in a seeded random order, a random member of each in turn, up to ``--targets`` per prompt.

The report (``--report``, default ``OUT.report.json``) gives, per prompt and on average, the distinct clusters among
the verified answers (before selection) and among the written targets (after), and what standard best-of-k RFT
would keep (one answer, one cluster). Rows are ``data_synth.sft/1`` with an ``rft`` field; they train through
``python -m megatron_rl.sft``.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import io
import json
import logging
import os
import random
import re
import tokenize
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from megatron_rl.sft_data import untrainable

from .decontam import canonical_tree, jaccard, minhash
from .distill import DistillConfig, distill
from .generate import GeneratedTask
from .util import DataSynthError, atomic_write_jsonl, atomic_write_text

log = logging.getLogger("data_synth")

NGRAM = 5
_NATIVE_ARGS = ("cpp_sources", "cuda_sources", "musa_sources")
# names kept by the token normalisation: they carry the strategy, not a naming choice
_KEEP_NAMES = frozenset("""threadIdx blockIdx blockDim gridDim warpSize float4 float2 half2 int4 __half __nv_bfloat16
__nv_bfloat162 data_ptr numel empty_like empty contiguous size stride AT_DISPATCH_FLOATING_TYPES
AT_DISPATCH_FLOATING_TYPES_AND2 scalar_t int64_t size_t""".split())
_SIGNATURE_PATTERNS = {
    "kernels": r"__global__",
    "launches": r"<<<",
    "shared_memory": r"__shared__",
    "warp_shuffles": r"__shfl\w*",
    "vectorized": r"\b(?:float4|float2|half2|__nv_bfloat162|int4|__m256\w*|__m512\w*|_mm256_\w+|_mm512_\w+|_mm_\w+)\b",
    "atomics": r"\batomic\w+",
    "unroll": r"#pragma\s+unroll",
    "tensor_cores": r"\bwmma::|\bmma\.sync|\bcp\.async",
    "grid_stride": r"blockDim\.x\s*\*\s*gridDim\.x|gridDim\.x\s*\*\s*blockDim\.x",
    "pointer_walk": r"for\s*\(\s*(?:const\s+)?\w+\s*\*\s*\w+\s*=",
    "indexed_loop": r"for\s*\(\s*(?:int|int64_t|long|size_t|auto)\s+\w+\s*=",
    "unrolled_steps": r"\+=\s*(?:[2-9]|1[0-9]|[2-9][0-9])\b",
    "dtype_dispatch": r"AT_DISPATCH_\w+",
}


# ------------------------------------------------------------------------------------------ features


def native_sources(code: str) -> list[str]:
    """The native source strings a candidate hands to ``load_inline`` (literals, or names bound to literals)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):   # too deep for the parser: no sources read
        return []
    bound: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            lits = _literals(node.value, {})
            if lits:
                bound[node.targets[0].id] = lits
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _call_name(node.func).endswith("load_inline"):
            for kw in node.keywords:
                if kw.arg in _NATIVE_ARGS:
                    out += _literals(kw.value, bound)
    return out


def _call_name(func: ast.AST) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _literals(node: ast.AST, bound: dict[str, list[str]]) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name):
        return list(bound.get(node.id, []))
    if isinstance(node, (ast.List, ast.Tuple)):
        return [s for e in node.elts for s in _literals(e, bound)]
    return []


def native_tokens(source: str) -> list[str]:
    """C++/CUDA tokens with identifiers as ``ID`` (builtins, intrinsics and the torch API kept), numbers ``NUM``,
    strings ``STR``, comments and whitespace dropped."""
    from pygments.lexers import CudaLexer
    from pygments.token import Comment, Keyword, Name, Number, String, Text, Whitespace

    out = []
    for tok, text in CudaLexer().get_tokens(source):
        if tok in Whitespace or tok in Text or tok in Comment:
            if tok in Comment.Preproc:
                out.append(text.strip())
            continue
        if tok in Number:
            out.append("NUM")
        elif tok in String:
            out.append("STR")
        elif tok in Name and tok not in Name.Builtin and not tok in Keyword:
            out.append(text if text in _KEEP_NAMES or text.startswith(("__", "_mm", "atomic")) else "ID")
        else:
            out.append(text.strip())
    return [t for t in out if t]


def python_tokens(code: str) -> list[str]:
    """Alpha-renamed Python tokens with every string literal (the native sources) as ``STR``."""
    try:
        text = ast.unparse(canonical_tree(code))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        # a verified answer may nest deeper than the recursive renaming and unparsing go (``x = a + a + ...`` of
        # 2000 terms parses): its words still cluster it, where the RecursionError ended the whole command
        return code.split()
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.STRING:
            out.append("STR")
        elif tok.type in (tokenize.NAME, tokenize.OP, tokenize.NUMBER):
            out.append(tok.string)
    return out


def shingles(toks: Sequence[str], n: int = NGRAM) -> np.ndarray:
    grams = [" ".join(toks[i:i + n]) for i in range(max(1, len(toks) - n + 1))]
    hs = {int.from_bytes(hashlib.blake2b(g.encode(), digest_size=4).digest(), "little") for g in grams}
    return np.array(sorted(hs), dtype=np.uint64)


def signature(code: str) -> tuple[tuple[str, int], ...]:
    """The structural strategy of a candidate: which native features it uses (0/1), its kernel and extension
    counts (capped), as a hashable, readable tuple."""
    native = "\n".join(native_sources(code))
    feats = {k: int(bool(re.search(p, native))) for k, p in _SIGNATURE_PATTERNS.items()}
    feats["kernels"] = min(len(re.findall(r"__global__", native)), 4)
    feats["extensions"] = min(len(re.findall(r"\bload_inline\s*\(", code)), 4)
    return tuple(sorted(feats.items()))


@dataclasses.dataclass
class Candidate:
    row: dict[str, Any]
    code: str
    norm_hash: str
    signature: tuple[tuple[str, int], ...]
    minhash: np.ndarray

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "Candidate":
        from verifier.extract import FormatError, extract_candidate

        text = row["messages"][-1]["content"]
        try:
            code = extract_candidate(text, max_bytes=1 << 20)
        except FormatError:
            code = text
        natives = native_sources(code)
        toks = python_tokens(code) + [t for s in natives for t in native_tokens(s)]
        norm = hashlib.sha256(" ".join(toks).encode()).hexdigest()[:24]
        return cls(row, code, norm, signature(code), minhash(shingles(toks)))


def cluster(cands: Sequence[Candidate], threshold: float = 0.7) -> list[list[int]]:
    """Clusters (lists of indices into ``cands``): same signature and a chain of MinHash Jaccard >= threshold."""
    parent = list(range(len(cands)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(len(cands)):
        for j in range(i):
            if cands[i].signature == cands[j].signature and (
                    cands[i].norm_hash == cands[j].norm_hash or jaccard(cands[i].minhash, cands[j].minhash) >= threshold):
                parent[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for i in range(len(cands)):
        groups.setdefault(find(i), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def draw_targets(clusters: Sequence[Sequence[int]], k: int, rng: random.Random) -> list[tuple[int, int]]:
    """Up to ``k`` (cluster index, member) pairs: clusters in random order, a random unused member of each in turn."""
    pools = [list(c) for c in clusters]
    for p in pools:
        rng.shuffle(p)
    order = list(range(len(pools)))
    rng.shuffle(order)
    out: list[tuple[int, int]] = []
    while len(out) < k and any(pools):
        for ci in order:
            if pools[ci] and len(out) < k:
                out.append((ci, pools[ci].pop()))
    return out


# ------------------------------------------------------------------------------------------ the command


@dataclasses.dataclass
class RFTConfig:
    samples: int = 8                   # responses per prompt from the SFT model
    targets: int = 2                   # SFT targets per prompt, drawn across clusters
    jaccard: float = 0.7               # single-linkage MinHash Jaccard inside a signature bucket
    seed: int = 0

    def __post_init__(self) -> None:
        if self.samples < 1 or self.targets < 1:
            raise DataSynthError(f"--samples and --targets must be >= 1, got {self.samples} and {self.targets}")
        if not 0 < self.jaccard <= 1:
            raise DataSynthError(f"--jaccard must be in (0, 1], got {self.jaccard}")


def select(pool_rows: Sequence[dict[str, Any]], cfg: RFTConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(target rows, report) from the sampled rows of every prompt (verified or not). Verified rows the SFT trainer
    would refuse (`untrainable`) are no targets; they are counted as ``refused``."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    for r in pool_rows:
        by_task.setdefault(r["task_id"], []).append(r)
    targets: list[dict[str, Any]] = []
    prompts = []
    for task_id, rows in by_task.items():
        passed = [r for r in rows if r.get("passed")]
        verified = [r for r in passed if untrainable(r) is None]
        cands = [Candidate.from_row(r) for r in verified]
        clusters = cluster(cands, cfg.jaccard)
        rng = random.Random(f"{cfg.seed}/{task_id}")
        picked = draw_targets(clusters, cfg.targets, rng)
        for ci, i in picked:
            c = cands[i]
            row = dict(c.row)
            row["source"] = f"rft:{row.get('source', '')}"
            row["rft"] = {"cluster": ci, "clusters": len(clusters), "verified": len(cands), "samples": len(rows),
                          "signature": dict(c.signature)}
            targets.append(row)
        prompts.append({"task_id": task_id, "samples": len(rows), "verified": len(cands),
                        "refused": len(passed) - len(verified),
                        "distinct": len({c.norm_hash for c in cands}), "clusters_before": len(clusters),
                        "clusters_after": len({ci for ci, _ in picked}), "targets": len(picked),
                        "cluster_sizes": [len(c) for c in clusters]})
    with_pool = [p for p in prompts if p["verified"]]

    def mean(key: str) -> float | None:
        return round(sum(p[key] for p in with_pool) / len(with_pool), 4) if with_pool else None

    report = {"prompts": len(prompts), "prompts_with_verified": len(with_pool),
              "samples": sum(p["samples"] for p in prompts), "verified": sum(p["verified"] for p in prompts),
              "refused": sum(p["refused"] for p in prompts),
              "targets": len(targets), "clusters_per_prompt_before": mean("clusters_before"),
              "clusters_per_prompt_after": mean("clusters_after"),
              "clusters_per_prompt_best_of_k": 1.0 if with_pool else None,
              "distinct_per_prompt": mean("distinct"), "per_prompt": prompts, "config": dataclasses.asdict(cfg)}
    return targets, report


def run_rft(tasks: Sequence[GeneratedTask], out: str, cfg: RFTConfig, dcfg: DistillConfig, *,
            model_dir: str | None = None, report_path: str | None = None, pool_path: str | None = None,
            progress: bool = True, engine_threads: int | None = None) -> dict[str, Any]:
    """Sample (the embedded engine on ``model_dir``, or ``dcfg.endpoint``), verify, cluster, draw, write."""
    pool_path = pool_path or f"{out}.pool.jsonl"
    report_path = report_path or f"{out}.report.json"
    if model_dir is not None:
        from megatron_rl.rollout.local_engine import serve_embedded

        if not os.path.isfile(os.path.join(model_dir, "config.json")):   # bad input, before an engine starts
            raise DataSynthError(f"--model {model_dir}: " + ("not an HF model dir (no config.json)"
                                                            if os.path.isdir(model_dir) else "no such folder"))

        with serve_embedded(model_dir, seed=cfg.seed, threads=engine_threads,
                            log_dir=str(Path(out).parent / "rft_engine_logs")) as url:
            dcfg = dataclasses.replace(dcfg, endpoint=url, api="sglang")
            summary = distill(tasks, pool_path, dcfg, progress=progress)
    else:
        summary = distill(tasks, pool_path, dcfg, progress=progress)
    pool = [json.loads(line) for line in open(pool_path) if line.strip()]
    targets, report = select(pool, cfg)
    report["sampling"] = summary.to_dict()
    atomic_write_jsonl(out, targets)
    atomic_write_text(report_path, json.dumps(report, indent=2, default=str))
    return {"out": out, "report": report_path, "pool": pool_path,
            **{k: report[k] for k in ("prompts", "prompts_with_verified", "samples", "verified", "targets",
                                      "clusters_per_prompt_before", "clusters_per_prompt_after",
                                      "clusters_per_prompt_best_of_k", "distinct_per_prompt")}}
