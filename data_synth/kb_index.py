"""Builds the committed KernelBench decontamination index from a KernelBench git checkout.

Every version of every task file that ever existed under ``KernelBench/level*`` (all commits of all refs)
is fingerprinted (``data_synth.decontam.fingerprint``); versions whose normalised sources are identical share
one entry. Only fingerprints are written (hashes, op signatures, shape keys, MinHash sketches), never
KernelBench's code.

    python -m data_synth.kb_index --repo /path/to/KernelBench [--out data_synth/data/kernelbench_index.json.gz]

The repository may be a bare git directory (e.g. the one the ``fetch`` tool mirrors).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
from typing import Any, Sequence

from tqdm import tqdm

from .decontam import INDEX_PATH, NGRAM, NORMALIZATION_VERSION, NUM_PERM, fingerprint
from .util import DataSynthError

_LEVEL = re.compile(r"(?:^|/)(?:old_)?level[_-]?(\d+)(?:/|$)")


def _git(repo: str, *args: str) -> str:
    try:
        return subprocess.run(["git", "--git-dir", repo, *args], check=True, capture_output=True,
                              text=True).stdout
    except subprocess.CalledProcessError as e:
        raise DataSynthError(f"git {' '.join(args)} failed in {repo}: {e.stderr.strip()[:300]}") from None


def _git_dir(repo: str) -> str:
    for cand in (os.path.join(repo, ".git"), repo):
        if os.path.isdir(cand) and os.path.exists(os.path.join(cand, "HEAD")):
            return cand
    raise DataSynthError(f"{repo} is not a git repository (no HEAD)")


def task_blobs(repo: str) -> dict[str, set[str]]:
    """blob id -> the paths it had, over every commit touching KernelBench/."""
    blobs: dict[str, set[str]] = {}
    commits = _git(repo, "rev-list", "--all", "--", "KernelBench/").split()
    for c in tqdm(commits, desc="commits", unit="commit", file=sys.stderr):
        for line in _git(repo, "ls-tree", "-r", c, "--", "KernelBench/").splitlines():
            meta, path = line.split("\t", 1)
            _, kind, blob = meta.split()
            if kind == "blob" and path.endswith(".py") and _LEVEL.search(path):
                blobs.setdefault(blob, set()).add(path[len("KernelBench/"):])
    return blobs


def build_index(repo: str) -> dict[str, Any]:
    repo = _git_dir(repo)
    blobs = task_blobs(repo)
    entries: dict[str, dict[str, Any]] = {}
    failures = []
    for blob in tqdm(sorted(blobs), desc="fingerprint", unit="file", file=sys.stderr):
        source = _git(repo, "cat-file", "-p", blob)
        paths = sorted(blobs[blob])
        try:
            fp = fingerprint(source)
        except (SyntaxError, ValueError) as e:
            failures.append({"paths": paths, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        e = entries.get(fp.hash)
        if e is None:
            m = _LEVEL.search(paths[0])
            entries[fp.hash] = e = {"paths": [], "level": int(m.group(1)) if m else None, "versions": 0,
                                    **fp.to_json()}
        e["paths"] = sorted(set(e["paths"]) | set(paths))
        e["versions"] += 1
        if e["shape_key"] is None and fp.shape_key is not None:
            e["shape_key"] = fp.shape_key
    head = _git(repo, "rev-parse", "HEAD").strip()
    date = _git(repo, "log", "-1", "--format=%cI", "HEAD").strip()
    n_commits = len(_git(repo, "rev-list", "--all", "--", "KernelBench/").split())
    return {"format": "data_synth.kb_index/1", "normalization": NORMALIZATION_VERSION,
            "source": {"repository": "https://github.com/ScalingIntelligence/KernelBench", "head": head,
                       "head_date": date, "commits_touching_tasks": n_commits, "task_file_versions": len(blobs),
                       "unparsable": failures},
            "params": {"ngram": NGRAM, "num_perm": NUM_PERM},
            "built_by": "python -m data_synth.kb_index --repo <KernelBench checkout>",
            "entries": sorted(entries.values(), key=lambda e: (e["paths"][0], e["hash"]))}


def write_index(doc: dict[str, Any], out: str) -> None:
    tmp = out + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode())
    os.replace(tmp, out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data_synth.kb_index", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", required=True, help="KernelBench git checkout or bare git directory")
    ap.add_argument("--out", default=INDEX_PATH)
    args = ap.parse_args(argv)
    try:
        doc = build_index(args.repo)
    except DataSynthError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_index(doc, args.out)
    src = doc["source"]
    print(json.dumps({"out": args.out, "entries": len(doc["entries"]), "task_file_versions": src["task_file_versions"],
                      "commits": src["commits_touching_tasks"], "unparsable": len(src["unparsable"]),
                      "with_shapes": sum(e["shape_key"] is not None for e in doc["entries"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
