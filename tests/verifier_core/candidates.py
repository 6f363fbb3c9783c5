"""Candidate sources for the end-to-end red-team tests.

Every compiled candidate loads the same C++ library with identical ``load_inline`` arguments, so the
verifier's extension cache compiles it once for the whole suite; the candidates differ only in Python
(which kernel they call and what they do around it). The library holds correct CPU kernels and the
native building blocks of the hacks (ATen calls from C++, a null write, a kernel that scribbles on its
inputs).
"""
import os

TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")


def task_path(name: str) -> str:
    return os.path.join(TASKS, f"{name}.py")


KERNELS_CPP = r'''
#include <cstdint>

static void expect_f32(const torch::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == torch::kFloat32, "expected a contiguous float32 tensor");
}

torch::Tensor add(torch::Tensor a, torch::Tensor b) {
  expect_f32(a); expect_f32(b);
  auto out = torch::empty_like(a);
  const float* x = a.data_ptr<float>(); const float* y = b.data_ptr<float>(); float* o = out.data_ptr<float>();
  for (int64_t i = 0, n = a.numel(); i < n; ++i) o[i] = x[i] + y[i];
  return out;
}

torch::Tensor relu(torch::Tensor a) {
  expect_f32(a);
  auto out = torch::empty_like(a);
  const float* x = a.data_ptr<float>(); float* o = out.data_ptr<float>();
  for (int64_t i = 0, n = a.numel(); i < n; ++i) o[i] = x[i] > 0.f ? x[i] : 0.f;
  return out;
}

// out = a * b + c where b and c have the size of a's last dimension (or a's full size); optional relu
torch::Tensor mul_add(torch::Tensor a, torch::Tensor b, torch::Tensor c, bool apply_relu) {
  expect_f32(a); expect_f32(b); expect_f32(c);
  auto out = torch::empty_like(a);
  const float* x = a.data_ptr<float>(); const float* w = b.data_ptr<float>(); const float* s = c.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t n = a.numel(), m = b.numel();
  for (int64_t i = 0; i < n; ++i) {
    float v = x[i] * w[i % m] + s[i % m];
    o[i] = (apply_relu && v < 0.f) ? 0.f : v;
  }
  return out;
}

torch::Tensor aten_relu(torch::Tensor a) { return at::relu(a); }

torch::Tensor aten_addmm(torch::Tensor bias, torch::Tensor x, torch::Tensor weight) {
  return at::addmm(bias, x, weight.t());
}

torch::Tensor crash(torch::Tensor a) {
  volatile float* p = nullptr;
  p[a.numel() % 7] = 1.0f;
  return a;
}

// out-parameter style: writes a + b into `out`
void add_out(torch::Tensor a, torch::Tensor b, torch::Tensor out) {
  expect_f32(a); expect_f32(b); expect_f32(out);
  const float* x = a.data_ptr<float>(); const float* y = b.data_ptr<float>(); float* o = out.data_ptr<float>();
  for (int64_t i = 0, n = a.numel(); i < n; ++i) o[i] = x[i] + y[i];
}

torch::Tensor transpose2d(torch::Tensor a) {
  expect_f32(a);
  const int64_t r = a.size(0), c = a.size(1);
  auto out = torch::empty({c, r}, a.options());
  const float* x = a.data_ptr<float>(); float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) o[j * r + i] = x[i * c + j];
  return out;
}

// per-row sum of squares, accumulated in double (an honest float32 answer)
torch::Tensor row_sumsq(torch::Tensor a) {
  expect_f32(a);
  const int64_t r = a.size(0), c = a.size(1);
  auto out = torch::empty({r}, a.options());
  const float* x = a.data_ptr<float>(); float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < r; ++i) {
    double s = 0.0;
    for (int64_t j = 0; j < c; ++j) s += (double)x[i * c + j] * x[i * c + j];
    o[i] = (float)s;
  }
  return out;
}

torch::Tensor finish(torch::Tensor a) { return a; }   // hands back the tensor it was given

// in place, returning its argument
torch::Tensor relu_inplace(torch::Tensor a) {
  expect_f32(a);
  float* x = a.data_ptr<float>();
  for (int64_t i = 0, n = a.numel(); i < n; ++i) x[i] = x[i] > 0.f ? x[i] : 0.f;
  return a;
}

torch::Tensor add_then_zero_inputs(torch::Tensor a, torch::Tensor b) {
  auto out = ::add(a, b);
  float* x = a.data_ptr<float>();
  for (int64_t i = 0, n = a.numel(); i < n; ++i) x[i] = 0.f;
  return out;
}
'''

FUNCTIONS = ["add", "relu", "mul_add", "aten_relu", "aten_addmm", "crash", "add_then_zero_inputs", "add_out",
             "transpose2d", "row_sumsq", "finish", "relu_inplace"]

HEADER = f'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

KERNELS = r"""{KERNELS_CPP}"""

ext = load_inline(name="vc_kernels", cpp_sources=KERNELS, functions={FUNCTIONS!r}, extra_cflags=["-O2"])
'''


def compiled(model_new: str, prelude: str = "") -> str:
    """A candidate using the shared kernel library, as a markdown model response."""
    return f"Here is my kernel.\n\n```python\n{HEADER}\n{prelude}\n{model_new}\n```\n"


def python_only(body: str) -> str:
    """A candidate without native code (its build is skipped)."""
    return "```python\nimport torch\nimport torch.nn as nn\n\n" + body + "\n```\n"


ADD = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return ext.add(a, b)
'''

RELU = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return ext.relu(x)
'''

FUSED = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b, c):
        return ext.mul_add(a, b, c, True)
'''

# parameters created in the opposite order from the reference: only state_dict loading makes it correct
SCALE_SHIFT_REORDERED = '''
class ModelNew(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(features))
        self.weight = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return ext.mul_add(x, self.weight, self.bias, False)
'''


def calling(expr: str, args: str = "a, b") -> str:
    return f'''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, {args}):
        return {expr}
'''
