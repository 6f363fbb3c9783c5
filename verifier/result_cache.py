"""Verdict cache: the same code for the same task on the same kind of device is verified once.

Keyed by (task id + task source hash, code hash, backend, device type, config fingerprint). Kept
in memory and, when given a path, in SQLite: every insert is its own transaction, so a crash
leaves either the whole row or nothing, and several processes (CLI runs, farm replicas) can share
one file. ``infra`` verdicts are never stored: they say nothing about the code.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import sqlite3
import threading
import time
from typing import Any

from .types import Category, VerifyResult


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def config_fingerprint(cfg: Any) -> str:
    """Hash of the verdict-relevant config (paths and worker counts excluded)."""
    if dataclasses.is_dataclass(cfg):
        d = dataclasses.asdict(cfg)
    else:
        d = dict(vars(cfg))
    for k in ("build_cache_dir", "max_jobs", "work_dir", "device_lock_dir", "device_wait_timeout_s", "build_niceness",
              "pch_after_compiles"):
        d.pop(k, None)
    return sha256_text(json.dumps(d, sort_keys=True, default=str))[:16]


def cache_key(task_id: str, task_source: str, code: str, backend: str, device_type: str, cfg_fp: str) -> str:
    parts = [task_id, sha256_text(task_source), sha256_text(code), backend, device_type, cfg_fp]
    return sha256_text("\x1f".join(parts))


def _copy(result: VerifyResult, cached: bool) -> VerifyResult:
    """A copy whose details can be changed without touching the cached entry."""
    return dataclasses.replace(result, cached=cached, details=copy.deepcopy(result.details))


class ResultCache:
    """Thread-safe in-memory map, optionally backed by an SQLite file."""

    def __init__(self, path: str | None = None):
        self.path = path
        self._mem: dict[str, VerifyResult] = {}
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
            try:
                self._db = sqlite3.connect(path, timeout=30.0, check_same_thread=False, isolation_level=None)
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("CREATE TABLE IF NOT EXISTS verdicts (key TEXT PRIMARY KEY, task_id TEXT, "
                                 "created REAL, result TEXT NOT NULL)")
            except sqlite3.DatabaseError as e:
                raise ValueError(f"result cache {path} is not a usable SQLite database: {e}") from e

    def get(self, key: str) -> VerifyResult | None:
        with self._lock:
            hit = self._mem.get(key)
            if hit is None and self._db is not None:
                row = self._db.execute("SELECT result FROM verdicts WHERE key = ?", (key,)).fetchone()
                if row is not None:
                    try:
                        hit = VerifyResult.from_dict(json.loads(row[0]))
                    except (ValueError, TypeError, KeyError):
                        hit = None  # a row from an incompatible version: recompute
                    if hit is not None:
                        self._mem[key] = hit
        return _copy(hit, cached=True) if hit is not None else None

    def put(self, key: str, result: VerifyResult) -> None:
        if result.category == Category.INFRA:
            return
        stored = _copy(result, cached=False)
        with self._lock:
            self._mem[key] = stored
            if self._db is not None:
                self._db.execute("INSERT OR REPLACE INTO verdicts (key, task_id, created, result) VALUES (?,?,?,?)",
                                 (key, result.task_id, time.time(), stored.to_json()))

    def __len__(self) -> int:
        with self._lock:
            if self._db is not None:
                return int(self._db.execute("SELECT COUNT(*) FROM verdicts").fetchone()[0])
            return len(self._mem)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
