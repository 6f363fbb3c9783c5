"""Hostile model outputs against every layer of the verifier, one regression test per hole found.

Each case is an attack that used to get a reward above -1 without a correct native kernel, crash the
verifier into an ``infra`` verdict, or get a correct kernel rejected. Static and extraction cases run no
child; the end-to-end cases share the compiled library of ``candidates.py`` (one build per session) and
otherwise use Python-only candidates (no build). Legitimate candidates are checked alongside each
tightened rule.
"""
import json
import os
import time

import pytest
import torch

from verifier.config import VerifierConfig
from verifier.correctness import flatten_outputs, same_structure, spec_summary
from verifier.devices import get_backend
from verifier.evaluate import _DeviceStage, precheck, verify
from verifier.extract import extract_candidate
from verifier.fallback import forbidden_ops, outermost_ops, runtime_violations
from verifier.sandbox import ProtocolError, SandboxedChild
from verifier.native_checks import scan_native
from verifier.static_checks import SECURITY_RULES, check_source
from verifier.tasks import load_task
from verifier.types import Category

from .candidates import ADD, HEADER, KERNELS_CPP, compiled, python_only, task_path

PRE = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
GOOD = PRE + "\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return x\n"


def fwd(expr: str, prelude: str = "", imports: str = "") -> str:
    return (PRE + imports + prelude + "\nclass ModelNew(nn.Module):\n    def forward(self, x):\n"
            f"        return {expr}\n")


def rules(code: str, backend: str = "cpu") -> set[str]:
    return {v.rule for v in check_source(code, backend)}


def native_rules(src: str, flags=(), backend: str = "cpu") -> set[str]:
    return {rule for rule, _ in scan_native([src], list(flags), backend)}


# ------------------------------------------------------------------------------------------- extraction
@pytest.mark.parametrize("response", [
    ("Here:\n```python\n" + GOOD + "```\nDone.\n").replace("\n", "\r\n"),      # CRLF line ends
    "\ufeff```python\n" + GOOD + "```\n",                                      # a BOM before the fence
    "\ufeff" + GOOD,                                                          # a BOM before plain source
    "```python\n" + GOOD.replace("return x", 'doc = """\n```\nexample\n```\n"""\n        return x') + "```\n",
])
def test_correct_candidates_survive_line_endings_boms_and_inner_fences(response):
    code = extract_candidate(response, 200_000)
    assert "class ModelNew" in code and "\r" not in code and not code.startswith("\ufeff")


@pytest.mark.parametrize("tail", ["y = x" + ".a" * 60000, "y = " + "+".join(["x"] * 60000),
                                  "y = " + "lambda: " * 3000 + "1"])
def test_source_too_deep_for_the_parser_is_a_format_error_not_infra(tail):
    task = load_task(task_path("relu"))
    r = precheck(task, "```python\n" + GOOD + tail + "\n```", VerifierConfig())
    assert r.category == Category.FORMAT_ERROR and "nested" in r.feedback


def test_source_too_deep_for_the_analysis_is_a_violation_not_an_exception():
    assert rules(GOOD + "y = torch" + ".a" * 2500 + "\n") == {"dynamic_code"}


# ---------------------------------------------------------------------------------- static: Python side
@pytest.mark.parametrize("code,rule", [
    # stdlib modules re-exported as attributes of torch and the allowed modules
    (fwd("torch.os.getpid() and x"), "file_access"),
    (fwd("torch.sys.modules['verifier.fallback'] and x"), "dynamic_code"),
    (fwd("torch.ctypes.CDLL(None) and x"), "process_or_thread"),
    (fwd("F.np.exp(x)"), "library_fallback"),
    (fwd("typing.sys.modules and x", imports="import typing\n"), "dynamic_code"),
    (fwd("collections._sys.modules and x", imports="import collections\n"), "dynamic_code"),
    (fwd("enum.bltns.setattr and x", imports="import enum\n"), "dynamic_code"),
    (fwd("dataclasses.inspect.stack() and x", imports="import dataclasses\n"), "dynamic_code"),
    (fwd("getattr(torch, 'os') and x"), "file_access"),
    (fwd("torch.utils.cpp_extension.subprocess.run(['sh']) and x"), "extension_load_file"),
    (fwd("torch.utils.collect_env.run('sh') and x"), "process_or_thread"),
    # host computation the profiler never sees
    (fwd("torch.from_numpy(x.numpy().clip(0, None))"), "host_compute"),
    (fwd("torch.tensor([max(v, 0.0) for v in x.reshape(-1).tolist()]).view(x.shape)"), "host_compute"),
    (fwd("x.clone().apply_(lambda v: max(v, 0.0))"), "host_compute"),
    (fwd("x.clone().map_(x, lambda a, b: a)"), "host_compute"),
    (fwd("list(x.untyped_storage()) and x"), "host_compute"),
    # string evaluation and raw code objects in the allowed modules
    (fwd("x", "def f(a: 'setattr(1, 2, 3)'):\n    pass\ntyping.get_type_hints(f)\n", "import typing\n"),
     "dynamic_code"),
    (fwd("functools.singledispatch(abs) and x", imports="import functools\n"), "dynamic_code"),
    (fwd("typing._eval_type and x", imports="import typing\n"), "dynamic_code"),
    (fwd("dataclasses.types.CodeType and x", imports="import dataclasses\n"), "dynamic_code"),
    # module objects laundered past name resolution, then patched or used
    (fwd("x", "m = [torch][0]\nm.autograd.profiler.profile = object\n"), "dynamic_code"),
    (fwd("x", "m = [torch][0]\nm.autograd.profiler.profile = object\n"), "monkey_patching"),
    (fwd("(lambda: torch)().utils.cpp_extension and x"), "dynamic_code"),
    (fwd("x", "def f(m=torch):\n    return m\n"), "dynamic_code"),
    (fwd("[torch.autograd][0] and x"), "dynamic_code"),
    (fwd("x", "d = {}\nd.relu = abs\n"), "monkey_patching"),
    (fwd("x", "for torch.relu in [abs]:\n    pass\n"), "monkey_patching"),
    (fwd("[0 for torch.relu in [abs]] and x"), "monkey_patching"),
    (fwd("x", "with torch.no_grad() as torch.relu:\n    pass\n"), "monkey_patching"),
    # global state and module-wide hooks (they fire in the reference's timed forward)
    (fwd("x", "torch.nn.modules.module.register_module_forward_pre_hook(print)\n"), "monkey_patching"),
    (fwd("x", "nn.modules.module.register_module_module_registration_hook(print)\n"), "monkey_patching"),
    (fwd("x", "torch.set_grad_enabled(True)\n"), "global_torch_state"),
    (fwd("x", "torch.autograd.set_detect_anomaly(True)\n"), "global_torch_state"),
    (fwd("x", "torch.set_num_interop_threads(4)\n"), "global_torch_state"),
    (fwd("x", "torch.autograd._disable_profiler\n"), "profiler_probe"),
])
def test_python_escape_hatches_are_rejected(code, rule):
    found = rules(code)
    assert rule in found, found
    assert found <= set(SECURITY_RULES) | {"torch_private_api", "import_not_allowed"}


# --------------------------------------------------------------------------------- static: native side
@pytest.mark.parametrize("src,rule", [
    ('#define RUN system\nvoid f(){ RUN("ls"); }', "process_or_thread"),              # macro alias
    ('void f(){ auto p = &system; p("ls"); }', "process_or_thread"),                 # function pointer
    ('void f(){ std::system("ls"); ::system("ls"); }', "process_or_thread"),
    ('void f(){ sys\\\ntem("ls"); }', "process_or_thread"),                          # line splice
    ('void f(){ system/**/("ls"); }', "process_or_thread"),
    ('extern "C" int my(const char*) __asm__("sys" "tem");', "native_source"),       # asm label alias
    ('static int my(const char*) __attribute__((weakref("system")));', "native_source"),
    ('void f(){ asm volatile("sys" "call"); }', "process_or_thread"),                # merged literals
    ('__global__ void k(){ asm volatile("SYSCALL"); }', "process_or_thread"),
    ('void f(){ write(5, "{}", 2); }', "file_access"),                               # forging the channel
    ('void f(){ dup2(1, 5); }', "file_access"),
    ('void f(){ __write(5, "{}", 2); }', "file_access"),                             # glibc's aliases
    ('extern "C" int __libc_system(const char*);', "file_access"),
    ('void f(){ __gnu_cxx::stdio_filebuf<char> b(5, std::ios::out); }', "file_access"),  # a stream on fd 5
    ('extern "C" void GOMP_parallel(void (*)(void*), void*, unsigned, unsigned);', "process_or_thread"),
    ('#include <threads.h>\nint g(void*);\nvoid f(){ thrd_t t; thrd_create(&t, g, 0); }', "process_or_thread"),
    ('void f(){ at::launch([]{}); }', "process_or_thread"),
    ('using namespace std;\nvoid f(){ thread t([]{}); t.join(); }', "process_or_thread"),
    ('torch::Tensor f(torch::Tensor x){ return at::native::relu(x); }', "host_compute"),  # no dispatcher event
    ('#include <ATen/ops/add_cpu_dispatch.h>\ntorch::Tensor f(torch::Tensor a){ return at::cpu::add(a, a); }',
     "host_compute"),
    ('torch::Tensor f(torch::Tensor x){ return at::_ops::relu::redispatch(c10::DispatchKeySet(), x); }',
     "host_compute"),
    ('using namespace at;\ntorch::Tensor f(torch::Tensor x){ return native::relu(x); }', "host_compute"),
    ('namespace at { namespace native { Tensor f(const Tensor& x){ return relu(x); } } }', "host_compute"),
    ('torch::Tensor f(torch::Tensor x){ return at :: native :: relu(x); }', "host_compute"),
    ('extern "C" void sgemm_(const char*, const char*, const int*);', "host_compute"),  # MKL from libtorch
    ('extern "C" void MKL_Set_Num_Threads(int);', "process_or_thread"),
    ('void f(py::object o){ o.attr("x"); }', "dynamic_code"),                         # pybind object API
    ('void f(){ PyThreadState_Get(); }', "dynamic_code"),
    ('void f(){ \\u0073ystem("ls"); }', "native_source"),
    ('__attribute__((section(".text"))) const unsigned char code[] = {0xc3};', "native_source"),
    ('#define CAT(a,b) a%:%:b', "native_source"),
    ('float f(float x){ asm volatile("nop"); return x; }', "native_source"),           # host asm on cpu
])
def test_native_aliases_and_dispatcher_bypasses_are_rejected(src, rule):
    assert rule in native_rules(src), native_rules(src)


@pytest.mark.parametrize("src,rule", [
    # asking the profiler whether it is on: the kernel runs only while the trials watch (ATen otherwise)
    ("#include <ATen/record_function.h>\nbool f(){ return at::hasCallbacks(); }", "profiler_probe"),
    ("bool f(){ return at::isRecordFunctionEnabled(); }", "profiler_probe"),
    ("bool f(){ return torch::autograd::profiler::profilerEnabled(); }", "profiler_probe"),
    ('void f(){ RECORD_FUNCTION("mine", std::vector<c10::IValue>()); }', "profiler_probe"),
    # process-wide allocator, environment and scheduling policy the reference's timed calls share
    ("#include <malloc.h>\nstatic int p = [] { mallopt(M_MMAP_THRESHOLD, 65536); return 0; }();", "runtime_policy"),
    ("void f(){ malloc_trim(0); }", "runtime_policy"),
    ("void f(c10::Allocator* a){ c10::SetCPUAllocator(a, 100); }", "runtime_policy"),
    ("void f(){ c10::cuda::CUDACachingAllocator::setMemoryFraction(0.1, 0); }", "runtime_policy"),
    ('void f(){ setenv("OMP_NUM_THREADS", "1", 1); }', "runtime_policy"),
    ("void f(){ at::globalContext().setAllowTF32CuBLAS(true); }", "global_torch_state"),
    ("long f(){ return at::detail::getDefaultCPUGenerator().current_seed(); }", "global_torch_state"),
    # descriptors, exits and CPU clocks
    ('void f(){ dprintf(5, "{}"); }', "file_access"),
    ("void f(){ int p[2]; pipe(p); }", "file_access"),
    ("void f(){ close(5); }", "file_access"),
    ("void f(){ _exit(0); }", "process_or_thread"),
    ("long f(){ return std::clock(); }", "timer_tampering"),
    ("long f(){ struct rusage r; getrusage(RUSAGE_SELF, &r); return r.ru_utime.tv_usec; }", "timer_tampering"),
    # a libc function reached as a value where no variable of its name is in scope
    ('void a(){ bool write = true; (void)write; }\nvoid b(){ auto w = write; w(5, "x", 1); }', "file_access"),
    ('void a(float signal){ (void)signal; }\nvoid b(){ auto h = signal; h(2, nullptr); }', "process_or_thread"),
    ('int f(){ int write = 1; return ::write(5, "x", write); }', "file_access"),
    ('bool open = true;\nint f(){ return open("/etc/passwd", 0); }', "file_access"),
])
def test_profiler_queries_process_policy_and_libc_values_are_rejected(src, rule):
    assert rule in native_rules(src), native_rules(src)


@pytest.mark.parametrize("flags", [["-Wl,--defsym,my=system"], ["-Dmy=system"], ["-include/etc/passwd"],
                                   ["@/tmp/flags"], ["-Xcompiler", "-fopenmp"], ["-ccbin", "/bin/sh"]])
def test_unsafe_compiler_flags_are_rejected(flags):
    assert native_rules('void my(const char*);\nvoid f(){ my("ls"); }', flags)


def test_a_define_split_over_two_flag_strings_is_scanned():
    code = _inline(", extra_cflags=['-D', 'my=system']", 'void my(const char*); void f(){ my("ls"); }')
    assert "process_or_thread" in rules(code)


def _inline(extra: str, src: str = "torch::Tensor f(torch::Tensor x) { return x; }") -> str:
    return (PRE + "from torch.utils.cpp_extension import load_inline\n"
            f"ext = load_inline(name='k', cpp_sources={src!r}, functions=['f']{extra})\n" + GOOD.split(PRE)[1])


@pytest.mark.parametrize("code,backend", [
    (_inline("", "#include <cuda_runtime.h>\ntorch::Tensor f(torch::Tensor x) { return x; }"), "cpu"),
    (_inline(", extra_ldflags=['-ltorch_nonexistent']"), "cpu"),
    (_inline(", extra_ldflags=['-l', 'c10_nonexistent']"), "cuda"),
    (_inline(", cuda_sources='torch::Tensor g(torch::Tensor x) { return x; }'"), "cpu"),
    (_inline(", with_cuda=True"), "cpu"),
    (_inline("", "#include <musa_runtime.h>\ntorch::Tensor f(torch::Tensor x) { return x; }"), "cuda"),
])
def test_requests_for_a_missing_toolchain_cannot_force_an_infra_verdict(code, backend):
    """The build reports a missing CUDA header or torch library as a broken build host (infra: retried,
    never scored); a candidate asking for one is judged instead."""
    assert "toolchain_mismatch" in rules(code, backend)


def test_toolchains_the_backend_has_are_still_allowed():
    cuda = "#include <cuda_runtime.h>\ntorch::Tensor f(torch::Tensor x) { return x; }"
    assert check_source(_inline(", extra_ldflags=['-L/usr/local/cuda/lib64', '-lcudart', '-lcublas'], "
                                "cuda_sources='int g();'", cuda), "cuda") == []
    assert check_source(_inline(", extra_ldflags=['-lc10', '-ltorch', '']"), "cpu") == []


def test_an_extension_named_like_a_module_is_rejected():
    """Calls into the extension are attributed by module name: one named `torch` would count torch's."""
    assert "native_source" in rules(_inline("").replace("name='k'", "name='torch'"))


LEGIT_CUDA = r'''
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <ATen/cuda/CUDAContext.h>
#define CHECK_CUDA(x) TORCH_CHECK(x.device().is_cuda(), #x " must be a CUDA tensor")
#define CHECK_INPUT(x) CHECK_CUDA(x); TORCH_CHECK(x.is_contiguous(), #x " must be contiguous")
// comments may say open(), write() or system()
__device__ __forceinline__ float ld(const float* p) {
  float v; asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p)); return v; }
__global__ void relu_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  int thread = threadIdx.x;
  if (i < n) y[i] = fmaxf(ld(x + i), 0.f) + 0 * thread * 1'000;
}
torch::Tensor relu(torch::Tensor x) {
  CHECK_INPUT(x);
  auto y = torch::empty_like(x);
  const int threads = 256, blocks = (x.numel() + threads - 1) / threads;
  relu_kernel<<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(x.data_ptr<float>(), y.data_ptr<float>(),
                                                                        x.numel());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  TORCH_CHECK(x.numel() > 0, "failed to open/write/close the system");
  std::vector<int64_t> v(3); std::fill(v.begin(), v.end(), 0); auto b = std::bind(relu, x); (void)b;
  return y;
}
'''
LEGIT_TRITON = PRE + '''import triton
import triton.language as tl


@triton.jit
def relu_kernel(x_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(axis=0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    tl.store(out_ptr + offsets, tl.maximum(tl.load(x_ptr + offsets, mask=mask), 0.0), mask=mask)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = 1024

    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_SIZE"]),)
        relu_kernel[grid](x, out, n, BLOCK_SIZE=self.block)
        return out.view(x.shape).reshape(x.shape)
'''
LEGIT_KERNELBENCH = PRE + f'''import torch.utils.cpp_extension
import math

src = r"""{LEGIT_CUDA}"""
ext = torch.utils.cpp_extension.load_inline(name="relu_ext", cpp_sources="torch::Tensor relu(torch::Tensor x);",
                                            cuda_sources=src, functions=["relu"], verbose=True,
                                            extra_cflags=["-O3"], extra_cuda_cflags=["-O3", "--use_fast_math",
                                            "-DNDEBUG", "-U__CUDA_NO_HALF_OPERATORS__", "-Xptxas", "-O3",
                                            "-lineinfo", "-std=c++17"], extra_ldflags=[""])


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.n = x.numel()
        return ext.relu(x)


class ModelNew(nn.Module):
    def __init__(self, features: int = 4):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features))
        self.cache = {{}}

    @torch.no_grad()
    def forward(self, x):
        with torch.set_grad_enabled(False):
            out = torch.zeros(x.shape, device=x.device, dtype=x.dtype)
            self.cache[x.shape] = math.prod(x.shape)
            out = _Fn.apply(x.contiguous().view(-1)).view(x.shape)
        return out
'''


@pytest.mark.parametrize("code,backend", [(LEGIT_KERNELBENCH, "cuda"), (LEGIT_TRITON, "cuda"), (HEADER + ADD, "cpu")])
def test_legitimate_candidates_still_pass_the_tightened_rules(code, backend):
    assert check_source(code, backend) == []
    assert scan_native([LEGIT_CUDA], ["-O3", "--use_fast_math", "-DNDEBUG"], "cuda") == []
    assert scan_native([KERNELS_CPP], ["-O2"], "cpu") == []


def test_bundled_example_responses_still_pass_the_static_rules():
    examples = os.path.join(os.path.dirname(__file__), "..", "..", "verifier", "tasks", "examples",
                            "samples.jsonl")
    with open(examples) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        if "```python" in row["response"] and row["expect"] != "cheating":
            assert check_source(extract_candidate(row["response"], 200_000)) == [], row["sample_id"]


# --------------------------------------------------------------------------------------------- outputs
def test_output_containers_are_walked_without_running_candidate_code():
    calls = []

    class Lazy(tuple):
        def __iter__(self):
            calls.append("iter")
            return iter((torch.ones(1),))

    class LazyDict(dict):
        def keys(self):
            calls.append("keys")
            return ["z"]

        def __getitem__(self, k):
            calls.append("getitem")
            return torch.ones(1)

    x = torch.zeros(2)
    leaves, spec = flatten_outputs(Lazy((x, x)))
    assert calls == [] and len(leaves) == 2 and leaves[0] is x and spec["seq"] == "tuple"
    leaves, spec = flatten_outputs(LazyDict(a=x))
    assert calls == [] and leaves == [x] and list(spec["dict"]) == ["a"]


def test_deeply_nested_outputs_are_bounded_on_both_sides():
    deep = torch.zeros(1)
    for _ in range(200):
        deep = [deep]
    with pytest.raises(ValueError, match="nested"):
        flatten_outputs(deep)
    junk = "leaf"
    for _ in range(5000):   # a forged spec from the child
        junk = {"seq": "list", "items": [junk]}
    assert same_structure(junk, "leaf") is False and "nested" in spec_summary(junk)


def test_output_headers_that_differ_are_not_materialised(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file
    path = str(tmp_path / "out.safetensors")
    save_file({"out0": torch.zeros(64, 64, dtype=torch.float64), "out1": torch.ones(3), "out2": torch.ones(8)}, path)
    ref = [torch.zeros(64, 64), torch.zeros(3)]
    with safe_open(path, framework="pt") as f:
        got = {k: _DeviceStage._read_tensor(f, k, ref) for k in f.keys()}
    assert got["out0"].is_meta and got["out0"].dtype == torch.float64   # wrong dtype: header only
    assert got["out2"].is_meta                                          # no reference leaf at that index
    assert not got["out1"].is_meta and torch.equal(got["out1"], torch.ones(3))


def test_a_deeply_nested_or_huge_message_is_a_protocol_error(tmp_path):
    code = "import os\nos.write(chan.fd, b'[' * 200000 + b'\\n')\n"
    work = tmp_path / "w"
    work.mkdir()
    child = SandboxedChild("probe", {"code": code}, VerifierConfig(), get_backend("cpu"), str(work), [])
    child.start()
    try:
        child.recv(time.monotonic() + 30)   # hello
        with pytest.raises(ProtocolError):
            child.recv(time.monotonic() + 30)
    finally:
        child.close()


# ------------------------------------------------------------------------------------ runtime judgement
def _profile(fn):
    with get_backend("cpu").profiler() as prof:
        fn()
    namespaces = {n.split("::")[0] for n in torch._C._dispatch_get_all_op_names()}
    return outermost_ops(prof.function_events, namespaces)


def test_ops_of_torchs_other_namespaces_are_forbidden():
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    ops, custom = _profile(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
    assert "mkldnn::_linear_pointwise" in forbidden_ops(ops) and not custom
    ops, _ = _profile(lambda: torch.ops.prims.maximum(x, x))
    assert "prims::maximum" in forbidden_ops(ops)
    ops, _ = _profile(lambda: (torch.empty_like(x), x.t().contiguous()))
    assert forbidden_ops(ops) == []


@pytest.mark.parametrize("report,kw,rule", [
    ({"aten_ops": {"item": 128, "select": 128}}, {"output_elements": 128}, "host_compute"),
    ({"threads_started": 1}, {"host_backend": True}, "background_work"),
    ({"background_cpu_ms": 250.0}, {"host_backend": True}, "background_work"),
    ({"native_calls": 0}, {"host_backend": True, "correct": True}, "no_native_kernel"),
    ({"violations": [{"rule": "harness_patch", "message": "replaced x"}]}, {}, "harness_patch"),
])
def test_runtime_reports_become_violations(report, kw, rule):
    assert rule in {r for r, _ in runtime_violations(report, **kw)}


@pytest.mark.parametrize("report,kw", [
    ({"aten_ops": {"item": 2}}, {"output_elements": 128}),                  # a few scalars: launch parameters
    ({"aten_ops": {"item": 500}}, {"output_elements": 1 << 20}),            # per-row values of a big output
    ({"native_calls": 0}, {"host_backend": True, "correct": False}),        # wrong anyway: a correctness error
    ({"native_calls": 0, "threads_started": 3}, {"host_backend": False}),   # GPU: device kernels decide
    ({"native_calls": 2, "background_cpu_ms": 1.5, "threads_started": 0}, {"host_backend": True, "correct": True}),
])
def test_honest_runtime_reports_are_not_violations(report, kw):
    assert runtime_violations(report, **kw) == []


def test_state_guard_restores_global_state_and_hooks():
    from verifier._child import StateGuard
    before = torch.is_grad_enabled()
    guard = StateGuard(torch)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: None)
    try:
        torch.set_grad_enabled(not before)
        torch.autograd.set_detect_anomaly(True)
        assert set(guard.check_and_restore()) >= {"grad_enabled", "anomaly_mode", "module_hooks"}
        assert guard.check_and_restore() == []
        assert torch.is_grad_enabled() == before and not torch.is_anomaly_enabled()
    finally:
        handle.remove()
        torch.set_grad_enabled(before)


def test_harness_guard_names_replaced_functions_and_class_attributes():
    import types

    from verifier._child import HarnessGuard
    mod = types.ModuleType("m")
    mod.f = lambda: 1

    class C:
        def g(self):
            return 1

    guard = HarnessGuard([mod], [C])
    assert guard.changed() == []
    mod.f = lambda: 2
    C.contiguous = lambda self: None
    assert set(guard.changed()) == {"m.f", f"{C.__module__}.{C.__qualname__}.contiguous"}


# ------------------------------------------------------------------------------------------ end to end
def run(task_name, response, cfg):
    return verify(load_task(task_path(task_name)), response, cfg)


def expect(result, category, rule=None):
    assert result.category == category, (result.category, result.rule, result.feedback,
                                         result.details.get("traceback"))
    if rule is not None:
        assert result.rule == rule, (result.rule, result.feedback)
    assert result.reward == -1.0 or category == Category.PASS


@pytest.mark.slow
def test_correct_kernel_passes_with_every_guard_armed(make_cfg):
    r = run("elementwise_add", compiled(ADD), make_cfg(num_timing_trials=8))   # more trials: steadier on 2 cores
    expect(r, Category.PASS)
    assert r.details["threads_started"] == 0 and abs(r.details["background_cpu_ms"]) < 10
    assert r.details["isolation"]["oom_score_adj"] in (True, False)


@pytest.mark.slow
def test_switching_to_pytorch_after_the_correctness_trials_is_caught(make_cfg):
    model = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return ext.relu(x) if self.calls <= 5 else torch.relu(x)
'''
    r = run("relu", compiled(model), make_cfg())
    expect(r, Category.CHEATING, "forbidden_op")
    assert "while being timed" in r.feedback and "aten::relu" in r.feedback


@pytest.mark.slow
def test_allowed_ops_alone_are_no_kernel_on_cpu(make_cfg):
    r = run("transpose", python_only("class ModelNew(nn.Module):\n    def forward(self, x):\n"
                                     "        return x.t().contiguous()\n"), make_cfg())
    expect(r, Category.CHEATING, "no_native_kernel")


@pytest.mark.slow
def test_a_lazy_tuple_subclass_does_not_compute_outside_the_profiler(make_cfg):
    body = '''
class Pair(tuple):
    def __iter__(self):
        x = self[0]
        return iter((torch.relu(x), x + 1.0))


class ModelNew(nn.Module):
    def forward(self, x):
        return Pair((x, x))
'''
    r = run("relu_pair", python_only(body), make_cfg())
    assert r.category in (Category.CHEATING, Category.CORRECTNESS_ERROR) and r.reward == -1.0, r.feedback


@pytest.mark.slow
def test_elementwise_item_loops_are_host_compute(make_cfg):
    body = '''
class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        flat, o = x.reshape(-1), out.view(-1)
        for i in range(flat.numel()):
            v = flat[i].item()
            o[i].fill_(v if v > 0 else 0.0)
        return out
'''
    r = run("relu_small", python_only(body), make_cfg())
    expect(r, Category.CHEATING, "host_compute")


@pytest.mark.slow
def test_other_namespace_ops_are_caught_when_the_private_api_rule_is_off(make_cfg):
    body = '''
class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.linear.weight, self.linear.bias, "none", [], "")
'''
    r = run("linear", python_only(body), make_cfg(enforce_policy_rules=False))
    expect(r, Category.CHEATING, "forbidden_op")
    assert "mkldnn::_linear_pointwise" in r.details["forbidden_ops"]


@pytest.mark.slow
def test_an_exception_whose_message_raises_is_still_a_runtime_error(make_cfg):
    body = '''
class Weird(Exception):
    def __str__(self):
        raise Weird()


class ModelNew(nn.Module):
    def forward(self, x):
        raise Weird()
'''
    r = run("relu_small", python_only(body), make_cfg())
    expect(r, Category.RUNTIME_ERROR)
    assert "Weird" in r.feedback and "ModelNew.forward" in r.feedback
