"""Every knob of one verification: correctness trials and tolerances, timing protocol, sandbox limits.

One typed dataclass so the farm, the CLI and tests configure the verifier the same way. Bad values
raise ``ValueError`` naming the field at construction time, not deep inside a sandboxed child.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from .types import RewardParams

BACKENDS = ("cpu", "cuda", "musa")
PRECISIONS = ("float32", "float16", "bfloat16")

GiB = 1 << 30
MiB = 1 << 20

# Modules a candidate may import when the import allowlist (a policy rule) is enforced. Everything
# a kernel needs: torch (its public API), Triton, the MUSA backend, and small pure-Python helpers.
DEFAULT_ALLOWED_IMPORTS = (
    "torch", "triton", "torch_musa", "math", "typing", "functools", "itertools", "operator",
    "collections", "dataclasses", "enum", "numbers", "warnings", "__future__",
)

# Environment variables a sandboxed child inherits from the parent (everything else is dropped).
DEFAULT_ENV_ALLOWLIST = (
    "PATH", "LD_LIBRARY_PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ",
    "CUDA_HOME", "CUDA_PATH", "CUDNN_HOME", "NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS",
    "MUSA_HOME", "MUSA_PATH", "CC", "CXX",
)


@dataclasses.dataclass
class VerifierConfig:
    backend: str = "cpu"                 # "cpu" | "cuda" | "musa"
    num_correct_trials: int = 5
    atol_rtol: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"float32": 1e-4, "float16": 1e-2, "bfloat16": 1e-2})
    precision: str = "float32"           # dtype floating inputs and both models are cast to (KernelBench)
    num_warmup: int = 3
    # median over these; on an H200 the speedup's CV over 5 fresh runs was 1.1 % at 20 trials, 0.9-1.0 % at 60
    # and 0.7 % at 120 (bench/results/verifier_timing_h200.md); a trial of a sub-ms kernel costs ~20 ms
    num_timing_trials: int = 120
    # timing ends once its trials, at their median pace (calls, fresh inputs and commitment; audits excluded),
    # add up to this. On an H200 a full-size KernelBench task (6.4 GB per call, 22-32 ms a trial) stops after
    # 78-114 trials (bench/results/verifier_fullsize_h200.md); the farm benchmark's L1 tasks spent 27-50 ms a trial
    # at 10 s and 120 trials, so they should now stop after ~50-90 (not measured), where the speedup's CV was
    # 0.9-1.0 % at 60 trials and 0.7 % at 120 (bench/results/verifier_timing_h200.md)
    time_budget_s: float = 2.5
    # CUDA: after each flush the device spins until the host has enqueued the whole call, so a timed call is
    # its device time without host-dispatch gaps (KernelBench's semantics for references that are chains of
    # small ops); off: dispatch gaps inside the call count (verifier.timing.CacheFlusher)
    timing_hide_dispatch: bool = False
    # detach CUPTI when each profiler session in the child stops (libkineto's TEARDOWN_CUPTI), so that an attached
    # CUPTI cannot slow the timed launches after the profiled trials (pytorch/pytorch#144455). Off by default: it
    # made no measurable difference on an H200 (bench/results/verifier_dispatch_timing_h200.md), and the teardown
    # runs asynchronously, so a session started soon after may lose its GPU events (pytorch/kineto#1554), which
    # a hidden trial would read as no device kernel at all
    cupti_teardown: bool = False
    timing_batch_ms: float = 20.0        # each trial times this much back-to-back calls per runner (do_bench style)
    max_timing_reps: int = 100           # at most this many calls per runner and trial, each on fresh inputs
    timing_memory_bytes: int = 4 * GiB   # the trial's fresh inputs and kept-alive outputs fit in this
    compile_timeout_s: float = 600.0     # total compiler time one candidate may use
    run_timeout_s: float = 180.0         # wall clock of one sandboxed child after its harness is up
                                         # (compile time excluded)
    max_response_bytes: int = 200_000
    # above this the speedup is implausible: cheating. For a reference bound by host dispatch (more than one ATen
    # op, at most dispatch_bound_op_ms per op) the cap is max(speedup_cap, speedup_cap_per_op x its ops): a chain of
    # 64 small elementwise ops, whose honest one-kernel fusion was timed at 106-295x on an H200 (its reference
    # swings between runs), gets 640x
    speedup_cap: float = 50.0
    speedup_cap_per_op: float = 10.0
    dispatch_bound_op_ms: float = 0.02
    # a candidate timed below this share of the device's speed-of-light floor is cheating (verifier.speed_of_light;
    # devices with published figures: H200, MTT S4000/S5000); sol_device_spec sets the figures for any device
    sol_margin: float = 0.5
    sol_device_spec: dict[str, Any] | None = None
    compare_torch_compile: bool = False
    reward: RewardParams = dataclasses.field(default_factory=RewardParams)

    # rlimits of every sandboxed child (per process; children of the child inherit them)
    cpu_time_limit_s: float = 1800.0
    memory_limit_bytes: int = 32 * GiB   # RLIMIT_AS on cpu; RLIMIT_DATA on GPU backends (drivers reserve huge VA)
    file_size_limit_bytes: int = 16 * GiB
    max_processes: int = 512             # RLIMIT_NPROC headroom over what the user already runs (threads count)
    max_open_files: int = 4096

    build_cache_dir: str | None = None   # shared build cache (per-candidate records + per-extension artifacts)
    feedback_max_chars: int = 1500

    # --- additions beyond the farm contract ---
    max_jobs: int | None = None          # MAX_JOBS for ninja inside compile children (None: torch's default)
    cuda_arch_list: str = "9.0"          # TORCH_CUDA_ARCH_LIST for builds on GPU-less hosts (H200 = sm_90)
    musa_arch_list: str = "22;31"        # TORCH_MUSA_ARCH_LIST (mp_22 = S4000, mp_31 = S5000)
    enforce_policy_rules: bool = True    # static rules that are policy (try/except, import allowlist, ...)
    disabled_rules: tuple[str, ...] = () # individual policy rules to switch off (security rules cannot be)
    allowed_imports: tuple[str, ...] = DEFAULT_ALLOWED_IMPORTS
    scale_floor: float = 1e-30           # floor of max|ref| in the scale-relative error check
    num_timing_audits: int = 2           # timed trials whose candidate outputs the parent re-checks (and the last)
    # outputs of one call larger than this (KernelBench's full sizes: 6.4 GB) are handed over and compared entry by
    # entry in the first correctness trial only; the other correctness trials, the ablation trial, the audits and
    # the hidden trials hand over a random sample of output_sample_elements entries per tensor, picked by the
    # parent after the call returned (verifier.correctness.sample_index): a full handover of 6.4 GB costs seconds
    sample_outputs_above_bytes: int = 256 * MiB
    output_sample_elements: int = 1 << 24
    # on a CUDA device, full handovers of outputs larger than this go through a device buffer the parent offers
    # (verifier.device_handover: no host copies, ~10 s less per check at 6.4 GB); None: always the sealed memfd
    device_handover_above_bytes: int | None = 8 * MiB
    audit_calls_per_trial: int = 4       # calls of an audited trial's batch that are checked (picked after it ran)
    cpu_threads: int = 1                 # torch intra-op threads in the child on the cpu backend (fair timing)
    cpu_flush_bytes: int = 8 * MiB       # cache flush buffer before each timed call on cpu
    work_dir: str | None = None          # where private per-evaluation dirs are made (default: system temp)
    network_isolation: bool = True       # new network namespace (or Landlock TCP deny) for every child
    landlock: bool = True                # confine writes of every child to its private dirs
    # also writable in children: the CUDA driver writes below /proc/self at init (seen on the H200 machines:
    # cudaGetDeviceCount fails with error 304 otherwise); /dev/shm for device runtimes' shared memory
    extra_writable: tuple[str, ...] = ("/proc/self", "/dev/shm")
    drop_capabilities: bool = True       # children of a root parent run without capabilities
    syscall_filter: bool = True          # seccomp filter in every child (verifier.syscall_filter)
    env_allowlist: tuple[str, ...] = DEFAULT_ENV_ALLOWLIST
    max_output_tail_bytes: int = 64 * 1024  # child stdout/stderr kept by the parent (the rest is drained)
    startup_timeout_s: float = 180.0     # interpreter + torch import + device init of a child (before any
                                         # candidate code runs); exceeding it is an infra failure
    # several device-stage workers may share one device (verifier.device_lock): start-up and correctness
    # side by side, timing alone. A task whose one correctness trial needs more than this (or cannot be
    # sized) has the device to itself for its whole stage.
    shared_device_max_bytes: int = 8 * GiB
    device_wait_timeout_s: float = 600.0   # waiting for the device held by other workers; then infra
    device_lock_dir: str | None = None   # where the per-device lock files live (default: system temp)
    # nice level of build and compile children (and the compilers they run): device-stage children, whose
    # timed calls and wall-clock plausibility checks suffer from CPU scheduling delays, go first
    build_niceness: int = 10
    # a flag set's precompiled torch/extension.h is built once this many extensions with it were compiled
    # without one (verifier.pch; 0: never). It halves C++ builds; CUDA builds, mostly nvcc, gain little
    pch_after_compiles: int = 4

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"VerifierConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"VerifierConfig.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not isinstance(self.atol_rtol, dict) or self.precision not in self.atol_rtol:
            raise ValueError(f"VerifierConfig.atol_rtol needs a tolerance for precision {self.precision!r}, "
                             f"got {self.atol_rtol!r}")
        for k, v in self.atol_rtol.items():
            if k not in PRECISIONS or not isinstance(v, (int, float)) or not (0 < v < 1):
                raise ValueError(f"VerifierConfig.atol_rtol[{k!r}] must be a dtype in {PRECISIONS} with a "
                                 f"tolerance in (0, 1), got {v!r}")
        positive_ints = ("num_correct_trials", "num_timing_trials", "max_response_bytes", "memory_limit_bytes",
                         "file_size_limit_bytes", "max_processes", "max_open_files", "feedback_max_chars",
                         "cpu_threads", "max_output_tail_bytes", "max_timing_reps",
                         "timing_memory_bytes", "shared_device_max_bytes", "audit_calls_per_trial",
                         "sample_outputs_above_bytes", "output_sample_elements")
        for name in positive_ints:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"VerifierConfig.{name} must be a positive integer, got {v!r}")
        if not isinstance(self.build_niceness, int) or isinstance(self.build_niceness, bool) or \
                not 0 <= self.build_niceness <= 19:
            raise ValueError(f"VerifierConfig.build_niceness must be an integer in 0..19, got {self.build_niceness!r}")
        for name in ("num_warmup", "num_timing_audits", "cpu_flush_bytes", "pch_after_compiles"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"VerifierConfig.{name} must be a non-negative integer, got {v!r}")
        if self.sol_device_spec is not None:
            from .speed_of_light import device_spec
            device_spec(None, dict(self.sol_device_spec))   # raises ValueError naming the bad field
        if not isinstance(self.sol_margin, (int, float)) or isinstance(self.sol_margin, bool) or \
                not 0 <= self.sol_margin <= 1:
            raise ValueError(f"VerifierConfig.sol_margin must be a number in [0, 1], got {self.sol_margin!r}")
        for name in ("time_budget_s", "compile_timeout_s", "run_timeout_s", "speedup_cap", "speedup_cap_per_op",
                     "dispatch_bound_op_ms", "cpu_time_limit_s", "scale_floor", "startup_timeout_s", "timing_batch_ms",
                     "device_wait_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"VerifierConfig.{name} must be a positive number, got {v!r}")
        v = self.device_handover_above_bytes
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"VerifierConfig.device_handover_above_bytes must be a non-negative integer or None, "
                             f"got {v!r}")
        if self.max_jobs is not None and (not isinstance(self.max_jobs, int) or self.max_jobs <= 0):
            raise ValueError(f"VerifierConfig.max_jobs must be a positive integer or None, got {self.max_jobs!r}")
        if isinstance(self.reward, dict):
            self.reward = RewardParams(**self.reward)
        if not isinstance(self.reward, RewardParams):
            raise ValueError(f"VerifierConfig.reward must be RewardParams, got {type(self.reward).__name__}")
        self.disabled_rules = tuple(self.disabled_rules)
        self.allowed_imports = tuple(self.allowed_imports)
        self.env_allowlist = tuple(self.env_allowlist)
        self.extra_writable = tuple(self.extra_writable)
        from .static_checks import SECURITY_RULES, POLICY_RULES  # late: static_checks imports nothing of ours
        for rule in self.disabled_rules:
            if rule in SECURITY_RULES:
                raise ValueError(f"VerifierConfig.disabled_rules: {rule!r} is a security rule and cannot be "
                                 f"disabled (policy rules: {sorted(POLICY_RULES)})")
            if rule not in POLICY_RULES:
                raise ValueError(f"VerifierConfig.disabled_rules: unknown rule {rule!r} "
                                 f"(policy rules: {sorted(POLICY_RULES)})")
        for name in ("build_cache_dir", "work_dir"):
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, os.path.abspath(os.path.expanduser(str(v))))

    @property
    def tolerance(self) -> float:
        """atol = rtol for the configured precision (KernelBench convention)."""
        return float(self.atol_rtol[self.precision])

    def arch_list(self) -> str | None:
        return {"cuda": self.cuda_arch_list, "musa": self.musa_arch_list}.get(self.backend)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["disabled_rules"] = list(self.disabled_rules)
        d["allowed_imports"] = list(self.allowed_imports)
        d["env_allowlist"] = list(self.env_allowlist)
        d["extra_writable"] = list(self.extra_writable)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VerifierConfig":
        """Build from a plain mapping (YAML/JSON); unknown keys are an error, not silently ignored."""
        if not isinstance(d, dict):
            raise ValueError(f"verifier config must be a mapping, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown verifier config keys {unknown}; known: {sorted(names)}")
        return cls(**d)
