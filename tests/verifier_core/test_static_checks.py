"""Static rules: each hack class, including getattr/string/alias obfuscation, and legal candidates."""
import pytest

from verifier.config import VerifierConfig
from verifier.static_checks import POLICY_RULES, SECURITY_RULES, check_candidate, check_source, musa_portability_notes

from .candidates import ADD, HEADER

PRE = "import torch\nimport torch.nn as nn\n"
MODEL = "\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return x\n"


def rules(code, **kw):
    return {v.rule for v in check_source(code, **kw)}


def in_forward(stmt):
    return PRE + f"\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        {stmt}\n        return x\n"


LEGAL = [
    HEADER + ADD,
    PRE + "import torch.nn.functional as F\nimport math\nfrom typing import Optional\n" + MODEL,
    # Triton kernels are plain Python: allowed
    PRE + "import triton\nimport triton.language as tl\n\n@triton.jit\ndef k(x_ptr, n, BLOCK: tl.constexpr):\n"
          "    pid = tl.program_id(0)\n" + MODEL,
    # unused `import os` is boilerplate, not a violation
    PRE + "import os\n" + MODEL,
    # an autograd.Function wrapping a kernel, attribute writes on self/ctx, forward(self, input)
    PRE + "class F(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x):\n        ctx.n = x.numel()\n"
          "        return x\n\nclass ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
          "        self.scale = 2.0\n    def forward(self, input):\n        return F.apply(input)\n",
    # stream handles of the current stream are fine; creating streams is not
    in_forward("s = torch.cuda.current_stream().cuda_stream"),
]


@pytest.mark.parametrize("code", LEGAL)
def test_legal_candidates_pass(code):
    assert check_source(code) == []


CASES = [
    # reference model
    (PRE + "from __main__ import Model\n" + MODEL, "reference_model"),
    (PRE + "import kernel_task\n" + MODEL, "reference_model"),
    (PRE + "\nclass ModelNew(Model):\n    pass\n", "reference_model"),
    (PRE + "\nclass ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
           "        self.ref = Model()\n", "reference_model"),
    (PRE + "class Base:\n    pass\nclass ModelNew(Base):\n    pass\n", "reference_model"),
    (in_forward("m = getattr(torch, 'Model')"), "reference_model"),
    # files
    (in_forward("open('/etc/passwd').read()"), "file_access"),
    (PRE + "import pathlib\n" + MODEL, "file_access"),
    (PRE + "import shutil\n" + MODEL, "file_access"),
    (PRE + "import os\n" + in_forward("os.listdir('/')").split(PRE)[1], "file_access"),
    (in_forward("torch.save(x, 'x.pt')"), "file_access"),
    (in_forward("y = torch.load('x.pt')"), "file_access"),
    # network
    (PRE + "import socket\n" + MODEL, "network_access"),
    (PRE + "import urllib.request\n" + MODEL, "network_access"),
    (PRE + "import requests\n" + MODEL, "network_access"),
    # processes / threads
    (PRE + "import threading\n" + MODEL, "process_or_thread"),
    (PRE + "import multiprocessing as mp\n" + MODEL, "process_or_thread"),
    (PRE + "import subprocess\n" + MODEL, "process_or_thread"),
    (PRE + "from concurrent.futures import ThreadPoolExecutor\n" + MODEL, "process_or_thread"),
    (PRE + "import ctypes\n" + MODEL, "process_or_thread"),
    (PRE + "import os\n" + in_forward("os.system('ls')").split(PRE)[1], "file_access"),
    (in_forward("torch.multiprocessing.spawn(print)"), "process_or_thread"),
    # streams (attribute, getattr literal, from-import)
    (in_forward("s = torch.cuda.Stream()"), "stream_creation"),
    (in_forward("s = getattr(torch.cuda, 'Stream')()"), "stream_creation"),
    (PRE + "from torch.cuda import Stream\n" + MODEL, "stream_creation"),
    (in_forward("s = torch.musa.Stream()"), "stream_creation"),
    (in_forward("torch.cuda.set_stream(None)"), "stream_creation"),
    # patching
    (PRE + "import torch.nn.functional as F\nF.relu = lambda x: x\n" + MODEL, "monkey_patching"),
    (PRE + "T = torch.Tensor\nT.add = lambda *a: 0\n" + MODEL, "monkey_patching"),
    (PRE + "setattr(torch, 'relu', None)\n" + MODEL, "monkey_patching"),
    (PRE + "import time\ntime.perf_counter = lambda: 0.0\n" + MODEL, "monkey_patching"),
    (in_forward("torch.cuda.Event.elapsed_time = lambda *a: 0.001"), "monkey_patching"),
    (PRE + "import sys\nsys.modules['torch'] = None\n" + MODEL, "dynamic_code"),
    (PRE + "import builtins\n" + MODEL, "dynamic_code"),
    (in_forward("torch.backends.cuda.matmul.allow_tf32 = True"), "monkey_patching"),
    (in_forward("torch.manual_seed(0)"), "global_torch_state"),
    (in_forward("torch.set_float32_matmul_precision('high')"), "global_torch_state"),
    # dynamic code / introspection
    (in_forward("exec('x = 1')"), "dynamic_code"),
    (in_forward("y = eval('x')"), "dynamic_code"),
    (in_forward("c = compile('1', 's', 'eval')"), "dynamic_code"),
    (in_forward("m = __import__('os')"), "dynamic_code"),
    (PRE + "import importlib\n" + MODEL, "dynamic_code"),
    (PRE + "import inspect\n" + MODEL, "dynamic_code"),
    (PRE + "import gc\n" + MODEL, "dynamic_code"),
    (in_forward("y = getattr(torch, 'rel' + 'u')(x)"), "dynamic_code"),
    (in_forward("g = x.__class__.__subclasses__()"), "dynamic_code"),
    (in_forward("f = globals()"), "dynamic_code"),
    (PRE + "import functools\nf = functools.reduce(getattr, ['cuda', 'Stream'], torch)\n" + MODEL, "dynamic_code"),
    (PRE + "X = type('X', (object,), {})\n" + MODEL, "dynamic_code"),
    # tensor subclasses / modes (lazy outputs)
    (PRE + "class Lazy(torch.Tensor):\n    pass\n" + MODEL, "tensor_subclass"),
    (in_forward("y = torch.Tensor._make_subclass(torch.Tensor, x)"), "tensor_subclass"),
    (PRE + "from torch.overrides import TorchFunctionMode\n" + MODEL, "tensor_subclass"),
    (PRE + "lib = torch.library.Library('aten', 'IMPL')\n" + MODEL, "tensor_subclass"),
    # compilers and profiler probes
    (in_forward("y = torch.compile(torch.relu)(x)"), "torch_compiler"),
    (in_forward("y = torch.jit.script(torch.nn.ReLU())(x)"), "torch_compiler"),
    (in_forward("p = torch.autograd.profiler._is_profiler_enabled"), "profiler_probe"),
    # other libraries
    (PRE + "import numpy as np\n" + in_forward("y = np.exp(x.numpy())").split(PRE)[1], "library_fallback"),
    (PRE + "import cupy\n" + MODEL, "library_fallback"),
    # extension loading from files
    (in_forward("m = torch.utils.cpp_extension.load('k', ['k.cpp'])"), "extension_load_file"),
    (in_forward("torch.ops.load_library('/tmp/x.so')"), "extension_load_file"),
]


@pytest.mark.parametrize("code,rule", CASES)
def test_hack_classes_are_rejected(code, rule):
    found = rules(code)
    assert rule in found, found
    assert all(r in SECURITY_RULES or r in POLICY_RULES for r in found)


NATIVE_CASES = [
    ("cudaStream_t s; cudaStreamCreate(&s);", "stream_creation"),
    ("auto s = at::cuda::getStreamFromPool();", "stream_creation"),
    ("FILE* f = fopen(\"/tmp/x\", \"w\");", "file_access"),
    ("std::ofstream out(\"x\");", "file_access"),
    ("int fd = socket(2, 1, 0);", "network_access"),
    ("system(\"ls\");", "process_or_thread"),
    ("std::thread t([]{});", "process_or_thread"),
    ("#pragma omp parallel for\nfor(;;){}", "process_or_thread"),
    ("void* h = dlopen(\"libc.so.6\", 2);", "dynamic_code"),
    ("py::module_::import(\"os\");", "dynamic_code"),
    ("TORCH_LIBRARY_IMPL(aten, CPU, m) { }", "monkey_patching"),
    ("#define CAT(a,b) a##b", "native_source"),
]


@pytest.mark.parametrize("cpp,rule", NATIVE_CASES)
def test_native_source_rules(cpp, rule):
    code = (PRE + "from torch.utils.cpp_extension import load_inline\n"
            f"src = {cpp!r}\next = load_inline(name='k', cpp_sources=src, functions=['f'])\n" + MODEL)
    assert rule in rules(code)


def test_native_source_obfuscation_is_folded_or_rejected():
    base = PRE + "from torch.utils.cpp_extension import load_inline as li\n"
    # string concatenation through a name bound once is folded, then scanned
    folded = base + "a = 'cudaStream'\nsrc = a + 'Create(&s);'\next = li('k', src)\n" + MODEL
    assert "stream_creation" in rules(folded)
    # a computed source cannot be checked: rejected
    computed = base + "src = ''.join(reversed('x'))\next = li('k', src)\n" + MODEL
    assert "native_source" in rules(computed)
    # passing load_inline around is rejected
    aliased = base + "f = li\n" + MODEL
    assert "native_source" in rules(aliased)
    # injection through the functions list
    inject = base + "ext = li('k', 'int f(){return 0;}', functions=['f); system(\"ls\"); //'])\n" + MODEL
    assert "native_source" in rules(inject)


def test_policy_rules_can_be_switched_off_security_rules_cannot():
    code = in_forward("y = x\n        try:\n            y = x + 1\n        except Exception:\n            pass")
    assert "try_except" in {v.rule for v in check_candidate(code, VerifierConfig())}
    assert check_candidate(code, VerifierConfig(enforce_policy_rules=False)) == []
    assert check_candidate(code, VerifierConfig(disabled_rules=("try_except",))) == []
    imp = PRE + "import time\n" + MODEL
    assert {v.rule for v in check_candidate(imp, VerifierConfig())} == {"import_not_allowed"}
    assert check_candidate(imp, VerifierConfig(allowed_imports=("torch", "time"))) == []
    with pytest.raises(ValueError, match="security rule"):
        VerifierConfig(disabled_rules=("stream_creation",))
    with pytest.raises(ValueError, match="unknown rule"):
        VerifierConfig(disabled_rules=("no_such_rule",))


def test_security_violations_are_reported_first():
    code = PRE + "import time\ntime.perf_counter = lambda: 0.0\n" + MODEL
    v = check_source(code)
    assert v[0].rule == "monkey_patching" and v[0].line == 4
    assert "import_not_allowed" in {x.rule for x in v}


def test_musa_notes_flag_hard_coded_warp_width():
    code = (PRE + "from torch.utils.cpp_extension import load_inline\n"
            "src = 'v += __shfl_down_sync(0xffffffff, v, 16); int lane = threadIdx.x % 32;'\n"
            "ext = load_inline(name='k', cpp_sources='', cuda_sources=src)\n" + MODEL)
    notes = musa_portability_notes(code)
    assert notes and "128" in notes[0] and "0xffffffff" in notes[0] and "% 32" in notes[0]
    assert musa_portability_notes(HEADER + ADD) == []


# match statements read attributes (class patterns) and keys (mapping patterns) without Attribute/Subscript nodes
@pytest.mark.parametrize("code,rule", [
    (PRE + "def f():\n    pass\nmatch f:\n    case object(__globals__=g):\n        pass\n" + MODEL, "dynamic_code"),
    (in_forward("match x:\n            case object(numpy=f):\n                x = torch.from_numpy(f())"),
     "host_compute"),
    (PRE + "def f(g):\n    match g:\n        case {'exec': run}:\n            run('1')\n" + MODEL, "dynamic_code"),
    (PRE + "def f(g):\n    match g:\n        case {'__builtins__': b}:\n            return b\n" + MODEL, "dynamic_code"),
    (PRE + "def f(b):\n    match b:\n        case object(exec=run):\n            run('1')\n" + MODEL, "dynamic_code"),
    # the same names read by subscript or dict method, and attribute names handed to positional class patterns
    (PRE + "def f(g):\n    return g['__builtins__']\n" + MODEL, "dynamic_code"),
    (PRE + "def f(g):\n    return g.get('exec')\n" + MODEL, "dynamic_code"),
    (PRE + "class C:\n    __match_args__ = ('__globals__',)\n" + MODEL, "dynamic_code"),
    (PRE + "N = ''.join(['__glo', 'bals__'])\nclass C:\n    __match_args__ = (N.strip(),)\n" + MODEL, "dynamic_code"),
])
def test_match_patterns_are_held_to_the_attribute_and_key_rules(code, rule):
    found = rules(code)
    assert rule in found, found


def test_ordinary_match_statements_and_keys_pass():
    code = PRE + ("class P:\n    __match_args__ = ('x', 'y')\n    def __init__(self):\n        self.x, self.y = 1, 2\n"
                  "def f(o, d):\n    match o:\n        case P(a, b):\n            return a + b\n"
                  "        case torch.Tensor(shape=s, dtype=t):\n            return s\n"
                  "    match d:\n        case {'weight': w, 'input': i}:\n            return d['input'] + d.get('bias', 0)\n"
                  + MODEL)
    assert check_source(code) == [], [str(v) for v in check_source(code)]
