"""Honest candidates must pass the static checks: a corpus of realistic KernelBench-style answers.

A rule that rejects an ordinary, correct kernel as ``cheating`` gives a good answer reward -1 and poisons RL
training just like a missed hack. Each candidate below is written the way LLMs actually answer KernelBench
(``class ModelNew(nn.Module)`` + ``load_inline``, Triton, torch_musa), with the boilerplate they carry: CHECK_*
macros, AT_DISPATCH, launch checks, warp shuffles, float4 loads, printf debugging, pybind modules, nn.Linear /
nn.Conv2d kept only to own the weights, unused imports, docstrings that mention os/exec/threads/streams, a
``__main__`` smoke test. Static only: nothing is compiled, the whole file runs in about a second.

The second half pins the holes closed while this corpus was made (so the fixes for false positives did not
reopen anything) and the feedback the model reads for constructs that stay forbidden.
"""
import pytest
import torch

from verifier.config import VerifierConfig
from verifier.native_checks import native_findings, scan_native
from verifier.static_checks import check_candidate, check_source

# ---------------------------------------------------------------------------------------- CUDA: elementwise
C01_ELEMENTWISE_ADD = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# Define the custom CUDA kernel for element-wise addition
elementwise_add_source = """
#include <torch/extension.h>
#include <cuda_runtime.h>

__global__ void elementwise_add_kernel(const float* a, const float* b, float* out, int size) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < size) {
        out[idx] = a[idx] + b[idx];
    }
}

torch::Tensor elementwise_add_cuda(torch::Tensor a, torch::Tensor b) {
    auto size = a.numel();
    auto out = torch::zeros_like(a);

    const int block_size = 256;
    const int num_blocks = (size + block_size - 1) / block_size;

    elementwise_add_kernel<<<num_blocks, block_size>>>(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), size);

    return out;
}
"""

elementwise_add_cpp_source = (
    "torch::Tensor elementwise_add_cuda(torch::Tensor a, torch::Tensor b);"
)

# Compile the inline CUDA code for element-wise addition
elementwise_add = load_inline(
    name="elementwise_add",
    cpp_sources=elementwise_add_cpp_source,
    cuda_sources=elementwise_add_source,
    functions=["elementwise_add_cuda"],
    verbose=True,
    extra_cflags=[""],
    extra_ldflags=[""],
)


class ModelNew(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.elementwise_add = elementwise_add

    def forward(self, a, b):
        return self.elementwise_add.elementwise_add_cuda(a, b)
'''

C02_RELU_DISPATCH = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_src = r"""
#include <torch/extension.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#define CHECK_CUDA(x) TORCH_CHECK(x.is_cuda(), #x " must be a CUDA tensor")
#define CHECK_CONTIGUOUS(x) TORCH_CHECK(x.is_contiguous(), #x " must be contiguous")
#define CHECK_INPUT(x) CHECK_CUDA(x); CHECK_CONTIGUOUS(x)

template <typename scalar_t>
__global__ void relu_kernel(const scalar_t* __restrict__ input, scalar_t* __restrict__ output, int64_t size) {
    const int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const int64_t stride = (int64_t)blockDim.x * gridDim.x;
    for (int64_t i = idx; i < size; i += stride) {
        scalar_t v = input[i];
        output[i] = v > scalar_t(0) ? v : scalar_t(0);
    }
}

torch::Tensor relu_forward(torch::Tensor input) {
    CHECK_INPUT(input);
    const at::cuda::OptionalCUDAGuard device_guard(device_of(input));
    auto output = torch::empty_like(input);
    const int64_t size = input.numel();
    const int threads = 256;
    const int blocks = std::min<int64_t>((size + threads - 1) / threads, 65535);
    cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND_HALF(input.scalar_type(), "relu_forward_cuda", ([&] {
        relu_kernel<scalar_t><<<blocks, threads, 0, stream>>>(
            input.data_ptr<scalar_t>(), output.data_ptr<scalar_t>(), size);
    }));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return output;
}
"""

cpp_src = "torch::Tensor relu_forward(torch::Tensor input);"

relu_ext = load_inline(
    name="relu_ext",
    cpp_sources=cpp_src,
    cuda_sources=cuda_src,
    functions=["relu_forward"],
    with_cuda=True,
    extra_cuda_cflags=["-O3", "--use_fast_math"],
    verbose=False,
)


class ModelNew(nn.Module):
    """ReLU with a custom CUDA kernel (the original used torch.relu)."""

    def __init__(self):
        super(ModelNew, self).__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu_ext.relu_forward(x.contiguous())
'''

C03_GELU_HALF_BF16 = r'''import math
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

gelu_cuda_source = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <ATen/cuda/CUDAContext.h>

__device__ __forceinline__ float gelu_f(float x) {
    const float kAlpha = 0.7978845608028654f;  // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanhf(kAlpha * (x + 0.044715f * x * x * x)));
}

template <typename T>
__global__ void gelu_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) {
        float v = static_cast<float>(x[i]);
        y[i] = static_cast<T>(gelu_f(v));
    }
}

torch::Tensor gelu_cuda(torch::Tensor x) {
    TORCH_CHECK(x.device().is_cuda(), "x must be on CUDA, got ", x.device());
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    int64_t n = xc.numel();
    if (n == 0) return y;
    constexpr int kThreads = 512;
    const int blocks = static_cast<int>((n + kThreads - 1) / kThreads);
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, xc.scalar_type(), "gelu_cuda", [&] {
        gelu_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(xc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), n);
    });
    cudaError_t err = cudaGetLastError();
    TORCH_CHECK(err == cudaSuccess, "gelu kernel launch failed: ", cudaGetErrorString(err));
    return y;
}
"""

gelu_cpp_source = "torch::Tensor gelu_cuda(torch::Tensor x);"

gelu_module = load_inline(
    name="gelu_tanh",
    cpp_sources=[gelu_cpp_source],
    cuda_sources=[gelu_cuda_source],
    functions=["gelu_cuda"],
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3", "--use_fast_math", "-lineinfo", "-arch=sm_90", "-Xptxas=-v", "-std=c++17", "-DNDEBUG"],
    verbose=True,
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        # tanh approximation constant, sqrt(2 / pi); the kernel hard-codes it as well
        self.k = math.sqrt(2.0 / math.pi)

    def forward(self, x):
        return gelu_module.gelu_cuda(x)
'''

C04_FLOAT4_SIGMOID = r'''import torch
import torch.nn as nn
import torch.nn.functional as F  # only used for reference in comments: F.sigmoid
from torch.utils.cpp_extension import load_inline

sigmoid_source = """
#include <torch/extension.h>
#include <cuda_runtime.h>

// Vectorised sigmoid: each thread handles 4 floats through a float4 load.
__global__ void sigmoid_vec4_kernel(const float4* __restrict__ in, float4* __restrict__ out, int64_t n4) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n4) {
        float4 v = in[i];
        v.x = 1.f / (1.f + __expf(-v.x));
        v.y = 1.f / (1.f + __expf(-v.y));
        v.z = 1.f / (1.f + __expf(-v.z));
        v.w = 1.f / (1.f + __expf(-v.w));
        out[i] = v;
    }
}

__global__ void sigmoid_tail_kernel(const float* __restrict__ in, float* __restrict__ out, int64_t start, int64_t n) {
    int64_t i = start + blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = 1.f / (1.f + expf(-in[i]));
}

torch::Tensor sigmoid_cuda(torch::Tensor x) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "only float32 is supported");
    x = x.contiguous();
    auto out = torch::empty(x.sizes(), x.options());
    const int64_t n = x.numel();
    const int64_t n4 = n / 4;
    const int threads = 256;
    if (n4 > 0) {
        int blocks = (int)((n4 + threads - 1) / threads);
        sigmoid_vec4_kernel<<<blocks, threads>>>(reinterpret_cast<const float4*>(x.data_ptr<float>()),
                                                 reinterpret_cast<float4*>(out.data_ptr<float>()), n4);
    }
    const int64_t rem = n - n4 * 4;
    if (rem > 0) {
        sigmoid_tail_kernel<<<1, threads>>>(x.data_ptr<float>(), out.data_ptr<float>(), n4 * 4, n);
    }
    return out;
}
"""

sigmoid_cpp = "torch::Tensor sigmoid_cuda(torch::Tensor x);"

sigmoid_ext = load_inline(name="sigmoid_vec4", cpp_sources=sigmoid_cpp, cuda_sources=sigmoid_source,
                          functions=["sigmoid_cuda"], verbose=False, extra_cuda_cflags=["-O3"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        # same as torch.sigmoid(x), but through our kernel
        return sigmoid_ext.sigmoid_cuda(x)
'''

C05_PRINTF_DEBUG = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>
#include <cstdio>

#define DEBUG_KERNEL 0

__global__ void leaky_relu_kernel(const float* x, float* y, float slope, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
#if DEBUG_KERNEL
    if (i == 0) printf("leaky_relu: n=%d slope=%f thread %d of block %d\n", n, slope, threadIdx.x, blockIdx.x);
#endif
    if (i < n) {
        float v = x[i];
        y[i] = v >= 0.f ? v : v * slope;
    }
}

torch::Tensor leaky_relu(torch::Tensor x, double negative_slope) {
    auto y = torch::empty_like(x);
    int n = x.numel();
    int threads = 1024;
    int blocks = (n + threads - 1) / threads;
    leaky_relu_kernel<<<blocks, threads>>>(x.data_ptr<float>(), y.data_ptr<float>(), (float)negative_slope, n);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        printf("CUDA error in leaky_relu: %s\n", cudaGetErrorString(err));
    }
    return y;
}
"""

cpp_source = "torch::Tensor leaky_relu(torch::Tensor x, double negative_slope);"

leaky = load_inline(
    name="leaky_relu_ext",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["leaky_relu"],
    verbose=True,
)


class ModelNew(nn.Module):
    def __init__(self, negative_slope: float = 0.01):
        super(ModelNew, self).__init__()
        self.negative_slope = negative_slope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.is_cuda, "input must live on the GPU"
        return leaky.leaky_relu(x.contiguous(), self.negative_slope)
'''

C06_PYBIND_CUSTOM = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# The module is defined with an explicit PYBIND11_MODULE, so functions=None.
source = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void swish_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float v = x[i];
        y[i] = v / (1.0f + expf(-v));
    }
}

torch::Tensor swish_forward(const torch::Tensor& x) {
    TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
    TORCH_CHECK(x.dtype() == torch::kFloat, "x must be float32");
    auto y = torch::empty_like(x);
    const int64_t n = x.numel();
    const int threads = 256;
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const int blocks = std::max(1, std::min((int)((n + threads - 1) / threads), sms * 8));
    swish_kernel<<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("forward", &swish_forward, "Swish forward (CUDA)", py::arg("x"));
}
"""

swish = load_inline(name="swish_cuda", cpp_sources="", cuda_sources=source, functions=None, verbose=False)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return swish.forward(x)
'''

C07_SCALAR_MUL_STRIDES = r'''import torch
import torch.nn as nn
from typing import List, Optional, Tuple
from torch.utils.cpp_extension import load_inline

scale_cuda_src = """
#include <torch/extension.h>

__global__ void scale_2d_kernel(const float* __restrict__ a, float* __restrict__ out,
                                int64_t rows, int64_t cols, int64_t stride0, int64_t stride1, float s) {
    int64_t r = blockIdx.y * blockDim.y + threadIdx.y;
    int64_t c = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows && c < cols) {
        out[r * cols + c] = a[r * stride0 + c * stride1] * s;
    }
}

torch::Tensor scale_2d(torch::Tensor a, double s) {
    TORCH_CHECK(a.dim() == 2, "expected a 2D tensor, got ", a.dim(), "D");
    const int64_t rows = a.size(0), cols = a.size(1);
    auto out = torch::empty({rows, cols}, a.options());
    dim3 threads(32, 8);
    dim3 blocks((cols + threads.x - 1) / threads.x, (rows + threads.y - 1) / threads.y);
    scale_2d_kernel<<<blocks, threads>>>(a.data_ptr<float>(), out.data_ptr<float>(), rows, cols,
                                         a.stride(0), a.stride(1), static_cast<float>(s));
    return out;
}
"""

scale_cpp_src = "torch::Tensor scale_2d(torch::Tensor a, double s);"

scale_ext = load_inline(
    name="scale_2d_ext",
    cpp_sources=scale_cpp_src,
    cuda_sources=scale_cuda_src,
    functions=["scale_2d"],
    extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr"],
)


def _as_2d(x: torch.Tensor) -> Tuple[torch.Tensor, List[int]]:
    """Flatten all leading dims so the kernel sees a matrix."""
    shape = list(x.shape)
    return x.reshape(-1, shape[-1]), shape


class ModelNew(nn.Module):
    def __init__(self, scale: Optional[float] = None):
        super().__init__()
        self.scale = 2.0 if scale is None else float(scale)

    def forward(self, A: torch.Tensor, s: float) -> torch.Tensor:
        a2, shape = _as_2d(A)
        out = scale_ext.scale_2d(a2, float(s))
        return out.view(shape)
'''


# ---------------------------------------------------------------------------------------- CUDA: reductions
C08_SUM_REDUCTION_SHFL = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

reduce_src = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <ATen/cuda/CUDAContext.h>

#define WARP_SIZE 32

__inline__ __device__ float warp_reduce_sum(float val) {
    #pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2)
        val += __shfl_down_sync(0xffffffff, val, offset);
    return val;
}

// one block per row: sum over the last dimension
__global__ void row_sum_kernel(const float* __restrict__ x, float* __restrict__ out, int rows, int cols) {
    __shared__ float shared[32];
    int row = blockIdx.x;
    int tid = threadIdx.x;
    int lane = tid % WARP_SIZE;
    int wid = tid / WARP_SIZE;
    const float* xr = x + (size_t)row * cols;
    float sum = 0.0f;
    for (int c = tid; c < cols; c += blockDim.x) sum += xr[c];
    sum = warp_reduce_sum(sum);
    if (lane == 0) shared[wid] = sum;
    __syncthreads();
    sum = (tid < blockDim.x / WARP_SIZE) ? shared[lane] : 0.0f;
    if (wid == 0) sum = warp_reduce_sum(sum);
    if (tid == 0) out[row] = sum;
}

torch::Tensor row_sum(torch::Tensor x) {
    TORCH_CHECK(x.dim() == 2, "x must be 2D");
    auto xc = x.contiguous();
    const int rows = xc.size(0), cols = xc.size(1);
    auto out = torch::empty({rows, 1}, xc.options());
    const int threads = 256;
    row_sum_kernel<<<rows, threads, 0, at::cuda::getCurrentCUDAStream()>>>(xc.data_ptr<float>(), out.data_ptr<float>(), rows, cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
}
"""

reduce_cpp = "torch::Tensor row_sum(torch::Tensor x);"

row_sum_ext = load_inline(name="row_sum_ext", cpp_sources=reduce_cpp, cuda_sources=reduce_src,
                          functions=["row_sum"], verbose=False,
                          extra_cuda_cflags=["-O3", "--use_fast_math"])


class ModelNew(nn.Module):
    """Sum reduction over dim=-1 with keepdim=True."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # move the reduced dim last, flatten the rest, reduce, restore the shape
        xt = x.transpose(self.dim, -1).contiguous()
        shape = xt.shape
        out = row_sum_ext.row_sum(xt.reshape(-1, shape[-1]))
        return out.view(*shape[:-1], 1).transpose(self.dim, -1)
'''

C09_ATOMIC_GLOBAL_SUM = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

mse_cuda = """
#include <torch/extension.h>

__global__ void sq_diff_sum_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                   float* __restrict__ acc, int64_t n) {
    extern __shared__ float sdata[];
    int tid = threadIdx.x;
    int64_t i = blockIdx.x * (int64_t)blockDim.x + tid;
    float v = 0.f;
    for (; i < n; i += (int64_t)blockDim.x * gridDim.x) {
        float d = a[i] - b[i];
        v += d * d;
    }
    sdata[tid] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) sdata[tid] += sdata[tid + s];
        __syncthreads();
    }
    if (tid == 0) atomicAdd(acc, sdata[0]);
}

__global__ void divide_kernel(float* acc, float denom) { *acc = *acc / denom; }

torch::Tensor mse_loss_cuda(torch::Tensor predictions, torch::Tensor targets) {
    TORCH_CHECK(predictions.sizes() == targets.sizes(), "shape mismatch");
    auto p = predictions.contiguous();
    auto t = targets.contiguous();
    auto acc = torch::zeros({1}, p.options());
    const int64_t n = p.numel();
    const int threads = 512;
    const int blocks = (int)std::min<int64_t>((n + threads - 1) / threads, 1024);
    sq_diff_sum_kernel<<<blocks, threads, threads * sizeof(float)>>>(p.data_ptr<float>(), t.data_ptr<float>(),
                                                                     acc.data_ptr<float>(), n);
    divide_kernel<<<1, 1>>>(acc.data_ptr<float>(), (float)n);
    return acc.squeeze(0);
}
"""

mse_cpp = "torch::Tensor mse_loss_cuda(torch::Tensor predictions, torch::Tensor targets);"

mse_ext = load_inline(name="mse_loss", cpp_sources=mse_cpp, cuda_sources=mse_cuda, functions=["mse_loss_cuda"])


class ModelNew(nn.Module):
    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, predictions, targets):
        if self.reduction != "mean":
            raise ValueError(f"unsupported reduction {self.reduction!r}")
        return mse_ext.mse_loss_cuda(predictions, targets)
'''

C10_SOFTMAX_TWO_REDUCTIONS = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

softmax_source = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <ATen/cuda/CUDAContext.h>
#include <cfloat>

template <int BLOCK>
__device__ float block_reduce_max(float v, float* smem) {
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, off));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    v = (threadIdx.x < BLOCK / 32) ? smem[lane] : -FLT_MAX;
    if (warp == 0)
        for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, off));
    if (threadIdx.x == 0) smem[0] = v;
    __syncthreads();
    v = smem[0];
    __syncthreads();
    return v;
}

template <int BLOCK>
__device__ float block_reduce_sum(float v, float* smem) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffff, v, off);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    v = (threadIdx.x < BLOCK / 32) ? smem[lane] : 0.f;
    if (warp == 0)
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffff, v, off);
    if (threadIdx.x == 0) smem[0] = v;
    __syncthreads();
    v = smem[0];
    __syncthreads();
    return v;
}

template <int BLOCK>
__global__ void softmax_kernel(const float* __restrict__ x, float* __restrict__ y, int cols) {
    __shared__ float smem[32];
    const float* row = x + (size_t)blockIdx.x * cols;
    float* out = y + (size_t)blockIdx.x * cols;
    float m = -FLT_MAX;
    for (int c = threadIdx.x; c < cols; c += BLOCK) m = fmaxf(m, row[c]);
    m = block_reduce_max<BLOCK>(m, smem);
    float s = 0.f;
    for (int c = threadIdx.x; c < cols; c += BLOCK) s += __expf(row[c] - m);
    s = block_reduce_sum<BLOCK>(s, smem);
    const float inv = 1.f / s;
    for (int c = threadIdx.x; c < cols; c += BLOCK) out[c] = __expf(row[c] - m) * inv;
}

torch::Tensor softmax_cuda(torch::Tensor x) {
    TORCH_CHECK(x.is_cuda() && x.dim() == 2, "softmax_cuda expects a 2D CUDA tensor");
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    constexpr int kBlock = 1024;
    softmax_kernel<kBlock><<<xc.size(0), kBlock, 0, at::cuda::getCurrentCUDAStream()>>>(
        xc.data_ptr<float>(), y.data_ptr<float>(), (int)xc.size(1));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}
"""

softmax_cpp_source = "torch::Tensor softmax_cuda(torch::Tensor x);"

softmax_module = load_inline(
    name="softmax_two_pass",
    cpp_sources=softmax_cpp_source,
    cuda_sources=softmax_source,
    functions=["softmax_cuda"],
    verbose=True,
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3", "--use_fast_math", "-lineinfo"],
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Row softmax (dim=1). Stream: the kernel runs on torch's current stream."""
        return softmax_module.softmax_cuda(x)
'''

C11_LAYERNORM_WELFORD = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

layernorm_cuda_source = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

struct Welford {
    float mean, m2, count;
};

__device__ __forceinline__ Welford welford_merge(Welford a, Welford b) {
    float count = a.count + b.count;
    if (count == 0.f) return {0.f, 0.f, 0.f};
    float delta = b.mean - a.mean;
    float nb_over_n = b.count / count;
    return {a.mean + delta * nb_over_n, a.m2 + b.m2 + delta * delta * a.count * nb_over_n, count};
}

__global__ void layernorm_kernel(const float* __restrict__ x, const float* __restrict__ gamma,
                                 const float* __restrict__ beta, float* __restrict__ y, int N, float eps) {
    __shared__ Welford shared[32];
    const float* xr = x + (size_t)blockIdx.x * N;
    float* yr = y + (size_t)blockIdx.x * N;
    Welford w = {0.f, 0.f, 0.f};
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        float v = xr[i];
        w.count += 1.f;
        float d = v - w.mean;
        w.mean += d / w.count;
        w.m2 += d * (v - w.mean);
    }
    #pragma unroll
    for (int off = 16; off > 0; off /= 2) {
        Welford o;
        o.mean = __shfl_down_sync(0xffffffff, w.mean, off);
        o.m2 = __shfl_down_sync(0xffffffff, w.m2, off);
        o.count = __shfl_down_sync(0xffffffff, w.count, off);
        w = welford_merge(w, o);
    }
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) shared[warp] = w;
    __syncthreads();
    if (warp == 0) {
        w = (lane < (int)(blockDim.x / 32)) ? shared[lane] : Welford{0.f, 0.f, 0.f};
        for (int off = 16; off > 0; off /= 2) {
            Welford o;
            o.mean = __shfl_down_sync(0xffffffff, w.mean, off);
            o.m2 = __shfl_down_sync(0xffffffff, w.m2, off);
            o.count = __shfl_down_sync(0xffffffff, w.count, off);
            w = welford_merge(w, o);
        }
        if (lane == 0) shared[0] = w;
    }
    __syncthreads();
    const float mean = shared[0].mean;
    const float rstd = rsqrtf(shared[0].m2 / N + eps);
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        yr[i] = (xr[i] - mean) * rstd * gamma[i] + beta[i];
    }
}

torch::Tensor layernorm_forward(torch::Tensor x, torch::Tensor gamma, torch::Tensor beta, double eps) {
    const c10::cuda::CUDAGuard guard(x.device());
    const int N = gamma.numel();
    auto x2 = x.contiguous().view({-1, N});
    auto y = torch::empty_like(x2);
    layernorm_kernel<<<x2.size(0), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        x2.data_ptr<float>(), gamma.data_ptr<float>(), beta.data_ptr<float>(), y.data_ptr<float>(), N, (float)eps);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y.view(x.sizes());
}
"""

layernorm_cpp_source = "torch::Tensor layernorm_forward(torch::Tensor x, torch::Tensor gamma, torch::Tensor beta, double eps);"

layernorm_ext = load_inline(
    name="layernorm_welford",
    cpp_sources=layernorm_cpp_source,
    cuda_sources=layernorm_cuda_source,
    functions=["layernorm_forward"],
    extra_cuda_cflags=["-O3", "-std=c++17"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self, normalized_shape: tuple):
        super().__init__()
        # keep nn.LayerNorm only to own the affine parameters (same init as the reference)
        self.ln = nn.LayerNorm(normalized_shape=normalized_shape)
        self.eps = self.ln.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layernorm_ext.layernorm_forward(x, self.ln.weight.flatten(), self.ln.bias.flatten(), self.eps)
'''

C12_MATMUL_BIAS_GELU_TILED = r'''import math
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

TILE = 32

fused_source = f"""
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <ATen/cuda/CUDAContext.h>

#define TILE {TILE}

__device__ __forceinline__ float gelu_erf(float x) {{
    return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
}}

// y = gelu(x @ W^T + b), x: [M, K], W: [N, K]
__global__ void linear_bias_gelu_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                        const float* __restrict__ b, float* __restrict__ y,
                                        int M, int N, int K) {{
    __shared__ float xs[TILE][TILE];
    __shared__ float ws[TILE][TILE + 1];
    int row = blockIdx.y * TILE + threadIdx.y;
    int col = blockIdx.x * TILE + threadIdx.x;
    float acc = 0.f;
    for (int t = 0; t < (K + TILE - 1) / TILE; ++t) {{
        int kx = t * TILE + threadIdx.x;
        int kw = t * TILE + threadIdx.y;
        xs[threadIdx.y][threadIdx.x] = (row < M && kx < K) ? x[(size_t)row * K + kx] : 0.f;
        ws[threadIdx.y][threadIdx.x] = (col < N && kw < K) ? w[(size_t)col * K + kw] : 0.f;
        __syncthreads();
        #pragma unroll
        for (int k = 0; k < TILE; ++k) acc += xs[threadIdx.y][k] * ws[k][threadIdx.x];
        __syncthreads();
    }}
    if (row < M && col < N) y[(size_t)row * N + col] = gelu_erf(acc + b[col]);
}}

torch::Tensor linear_bias_gelu(torch::Tensor x, torch::Tensor w, torch::Tensor b) {{
    TORCH_CHECK(x.is_cuda() && w.is_cuda() && b.is_cuda(), "all inputs must be CUDA tensors");
    const int M = x.size(0), K = x.size(1), N = w.size(0);
    TORCH_CHECK(w.size(1) == K, "weight has ", w.size(1), " columns, expected ", K);
    auto y = torch::empty({{M, N}}, x.options());
    dim3 block(TILE, TILE);
    dim3 grid((N + TILE - 1) / TILE, (M + TILE - 1) / TILE);
    linear_bias_gelu_kernel<<<grid, block, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.contiguous().data_ptr<float>(), w.contiguous().data_ptr<float>(), b.contiguous().data_ptr<float>(),
        y.data_ptr<float>(), M, N, K);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}}
"""

fused_cpp = "torch::Tensor linear_bias_gelu(torch::Tensor x, torch::Tensor w, torch::Tensor b);"

fused_op = load_inline(
    name="fused_op",
    cpp_sources=fused_cpp,
    cuda_sources=fused_source,
    functions=["linear_bias_gelu"],
    verbose=True,
    extra_cuda_cflags=["-O3", "--use_fast_math"],
)


class ModelNew(nn.Module):
    """Linear + GELU fused. Instead of torch.matmul followed by F.gelu we run one tiled kernel."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)  # owns weight and bias (same init as the reference)

    def forward(self, x):
        return fused_op.linear_bias_gelu(x, self.linear.weight, self.linear.bias)
'''

C13_CONV_WEIGHTS_FROM_CONV2D = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

conv_relu_src = """
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

// direct 2D convolution (stride 1, no padding) followed by ReLU; one thread per output element
__global__ void conv2d_relu_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                   const float* __restrict__ bias, float* __restrict__ y,
                                   int N, int C, int H, int W, int K, int R, int S, int P, int Q) {
    int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    int64_t total = (int64_t)N * K * P * Q;
    if (idx >= total) return;
    int q = idx % Q; int p = (idx / Q) % P; int k = (idx / ((int64_t)P * Q)) % K; int n = idx / ((int64_t)K * P * Q);
    float acc = bias[k];
    for (int c = 0; c < C; ++c)
        for (int r = 0; r < R; ++r)
            #pragma unroll 4
            for (int s = 0; s < S; ++s)
                acc += x[(((int64_t)n * C + c) * H + p + r) * W + q + s] * w[(((int64_t)k * C + c) * R + r) * S + s];
    y[idx] = fmaxf(acc, 0.f);
}

torch::Tensor conv2d_relu(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
    x = x.contiguous(); w = w.contiguous();
    const int N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
    const int K = w.size(0), R = w.size(2), S = w.size(3);
    const int P = H - R + 1, Q = W - S + 1;
    auto y = torch::empty({N, K, P, Q}, x.options());
    const int64_t total = (int64_t)N * K * P * Q;
    const int threads = 256;
    const int blocks = (int)((total + threads - 1) / threads);
    conv2d_relu_kernel<<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), w.data_ptr<float>(), bias.data_ptr<float>(), y.data_ptr<float>(),
        N, C, H, W, K, R, S, P, Q);
    return y;
}
"""

conv_relu_cpp = "torch::Tensor conv2d_relu(torch::Tensor x, torch::Tensor w, torch::Tensor bias);"

conv_relu = load_inline(name="conv2d_relu_ext", cpp_sources=conv_relu_cpp, cuda_sources=conv_relu_src,
                        functions=["conv2d_relu"], extra_cuda_cflags=["-O3"], verbose=False)


class ModelNew(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size):
        super(ModelNew, self).__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        assert self.conv.stride == (1, 1) and self.conv.padding == (0, 0), "kernel assumes stride 1, no padding"

    def forward(self, x):
        return conv_relu.conv2d_relu(x, self.conv.weight, self.conv.bias)
'''


# ---------------------------------------------------------------------------------------- CUDA: Python-side variety
C14_LINEAR_PARAMS_KAIMING = r'''import math
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

gemm_relu_cuda = """
#include <torch/extension.h>
#define BLOCK 16

__global__ void gemm_bias_relu(const float* A, const float* B, const float* bias, float* C, int M, int N, int K) {
    __shared__ float As[BLOCK][BLOCK];
    __shared__ float Bs[BLOCK][BLOCK];
    int r = blockIdx.y * BLOCK + threadIdx.y, c = blockIdx.x * BLOCK + threadIdx.x;
    float sum = 0.f;
    for (int t = 0; t < K; t += BLOCK) {
        As[threadIdx.y][threadIdx.x] = (r < M && t + threadIdx.x < K) ? A[r * K + t + threadIdx.x] : 0.f;
        Bs[threadIdx.y][threadIdx.x] = (c < N && t + threadIdx.y < K) ? B[c * K + t + threadIdx.y] : 0.f;
        __syncthreads();
        for (int k = 0; k < BLOCK; ++k) sum += As[threadIdx.y][k] * Bs[k][threadIdx.x];
        __syncthreads();
    }
    if (r < M && c < N) C[r * N + c] = fmaxf(sum + bias[c], 0.f);
}

torch::Tensor gemm_relu(torch::Tensor a, torch::Tensor w, torch::Tensor bias) {
    int M = a.size(0), K = a.size(1), N = w.size(0);
    auto c = torch::empty({M, N}, torch::TensorOptions().dtype(a.dtype()).device(a.device()));
    dim3 threads(BLOCK, BLOCK), blocks((N + BLOCK - 1) / BLOCK, (M + BLOCK - 1) / BLOCK);
    gemm_bias_relu<<<blocks, threads>>>(a.data_ptr<float>(), w.data_ptr<float>(), bias.data_ptr<float>(),
                                        c.data_ptr<float>(), M, N, K);
    return c;
}
"""

gemm_relu_cpp = "torch::Tensor gemm_relu(torch::Tensor a, torch::Tensor w, torch::Tensor bias);"

gemm_relu_ext = load_inline(name="gemm_relu", cpp_sources=gemm_relu_cpp, cuda_sources=gemm_relu_cuda,
                            functions=["gemm_relu"], verbose=False)


class ModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # same initialisation as nn.Linear
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        fan_in, _ = nn.init._calculate_fan_in_and_fan_out(self.weight)
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm_relu_ext.gemm_relu(x.contiguous(), self.weight, self.bias)
'''

C15_AUTOGRAD_FUNCTION = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

hardtanh_src = """
#include <torch/extension.h>

__global__ void hardtanh_fwd(const float* x, float* y, float lo, float hi, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = fminf(fmaxf(x[i], lo), hi);
}

torch::Tensor hardtanh_cuda(torch::Tensor x, double lo, double hi) {
    auto y = torch::empty_like(x);
    int n = x.numel();
    hardtanh_fwd<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), (float)lo, (float)hi, n);
    return y;
}
"""

hardtanh_ext = load_inline(
    name="hardtanh_ext",
    cpp_sources="torch::Tensor hardtanh_cuda(torch::Tensor x, double lo, double hi);",
    cuda_sources=hardtanh_src,
    functions=["hardtanh_cuda"],
)


class HardTanhFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lo, hi):
        ctx.save_for_backward(x)
        ctx.lo, ctx.hi = lo, hi
        return hardtanh_ext.hardtanh_cuda(x.contiguous(), lo, hi)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        grad = grad_out.clone()
        grad[(x < ctx.lo) | (x > ctx.hi)] = 0
        return grad, None, None


class ModelNew(nn.Module):
    def __init__(self, min_val: float = -1.0, max_val: float = 1.0):
        super().__init__()
        self.min_val = min_val
        self.max_val = max_val

    def forward(self, x):
        return HardTanhFn.apply(x, self.min_val, self.max_val)
'''

C16_VIEWS_PERMUTE = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

transpose_cuda_source = """
#include <torch/extension.h>
#include <cuda_runtime.h>

#define TILE_DIM 32
#define BLOCK_ROWS 8

// classic shared-memory transpose of the last two dims (batched)
__global__ void transpose_kernel(const float* __restrict__ in, float* __restrict__ out, int rows, int cols) {
    __shared__ float tile[TILE_DIM][TILE_DIM + 1];
    const size_t batch = blockIdx.z;
    in += batch * rows * cols;
    out += batch * rows * cols;
    int x = blockIdx.x * TILE_DIM + threadIdx.x;
    int y = blockIdx.y * TILE_DIM + threadIdx.y;
    for (int j = 0; j < TILE_DIM; j += BLOCK_ROWS)
        if (x < cols && y + j < rows) tile[threadIdx.y + j][threadIdx.x] = in[(size_t)(y + j) * cols + x];
    __syncthreads();
    x = blockIdx.y * TILE_DIM + threadIdx.x;
    y = blockIdx.x * TILE_DIM + threadIdx.y;
    for (int j = 0; j < TILE_DIM; j += BLOCK_ROWS)
        if (x < rows && y + j < cols) out[(size_t)(y + j) * rows + x] = tile[threadIdx.x][threadIdx.y + j];
}

torch::Tensor batched_transpose(torch::Tensor x) {
    TORCH_CHECK(x.dim() == 3, "expected [B, R, C]");
    auto xc = x.contiguous();
    const int B = xc.size(0), R = xc.size(1), C = xc.size(2);
    auto out = torch::empty({B, C, R}, xc.options());
    dim3 block(TILE_DIM, BLOCK_ROWS);
    dim3 grid((C + TILE_DIM - 1) / TILE_DIM, (R + TILE_DIM - 1) / TILE_DIM, B);
    transpose_kernel<<<grid, block>>>(xc.data_ptr<float>(), out.data_ptr<float>(), R, C);
    return out;
}
"""

transpose_cpp_source = "torch::Tensor batched_transpose(torch::Tensor x);"

transpose_ext = load_inline(
    name="batched_transpose",
    cpp_sources=transpose_cpp_source,
    cuda_sources=transpose_cuda_source,
    functions=["batched_transpose"],
    extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"],
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, C, H, W] -> [N, C, W, H]
        n, c, h, w = x.shape
        out = transpose_ext.batched_transpose(x.reshape(n * c, h, w))
        out = out.view(n, c, w, h)
        # the following are metadata-only and keep the output identical
        out = out.unsqueeze(0).squeeze(0).expand(n, c, w, h)
        return out.permute(0, 1, 2, 3).flatten(0, 0)
'''

C17_LAZY_BUILD_LRU = r'''import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

_CPP = "torch::Tensor fused_mul_add(torch::Tensor x, torch::Tensor scale, torch::Tensor shift);"
_CUDA = """
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

// per-channel affine: y[n, c, ...] = x[n, c, ...] * scale[c] + shift[c]
__global__ void mul_add_kernel(const float* __restrict__ x, const float* __restrict__ scale,
                               const float* __restrict__ shift, float* __restrict__ y,
                               int64_t n, int64_t C, int64_t inner) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) {
        int64_t c = (i / inner) % C;
        y[i] = fmaf(x[i], scale[c], shift[c]);
    }
}

torch::Tensor fused_mul_add(torch::Tensor x, torch::Tensor scale, torch::Tensor shift) {
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    const int64_t C = xc.size(1);
    const int64_t inner = xc.numel() / (xc.size(0) * C);
    const int64_t n = xc.numel();
    mul_add_kernel<<<(n + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        xc.data_ptr<float>(), scale.data_ptr<float>(), shift.data_ptr<float>(), y.data_ptr<float>(), n, C, inner);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}
"""


@dataclass(frozen=True)
class LaunchConfig:
    threads: int = 256


@functools.lru_cache(maxsize=None)
def _get_extension():
    """Compile on first use (load_inline caches the build between processes)."""
    return load_inline(name="fused_mul_add_ext", cpp_sources=_CPP, cuda_sources=_CUDA,
                       functions=["fused_mul_add"], verbose=False)


class ModelNew(nn.Module):
    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.bn = nn.BatchNorm2d(num_features, eps=eps)
        self.cfg = LaunchConfig()

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            warnings.warn(f"ModelNew expects float32, got {x.dtype}; casting")
            x = x.float()
        # eval-mode batch norm folded into one affine transform
        scale = self.bn.weight / torch.sqrt(self.bn.running_var + self.bn.eps)
        shift = self.bn.bias - self.bn.running_mean * scale
        return _get_extension().fused_mul_add(x, scale.contiguous(), shift.contiguous())
'''

C18_DOCSTRINGS_WORDS = r'''import os
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# NOTE: we do not use os, threads, extra streams, exec or system calls; the kernel only reads x and
# writes out. The reference used torch.matmul; we write the output ourselves.
# Stream handling: the launch goes to the current stream, so no synchronisation is needed.

cuda_source = """
// This kernel does not open files, write to disk, or spawn a thread per row: each CUDA thread
// computes one output element. "system" memory is never touched.
#include <torch/extension.h>

__global__ void abs_kernel(const float* in, float* out, int n) {
    int thread_index = blockIdx.x * blockDim.x + threadIdx.x;
    if (thread_index < n) out[thread_index] = fabsf(in[thread_index]);
}

torch::Tensor abs_cuda(torch::Tensor x) {
    TORCH_CHECK(x.is_cuda(), "abs_cuda: expected a CUDA tensor (did you forget to write .cuda()?)");
    auto out = torch::empty_like(x);
    int n = x.numel();
    int num_threads = 256;
    abs_kernel<<<(n + num_threads - 1) / num_threads, num_threads>>>(x.data_ptr<float>(), out.data_ptr<float>(), n);
    return out;
}
"""

cpp_source = "torch::Tensor abs_cuda(torch::Tensor x);"

abs_ext = load_inline(name="abs_ext", cpp_sources=cpp_source, cuda_sources=cuda_source, functions=["abs_cuda"],
                      verbose=True)


class ModelNew(nn.Module):
    """Absolute value.

    The original model called torch.abs; here a custom kernel is used. We do not exec, eval, write files,
    use the os module, start a thread, or create a stream: everything runs in one launch.
    """

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        msg = "torch.matmul is not used; os.system is not used; threading is not used"
        assert isinstance(msg, str)
        return abs_ext.abs_cuda(x)
'''

C19_DEVICE_QUERIES = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source_cuda = """
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void elu_kernel(const float* __restrict__ x, float* __restrict__ y, float alpha, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        y[i] = v > 0.f ? v : alpha * (expf(v) - 1.f);
    }
}

torch::Tensor elu(torch::Tensor x, double alpha, int64_t blocks_per_sm) {
    auto y = at::empty_like(x);
    int64_t n = x.numel();
    int sm = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    int64_t blocks = std::min<int64_t>((n + 255) / 256, sm * blocks_per_sm);
    blocks = std::max<int64_t>(blocks, (n + 255) / 256);
    elu_kernel<<<blocks, 256, 0, at::cuda::getCurrentCUDAStream()>>>(x.data_ptr<float>(), y.data_ptr<float>(),
                                                                    (float)alpha, n);
    AT_CUDA_CHECK(cudaGetLastError());
    return y;
}
"""

source_cpp = "torch::Tensor elu(torch::Tensor x, double alpha, int64_t blocks_per_sm);"

elu_ext = load_inline(name="elu_ext", cpp_sources=source_cpp, cuda_sources=source_cuda, functions=["elu"],
                      extra_cuda_cflags=["-O3", "--use_fast_math", "-maxrregcount=64"], verbose=False)


class ModelNew(nn.Module):
    def __init__(self, alpha: float = 1.0):
        super().__init__()
        self.alpha = alpha
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            self.blocks_per_sm = 32 if props.major >= 8 else 16
        else:
            self.blocks_per_sm = 16

    def forward(self, x):
        device = torch.device("cuda", torch.cuda.current_device())
        if x.device != device:
            x = x.to(device)
        stream = torch.cuda.current_stream()  # kernel uses the same stream
        del stream
        return elu_ext.elu(x.contiguous(), self.alpha, self.blocks_per_sm)
'''

C20_GET_INPUTS_COPY = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

batch_size = 16
dim = 16384

square_cuda_source = """
#include <torch/extension.h>
template <typename scalar_t>
__global__ void square_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ y, size_t n) {
    size_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * x[i];
}
torch::Tensor square_cuda(torch::Tensor x) {
    auto y = torch::empty_like(x);
    const size_t n = x.numel();
    const int threads = 256;
    const int blocks = (n + threads - 1) / threads;
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "square_cuda", ([&] {
        square_kernel<scalar_t><<<blocks, threads>>>(x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), n);
    }));
    return y;
}
"""
square_cpp_source = "torch::Tensor square_cuda(torch::Tensor x);"

square = load_inline(name="square", cpp_sources=square_cpp_source, cuda_sources=square_cuda_source,
                     functions=["square_cuda"], verbose=False)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return square.square_cuda(x)


def get_inputs():
    x = torch.randn(batch_size, dim)
    return [x]


def get_init_inputs():
    return []
'''

C21_NAMESPACED_IMPORT = r'''import torch
from torch import nn
import torch.utils.cpp_extension
from torch.utils.cpp_extension import CUDA_HOME

kernels = r"""
#include <torch/extension.h>
#include <cuda_fp16.h>

__global__ void add_relu_half(const __half* a, const __half* b, __half* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = __half2float(a[i]) + __half2float(b[i]);
        out[i] = __float2half(v > 0.f ? v : 0.f);
    }
}

torch::Tensor add_relu(torch::Tensor a, torch::Tensor b) {
    TORCH_CHECK(a.scalar_type() == at::kHalf, "expected fp16");
    auto out = torch::empty_like(a);
    int n = a.numel();
    add_relu_half<<<(n + 511) / 512, 512>>>(reinterpret_cast<const __half*>(a.data_ptr<at::Half>()),
                                           reinterpret_cast<const __half*>(b.data_ptr<at::Half>()),
                                           reinterpret_cast<__half*>(out.data_ptr<at::Half>()), n);
    return out;
}
"""

ext = torch.utils.cpp_extension.load_inline(
    "add_relu_fp16",
    "torch::Tensor add_relu(torch::Tensor a, torch::Tensor b);",
    kernels,
    functions=["add_relu"],
    extra_cuda_cflags=["-O3", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                       "--expt-extended-lambda"],
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.has_cuda = CUDA_HOME is not None

    def forward(self, a, b):
        return ext.add_relu(a.half(), b.half()).to(a.dtype)
'''

C22_REDUCTION_ARGMAX = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

argmax_src = """
#include <torch/extension.h>
#include <limits>

__global__ void argmax_lastdim_kernel(const float* __restrict__ x, int64_t* __restrict__ out, int rows, int cols) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    const float* xr = x + (size_t)row * cols;
    float best = -std::numeric_limits<float>::infinity();
    int64_t idx = 0;
    for (int c = 0; c < cols; ++c) {
        float v = xr[c];
        if (v > best) { best = v; idx = c; }
    }
    out[row] = idx;
}

torch::Tensor argmax_lastdim(torch::Tensor x) {
    auto xc = x.contiguous();
    const int cols = xc.size(-1);
    const int rows = xc.numel() / cols;
    auto out = torch::empty({rows}, xc.options().dtype(torch::kLong));
    argmax_lastdim_kernel<<<(rows + 127) / 128, 128>>>(xc.data_ptr<float>(), out.data_ptr<int64_t>(), rows, cols);
    TORCH_CHECK(out.scalar_type() == torch::kLong, "argmax output must be torch.long (int64)");
    return out;
}
"""

argmax_ext = load_inline(name="argmax_lastdim", cpp_sources="torch::Tensor argmax_lastdim(torch::Tensor x);",
                         cuda_sources=argmax_src, functions=["argmax_lastdim"])


class ModelNew(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xt = x.movedim(self.dim, -1)
        out = argmax_ext.argmax_lastdim(xt)
        return out.view(xt.shape[:-1])
'''


# ---------------------------------------------------------------------------------------- CPU (cpp_sources only)
P01_CPU_RELU_OMP_SIMD = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = """
#include <torch/extension.h>
#include <algorithm>
#include <cmath>

torch::Tensor relu_cpu(torch::Tensor x) {
    TORCH_CHECK(!x.is_cuda(), "relu_cpu expects a CPU tensor");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "float32 only");
    auto xc = x.contiguous();
    auto out = torch::empty_like(xc);
    const float* __restrict__ in = xc.data_ptr<float>();
    float* __restrict__ o = out.data_ptr<float>();
    const int64_t n = xc.numel();
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        o[i] = std::max(in[i], 0.0f);
    }
    return out;
}
"""

relu_cpu = load_inline(
    name="relu_cpu",
    cpp_sources=cpp_source,
    functions=["relu_cpu"],
    extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return relu_cpu.relu_cpu(x)
'''

P02_CPU_SOFTMAX_CMATH = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

softmax_cpp = r"""
#include <torch/extension.h>
#include <vector>
#include <cmath>
#include <limits>
#include <algorithm>

torch::Tensor softmax_rows(torch::Tensor x) {
    TORCH_CHECK(x.dim() == 2, "expected 2D input, got ", x.dim(), "D");
    auto xc = x.contiguous();
    const int64_t rows = xc.size(0), cols = xc.size(1);
    auto out = torch::empty({rows, cols}, xc.options());
    const float* in = xc.data_ptr<float>();
    float* o = out.data_ptr<float>();
    std::vector<float> buf(cols);
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = in + r * cols;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < cols; ++c) m = std::max(m, xr[c]);
        float s = 0.f;
        #pragma omp simd reduction(+:s)
        for (int64_t c = 0; c < cols; ++c) {
            buf[c] = expf(xr[c] - m);
            s += buf[c];
        }
        const float inv = 1.0f / s;
        for (int64_t c = 0; c < cols; ++c) o[r * cols + c] = buf[c] * inv;
    }
    return out;
}
"""

softmax_ext = load_inline(name="softmax_cpu", cpp_sources=[softmax_cpp], functions=["softmax_rows"],
                          extra_cflags=["-O3", "-std=c++17"], with_cuda=False)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softmax_ext.softmax_rows(x)
'''

P03_CPU_GELU_TANH_ACCESSOR = r'''import math
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

gelu_cpp_source = """
#include <torch/extension.h>
#include <cmath>

// tanh-approximate GELU; the accessor keeps the indexing readable
torch::Tensor gelu_cpu(torch::Tensor x) {
    auto x2 = x.contiguous().view({-1, x.size(-1)});
    auto y = torch::empty_like(x2);
    auto xa = x2.accessor<float, 2>();
    auto ya = y.accessor<float, 2>();
    const float k = std::sqrt(2.0f / static_cast<float>(M_PI));
    for (int64_t i = 0; i < x2.size(0); ++i) {
        for (int64_t j = 0; j < x2.size(1); ++j) {
            const float v = xa[i][j];
            ya[i][j] = 0.5f * v * (1.0f + tanhf(k * (v + 0.044715f * v * v * v)));
        }
    }
    return y.view(x.sizes());
}
"""

gelu_ext = load_inline(name="gelu_cpu_ext", cpp_sources=gelu_cpp_source, functions=["gelu_cpu"],
                       extra_cflags=["-O2"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = math.sqrt(2.0 / math.pi)

    def forward(self, x):
        return gelu_ext.gelu_cpu(x)
'''

P04_CPU_MATMUL_BLOCKED = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

matmul_cpp = """
#include <torch/extension.h>
#include <algorithm>
#include <vector>

constexpr int64_t kBlock = 64;

// C = A @ B, blocked for cache reuse
torch::Tensor matmul_blocked(torch::Tensor A, torch::Tensor B) {
    TORCH_CHECK(A.dim() == 2 && B.dim() == 2 && A.size(1) == B.size(0), "shape mismatch");
    auto a = A.contiguous(), b = B.contiguous();
    const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
    auto c = torch::zeros({M, N}, a.options());
    const float* pa = a.data_ptr<float>();
    const float* pb = b.data_ptr<float>();
    float* pc = c.data_ptr<float>();
    for (int64_t i0 = 0; i0 < M; i0 += kBlock)
        for (int64_t k0 = 0; k0 < K; k0 += kBlock)
            for (int64_t j0 = 0; j0 < N; j0 += kBlock) {
                const int64_t i1 = std::min(i0 + kBlock, M), k1 = std::min(k0 + kBlock, K), j1 = std::min(j0 + kBlock, N);
                for (int64_t i = i0; i < i1; ++i)
                    for (int64_t k = k0; k < k1; ++k) {
                        const float aik = pa[i * K + k];
#pragma GCC ivdep
                        for (int64_t j = j0; j < j1; ++j) pc[i * N + j] += aik * pb[k * N + j];
                    }
            }
    return c;
}
"""

matmul_ext = load_inline(
    name="matmul_blocked_cpu",
    cpp_sources=matmul_cpp,
    functions=["matmul_blocked"],
    extra_cflags=["-O3", "-funroll-loops", "-DNDEBUG"],
    extra_ldflags=["-lc10", "-ltorch"],
    verbose=True,
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        return matmul_ext.matmul_blocked(A, B)
'''

P05_CPU_LAYERNORM_STD_VECTOR = r'''from typing import Sequence

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

ln_cpp = """
#include <torch/extension.h>
#include <cmath>
#include <vector>
#include <numeric>

torch::Tensor layer_norm_cpu(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, double eps) {
    const int64_t N = weight.numel();
    auto xc = x.contiguous();
    auto out = torch::empty_like(xc);
    const float* px = xc.data_ptr<float>();
    const float* pw = weight.data_ptr<float>();
    const float* pb = bias.data_ptr<float>();
    float* po = out.data_ptr<float>();
    const int64_t rows = xc.numel() / N;
    for (int64_t r = 0; r < rows; ++r) {
        const float* row = px + r * N;
        double mean = std::accumulate(row, row + N, 0.0) / N;
        double var = 0.0;
        for (int64_t i = 0; i < N; ++i) { double d = row[i] - mean; var += d * d; }
        var /= N;
        const float rstd = 1.0f / sqrtf(static_cast<float>(var) + static_cast<float>(eps));
        for (int64_t i = 0; i < N; ++i) po[r * N + i] = (row[i] - (float)mean) * rstd * pw[i] + pb[i];
    }
    return out;
}
"""

ln_ext = load_inline(name="layer_norm_cpu", cpp_sources=ln_cpp, functions=["layer_norm_cpu"])


class ModelNew(nn.Module):
    def __init__(self, normalized_shape: Sequence[int]):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(*normalized_shape))
        self.bias = nn.Parameter(torch.zeros(*normalized_shape))
        self.eps = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ln_ext.layer_norm_cpu(x, self.weight.reshape(-1).contiguous(), self.bias.reshape(-1).contiguous(),
                                     self.eps)
'''

P06_CPU_PYBIND_TEMPLATE = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""
#include <torch/extension.h>
#include <cmath>
#include <cstdint>

template <typename scalar_t>
static void tanh_loop(const scalar_t* in, scalar_t* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = std::tanh(in[i]);
}

torch::Tensor tanh_forward(torch::Tensor x) {
    auto xc = x.contiguous();
    auto out = torch::empty_like(xc);
    AT_DISPATCH_FLOATING_TYPES(xc.scalar_type(), "tanh_forward", [&] {
        tanh_loop<scalar_t>(xc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), xc.numel());
    });
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("tanh_forward", &tanh_forward, "tanh (CPU)");
}
"""

tanh_ext = load_inline(name="tanh_cpu", cpp_sources=source, verbose=False)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return tanh_ext.tanh_forward(x)
'''

P07_CPU_CONV1D_PARAM_FROM_NN = r'''import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

conv1d_source = """
#include <torch/extension.h>

// y[n, k, t] = b[k] + sum_c sum_r w[k, c, r] * x[n, c, t + r]   (stride 1, no padding)
torch::Tensor conv1d_forward(torch::Tensor x, torch::Tensor w, torch::Tensor b) {
    x = x.contiguous(); w = w.contiguous();
    const int64_t N = x.size(0), C = x.size(1), L = x.size(2);
    const int64_t K = w.size(0), R = w.size(2), T = L - R + 1;
    auto y = torch::empty({N, K, T}, x.options());
    auto xa = x.accessor<float, 3>();
    auto wa = w.accessor<float, 3>();
    auto ya = y.accessor<float, 3>();
    const float* pb = b.data_ptr<float>();
    for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k)
            for (int64_t t = 0; t < T; ++t) {
                float acc = pb[k];
                for (int64_t c = 0; c < C; ++c)
                    for (int64_t r = 0; r < R; ++r) acc += wa[k][c][r] * xa[n][c][t + r];
                ya[n][k][t] = acc;
            }
    return y;
}
"""

conv1d_ext = load_inline(name="conv1d_cpu", cpp_sources=conv1d_source, functions=["conv1d_forward"],
                         extra_cflags=["-O3"])


class ModelNew(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, bias: bool = True):
        super().__init__()
        conv = nn.Conv1d(in_channels, out_channels, kernel_size, bias=bias)
        self.weight = nn.Parameter(conv.weight.detach().clone())
        self.bias = nn.Parameter(conv.bias.detach().clone() if bias else torch.zeros(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return conv1d_ext.conv1d_forward(x, self.weight, self.bias)
'''

P08_CPU_AVX_INTRINSICS = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

add_src = """
#include <torch/extension.h>
#include <immintrin.h>

torch::Tensor add_avx(torch::Tensor a, torch::Tensor b) {
    auto out = torch::empty_like(a);
    const float* pa = a.data_ptr<float>();
    const float* pb = b.data_ptr<float>();
    float* po = out.data_ptr<float>();
    const int64_t n = a.numel();
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) {
        __m256 va = _mm256_loadu_ps(pa + i);
        __m256 vb = _mm256_loadu_ps(pb + i);
        _mm256_storeu_ps(po + i, _mm256_add_ps(va, vb));
    }
#endif
    for (; i < n; ++i) po[i] = pa[i] + pb[i];
    return out;
}
"""

add_ext = load_inline(name="add_avx", cpp_sources=add_src, functions=["add_avx"],
                      extra_cflags=["-O3", "-mavx2", "-mfma"])


class ModelNew(nn.Module):
    def forward(self, a, b):
        return add_ext.add_avx(a.contiguous(), b.contiguous())
'''


# ---------------------------------------------------------------------------------------- Triton
T01_TRITON_ADD = r'''import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, output_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(axis=0)
    block_start = pid * BLOCK_SIZE
    offsets = block_start + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(output_ptr + offsets, x + y, mask=mask)


def triton_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    assert x.is_cuda and y.is_cuda, "Tensors must be on CUDA."
    x = x.contiguous()
    y = y.contiguous()
    out = torch.empty_like(x)
    n_elements = x.numel()
    grid = lambda meta: (triton.cdiv(n_elements, meta["BLOCK_SIZE"]),)
    add_kernel[grid](x, y, out, n_elements, BLOCK_SIZE=1024)
    return out


class ModelNew(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, a, b):
        return triton_add(a, b)
'''

T02_TRITON_AUTOTUNE_MATMUL = r'''import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 32, "GROUP_M": 8}, num_stages=4, num_warps=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_stages=4, num_warps=4),
    ],
    key=["M", "N", "K"],
)
@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                  stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_am = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_bn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak)
    b_ptrs = b_ptr + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)

    accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k * BLOCK_K, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0)
        accumulator = tl.dot(a, b, accumulator)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c = accumulator.to(tl.float16)

    offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + stride_cm * offs_cm[:, None] + stride_cn * offs_cn[None, :]
    c_mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
    tl.store(c_ptrs, c, mask=c_mask)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    assert a.shape[1] == b.shape[0], "Incompatible dimensions"
    M, K = a.shape
    K, N = b.shape
    c = torch.empty((M, N), device=a.device, dtype=torch.float16)
    grid = lambda META: (triton.cdiv(M, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"]),)
    matmul_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                        c.stride(0), c.stride(1))
    return c


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return matmul(A.half(), B.half()).to(A.dtype)
'''

T03_TRITON_SOFTMAX = r'''import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def softmax_kernel(output_ptr, input_ptr, input_row_stride, output_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    row_idx = tl.program_id(0)
    row_start_ptr = input_ptr + row_idx * input_row_stride
    col_offsets = tl.arange(0, BLOCK_SIZE)
    input_ptrs = row_start_ptr + col_offsets
    row = tl.load(input_ptrs, mask=col_offsets < n_cols, other=-float("inf"))
    row_minus_max = row - tl.max(row, axis=0)
    numerator = tl.exp(row_minus_max)
    denominator = tl.sum(numerator, axis=0)
    softmax_output = numerator / denominator
    output_row_start_ptr = output_ptr + row_idx * output_row_stride
    tl.store(output_row_start_ptr + col_offsets, softmax_output, mask=col_offsets < n_cols)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n_rows, n_cols = x.shape
        BLOCK_SIZE = triton.next_power_of_2(n_cols)
        num_warps = 4
        if BLOCK_SIZE >= 2048:
            num_warps = 8
        if BLOCK_SIZE >= 4096:
            num_warps = 16
        y = torch.empty_like(x)
        softmax_kernel[(n_rows,)](y, x, x.stride(0), y.stride(0), n_cols, num_warps=num_warps, BLOCK_SIZE=BLOCK_SIZE)
        return y
'''

T04_TRITON_FUSED_LINEAR_GELU = r'''import math
import torch
import torch.nn as nn
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _gelu(x):
    return 0.5 * x * (1.0 + libdevice.erf(x * 0.7071067811865476))


@triton.jit
def linear_gelu_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
                       stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & ((k0 + rk)[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + (k0 + rk)[:, None] * stride_wk,
                    mask=(rn[None, :] < N) & ((k0 + rk)[:, None] < K), other=0.0)
        acc += tl.dot(x, w, allow_tf32=False)
    bias = tl.load(b_ptr + rn, mask=rn < N, other=0.0)
    acc = _gelu(acc + bias[None, :])
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


class ModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.scale = 1.0 / math.sqrt(in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        M, K = x.shape
        N = self.linear.out_features
        y = torch.empty((M, N), device=x.device, dtype=x.dtype)
        w = self.linear.weight
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))
        linear_gelu_kernel[grid](x, w, self.linear.bias, y, M, N, K, x.stride(0), x.stride(1),
                                 w.stride(0), w.stride(1), y.stride(0), y.stride(1),
                                 BLOCK_M=64, BLOCK_N=64, BLOCK_K=32)
        return y
'''

T05_TRITON_HEURISTICS_LAYERNORM = r'''import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.heuristics({"EVEN_N": lambda args: args["N"] % args["BLOCK_N"] == 0})
@triton.jit
def layernorm_fwd(X, Y, W, B, stride, N, eps, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    row = tl.program_id(0)
    X += row * stride
    Y += row * stride
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(mask, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / N
    rstd = 1 / tl.sqrt(var + eps)
    w = tl.load(W + cols, mask=mask)
    b = tl.load(B + cols, mask=mask)
    tl.store(Y + cols, xc * rstd * w + b, mask=mask)


class ModelNew(nn.Module):
    def __init__(self, normalized_shape):
        super().__init__()
        self.norm = nn.LayerNorm(normalized_shape)

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        y = torch.empty_like(x2)
        N = x2.shape[1]
        BLOCK_N = triton.next_power_of_2(N)
        layernorm_fwd[(x2.shape[0],)](x2, y, self.norm.weight, self.norm.bias, x2.stride(0), N,
                                      self.norm.eps, BLOCK_N=BLOCK_N, num_warps=8)
        return y.view(shape)
'''


# ---------------------------------------------------------------------------------------- MUSA
M01_MUSA_ADD = r'''import torch
import torch.nn as nn
import torch_musa
from torch_musa.utils.musa_extension import load_inline

musa_source = """
#include <torch/extension.h>
#include <musa_runtime.h>

__global__ void add_kernel(const float* a, const float* b, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

torch::Tensor add_musa(torch::Tensor a, torch::Tensor b) {
    TORCH_CHECK(a.device().type() == c10::DeviceType::PrivateUse1, "a must be a MUSA tensor");
    auto out = torch::empty_like(a);
    int n = a.numel();
    const int threads = 256;
    add_kernel<<<(n + threads - 1) / threads, threads>>>(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), n);
    musaError_t err = musaGetLastError();
    TORCH_CHECK(err == musaSuccess, "add kernel failed: ", musaGetErrorString(err));
    return out;
}
"""

cpp_source = "torch::Tensor add_musa(torch::Tensor a, torch::Tensor b);"

add_ext = load_inline(
    name="add_musa_ext",
    cpp_sources=cpp_source,
    musa_sources=musa_source,
    functions=["add_musa"],
    extra_musa_cflags=["-O3"],
    verbose=True,
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return add_ext.add_musa(a.contiguous(), b.contiguous())
'''

M02_MUSA_SOFTMAX_WARPSIZE = r'''import torch
import torch.nn as nn
import torch_musa
from torch_musa.utils.musa_extension import load_inline

softmax_musa_src = r"""
#include <torch/extension.h>
#include <musa_runtime.h>
#include <musa_fp16.h>
#include "torch_musa/csrc/core/MUSAStream.h"
#include <cfloat>

__device__ float warp_max(float v) {
    for (int off = warpSize / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, off, warpSize));
    return v;
}
__device__ float warp_sum(float v) {
    for (int off = warpSize / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffff, v, off, warpSize);
    return v;
}

// one warp per row
__global__ void softmax_rows(const float* __restrict__ x, float* __restrict__ y, int rows, int cols) {
    int row = blockIdx.x * (blockDim.x / warpSize) + threadIdx.x / warpSize;
    int lane = threadIdx.x % warpSize;
    if (row >= rows) return;
    const float* xr = x + (size_t)row * cols;
    float m = -FLT_MAX;
    for (int c = lane; c < cols; c += warpSize) m = fmaxf(m, xr[c]);
    m = warp_max(m);
    float s = 0.f;
    for (int c = lane; c < cols; c += warpSize) s += expf(xr[c] - m);
    s = warp_sum(s);
    for (int c = lane; c < cols; c += warpSize) y[(size_t)row * cols + c] = expf(xr[c] - m) / s;
}

torch::Tensor softmax_musa(torch::Tensor x) {
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    const int rows = xc.size(0), cols = xc.size(1);
    const int threads = 512;
    int warp = 32;
    musaDeviceGetAttribute(&warp, musaDevAttrWarpSize, xc.device().index());
    const int rows_per_block = threads / warp;
    auto stream = c10::musa::getCurrentMUSAStream();
    softmax_rows<<<(rows + rows_per_block - 1) / rows_per_block, threads, 0, stream>>>(
        xc.data_ptr<float>(), y.data_ptr<float>(), rows, cols);
    return y;
}
"""

softmax_ext = load_inline(name="softmax_musa", cpp_sources="torch::Tensor softmax_musa(torch::Tensor x);",
                          musa_sources=softmax_musa_src, functions=["softmax_musa"], verbose=False)


class ModelNew(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "musa":
            x = x.to("musa")
        return softmax_ext.softmax_musa(x)
'''

M03_MUSA_LINEAR_RELU = r'''import math
import torch
import torch.nn as nn
import torch_musa  # registers the "musa" device
from torch_musa.utils.musa_extension import load_inline

musa_src = """
#include <torch/extension.h>
#include <musa_runtime.h>

#define TILE 16

__global__ void linear_relu_kernel(const float* x, const float* w, const float* b, float* y, int M, int N, int K) {
    __shared__ float xs[TILE][TILE];
    __shared__ float ws[TILE][TILE];
    int row = blockIdx.y * TILE + threadIdx.y, col = blockIdx.x * TILE + threadIdx.x;
    float acc = 0.f;
    for (int t = 0; t < K; t += TILE) {
        xs[threadIdx.y][threadIdx.x] = (row < M && t + threadIdx.x < K) ? x[row * K + t + threadIdx.x] : 0.f;
        ws[threadIdx.y][threadIdx.x] = (col < N && t + threadIdx.y < K) ? w[col * K + t + threadIdx.y] : 0.f;
        __syncthreads();
        #pragma unroll
        for (int k = 0; k < TILE; ++k) acc += xs[threadIdx.y][k] * ws[k][threadIdx.x];
        __syncthreads();
    }
    if (row < M && col < N) y[row * N + col] = fmaxf(acc + b[col], 0.f);
}

torch::Tensor linear_relu(torch::Tensor x, torch::Tensor w, torch::Tensor b) {
    const int M = x.size(0), K = x.size(1), N = w.size(0);
    auto y = torch::empty({M, N}, x.options());
    dim3 block(TILE, TILE), grid((N + TILE - 1) / TILE, (M + TILE - 1) / TILE);
    linear_relu_kernel<<<grid, block>>>(x.data_ptr<float>(), w.data_ptr<float>(), b.data_ptr<float>(),
                                        y.data_ptr<float>(), M, N, K);
    return y;
}
"""

linear_relu = load_inline(name="linear_relu_musa", cpp_sources="torch::Tensor linear_relu(torch::Tensor x, torch::Tensor w, torch::Tensor b);",
                          musa_sources=musa_src, functions=["linear_relu"], extra_cflags=["-O3"])


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        dev = torch.device("musa", torch.musa.current_device())
        x = x.to(dev).contiguous()
        return linear_relu.linear_relu(x, self.linear.weight.contiguous(), self.linear.bias)
'''

M04_MUSA_DOT_MUSA_CALL = r'''import torch
import torch.nn as nn
import torch_musa
from torch_musa.utils.musa_extension import load_inline

source = """
#include <torch/extension.h>
__global__ void mish_kernel(const float* x, float* y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) { float v = x[i]; y[i] = v * tanhf(log1pf(expf(v))); }
}
torch::Tensor mish(torch::Tensor x) {
    auto y = torch::empty_like(x);
    long n = x.numel();
    mish_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""

mish_ext = load_inline(name="mish_musa", cpp_sources="torch::Tensor mish(torch::Tensor x);", musa_sources=source,
                       functions=["mish"])


class ModelNew(nn.Module):
    def forward(self, x):
        if not x.is_musa:
            x = x.musa()
        return mish_ext.mish(x.contiguous())
'''

# ---------------------------------------------------------------------------------------- more CUDA
C23_CONV_PAIR_HELPER = r'''import math
import torch
import torch.nn as nn
from torch.nn.modules.utils import _pair
from torch.utils.cpp_extension import load_inline

maxpool_src = """
#include <torch/extension.h>
#include <cfloat>

__global__ void maxpool2d_kernel(const float* __restrict__ x, float* __restrict__ y, int NC, int H, int W,
                                 int OH, int OW, int kh, int kw, int sh, int sw) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= NC * OH * OW) return;
    int ow = idx % OW, oh = (idx / OW) % OH, nc = idx / (OW * OH);
    const float* xp = x + (size_t)nc * H * W;
    float m = -FLT_MAX;
    for (int i = 0; i < kh; ++i)
        for (int j = 0; j < kw; ++j)
            m = fmaxf(m, xp[(oh * sh + i) * W + ow * sw + j]);
    y[idx] = m;
}

torch::Tensor maxpool2d(torch::Tensor x, int64_t kh, int64_t kw, int64_t sh, int64_t sw) {
    x = x.contiguous();
    const int N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
    const int OH = (H - kh) / sh + 1, OW = (W - kw) / sw + 1;
    auto y = torch::empty({N, C, OH, OW}, x.options());
    const int total = N * C * OH * OW;
    maxpool2d_kernel<<<(total + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), N * C, H, W, OH, OW,
                                                   kh, kw, sh, sw);
    return y;
}
"""

maxpool_ext = load_inline(name="maxpool2d_ext", cpp_sources="torch::Tensor maxpool2d(torch::Tensor x, int64_t kh, int64_t kw, int64_t sh, int64_t sw);",
                          cuda_sources=maxpool_src, functions=["maxpool2d"])


class ModelNew(nn.Module):
    def __init__(self, kernel_size, stride=None):
        super().__init__()
        self.kernel_size = _pair(kernel_size)
        self.stride = _pair(stride if stride is not None else kernel_size)

    def forward(self, x):
        kh, kw = self.kernel_size
        sh, sw = self.stride
        return maxpool_ext.maxpool2d(x, kh, kw, sh, sw)
'''

C24_MAIN_SMOKE_TEST = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_src = """
#include <torch/extension.h>
__global__ void neg_kernel(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = -x[i];
}
torch::Tensor neg(torch::Tensor x) {
    auto y = torch::empty_like(x);
    int n = x.numel();
    neg_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""

neg_ext = load_inline(name="neg_ext", cpp_sources="torch::Tensor neg(torch::Tensor x);", cuda_sources=cuda_src,
                      functions=["neg"])


class ModelNew(nn.Module):
    def forward(self, x):
        return neg_ext.neg(x)


if __name__ == "__main__":
    model = ModelNew().cuda()
    x = torch.randn(1024, device="cuda")
    out = model(x)
    print(f"max abs error: {(out + x).abs().max().item():.3e}")
'''

C25_OPTIONAL_BIAS_BUFFERS = r'''from typing import Optional

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

bias_act_cuda = """
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

template <bool HAS_BIAS>
__global__ void __launch_bounds__(256) bias_silu_kernel(const float* __restrict__ x, const float* __restrict__ bias,
                                                        float* __restrict__ y, int64_t n, int64_t C) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    if constexpr (HAS_BIAS) v += bias[i % C];
    y[i] = v / (1.f + __expf(-v));
}

torch::Tensor bias_silu(torch::Tensor x, c10::optional<torch::Tensor> bias) {
    auto y = torch::empty_like(x);
    const int64_t n = x.numel(), C = x.size(-1);
    const int threads = 256;
    const int64_t blocks = (n + threads - 1) / threads;
    cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
    if (bias.has_value()) {
        bias_silu_kernel<true><<<blocks, threads, 0, stream>>>(x.data_ptr<float>(), bias->data_ptr<float>(),
                                                               y.data_ptr<float>(), n, C);
    } else {
        bias_silu_kernel<false><<<blocks, threads, 0, stream>>>(x.data_ptr<float>(), nullptr, y.data_ptr<float>(), n, C);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}
"""

bias_act_cpp = "torch::Tensor bias_silu(torch::Tensor x, c10::optional<torch::Tensor> bias);"

bias_act = load_inline(
    name="bias_silu_ext",
    cpp_sources=bias_act_cpp,
    cuda_sources=bias_act_cuda,
    functions=["bias_silu"],
    extra_cuda_cflags=["-O3", "-Xptxas", "-v", "-std=c++17", "--ptxas-options=-v"],
    verbose=True,
)


class ModelNew(nn.Module):
    def __init__(self, channels: int, use_bias: bool = True) -> None:
        super().__init__()
        self.bias: Optional[nn.Parameter] = nn.Parameter(torch.zeros(channels)) if use_bias else None
        self.register_buffer("dummy", torch.zeros(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = bias_act.bias_silu(x, self.bias)
        return out
'''

C26_CROSS_ENTROPY_TWO_KERNELS = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

ce_source = """
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <limits>

// per-row negative log-likelihood of log_softmax(logits)[target]
__global__ void ce_rows(const float* __restrict__ logits, const int64_t* __restrict__ targets,
                        float* __restrict__ losses, int C) {
    extern __shared__ float red[];
    const float* row = logits + (size_t)blockIdx.x * C;
    float m = -std::numeric_limits<float>::infinity();
    for (int c = threadIdx.x; c < C; c += blockDim.x) m = fmaxf(m, row[c]);
    red[threadIdx.x] = m;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
        __syncthreads();
    }
    m = red[0];
    __syncthreads();
    float sum = 0.f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) sum += expf(row[c] - m);
    red[threadIdx.x] = sum;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) losses[blockIdx.x] = logf(red[0]) + m - row[targets[blockIdx.x]];
}

__global__ void mean_kernel(const float* __restrict__ v, float* __restrict__ out, int n) {
    __shared__ float s[256];
    float acc = 0.f;
    for (int i = threadIdx.x; i < n; i += 256) acc += v[i];
    s[threadIdx.x] = acc;
    __syncthreads();
    for (int k = 128; k > 0; k >>= 1) {
        if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = s[0] / n;
}

torch::Tensor cross_entropy(torch::Tensor logits, torch::Tensor targets) {
    TORCH_CHECK(targets.scalar_type() == torch::kInt64, "targets must be int64");
    const int N = logits.size(0), C = logits.size(1);
    auto losses = torch::empty({N}, logits.options());
    auto out = torch::empty({}, logits.options());
    ce_rows<<<N, 256, 256 * sizeof(float)>>>(logits.contiguous().data_ptr<float>(), targets.contiguous().data_ptr<int64_t>(),
                                             losses.data_ptr<float>(), C);
    mean_kernel<<<1, 256>>>(losses.data_ptr<float>(), out.data_ptr<float>(), N);
    return out;
}
"""

ce = load_inline(name="cross_entropy_ext", cpp_sources="torch::Tensor cross_entropy(torch::Tensor logits, torch::Tensor targets);",
                 cuda_sources=ce_source, functions=["cross_entropy"], extra_cuda_cflags=["-O3"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, predictions, targets):
        return ce.cross_entropy(predictions, targets)
'''

C27_MACROS_LAUNCH_BOUNDS = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cstdio>
#include <algorithm>

#define CEIL_DIV(a, b) (((a) + (b) - 1) / (b))
#define CUDA_CHECK(call)                                                        \
    do {                                                                        \
        cudaError_t err__ = (call);                                             \
        TORCH_CHECK(err__ == cudaSuccess, "CUDA error: ", cudaGetErrorString(err__)); \
    } while (0)

constexpr int kThreads = 256;
constexpr int kItemsPerThread = 4;

__global__ void __launch_bounds__(kThreads) selu_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
    constexpr float alpha = 1.6732632423543772f, scale = 1.0507009873554805f;
    int64_t base = (blockIdx.x * (int64_t)kThreads + threadIdx.x) * kItemsPerThread;
#ifndef NDEBUG
    if (blockIdx.x == 0 && threadIdx.x == 0) printf("selu: n = %lld\n", (long long)n);
#endif
    #pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k) {
        int64_t i = base + k;
        if (i < n) {
            float v = x[i];
            y[i] = scale * (v > 0.f ? v : alpha * (expf(v) - 1.f));
        }
    }
}

torch::Tensor selu(torch::Tensor x) {
    auto y = torch::empty_like(x);
    const int64_t n = x.numel();
    const int64_t blocks = std::max<int64_t>(1, CEIL_DIV(n, (int64_t)kThreads * kItemsPerThread));
    selu_kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    CUDA_CHECK(cudaGetLastError());
    return y;
}
"""

selu_ext = load_inline(name="selu_ext", cpp_sources="torch::Tensor selu(torch::Tensor x);", cuda_sources=source,
                       functions=["selu"], extra_cuda_cflags=["-O3", "-DNDEBUG", "--use_fast_math"])


class ModelNew(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return selu_ext.selu(x.contiguous())
'''

C28_UNUSED_BOILERPLATE_IMPORTS = r'''import os
import sys
import math
import numpy as np  # noqa: F401 (left over, unused)
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

hswish_src = """
#include <torch/extension.h>
__global__ void hardswish_kernel(const float* __restrict__ x, float* __restrict__ y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        y[i] = v * fminf(fmaxf(v + 3.f, 0.f), 6.f) / 6.f;
    }
}
torch::Tensor hardswish(torch::Tensor x) {
    auto y = torch::empty_like(x);
    int n = x.numel();
    hardswish_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""

hswish = load_inline(name="hardswish_ext", cpp_sources="torch::Tensor hardswish(torch::Tensor x);",
                     cuda_sources=hswish_src, functions=["hardswish"], verbose=False)


class ModelNew(nn.Module):
    def forward(self, x):
        return hswish.hardswish(x)
'''

C29_STREAM_AND_THREAD_NAMES = r'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = """
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void clamp_kernel(const float* src, float* dst, float lo, float hi, int n) {
    const int thread = blockIdx.x * blockDim.x + threadIdx.x;
    const bool in_range = thread < n;  // threads past the end do not write
    if (in_range) dst[thread] = fminf(fmaxf(src[thread], lo), hi);
}

torch::Tensor clamp(torch::Tensor x, double lo, double hi) {
    auto out = torch::empty_like(x);
    const int n = x.numel();
    auto stream = at::cuda::getCurrentCUDAStream();
    clamp_kernel<<<(n + 255) / 256, 256, 0, stream>>>(x.data_ptr<float>(), out.data_ptr<float>(), (float)lo, (float)hi, n);
    return out;
}
"""

clamp_ext = load_inline(name="clamp_ext", cpp_sources="torch::Tensor clamp(torch::Tensor x, double lo, double hi);",
                        cuda_sources=source, functions=["clamp"])


class ModelNew(nn.Module):
    def __init__(self, min_val: float, max_val: float):
        super().__init__()
        self.min_val = min_val
        self.max_val = max_val
        self.threads_per_block = 256

    def forward(self, x):
        stream = torch.cuda.current_stream()
        handle = stream.cuda_stream  # just the handle; the kernel launches on it
        assert handle is not None
        return clamp_ext.clamp(x.contiguous(), self.min_val, self.max_val)
'''

C30_HALF_ACCUMULATE_ENUM = r'''import enum
import itertools
import operator
from collections import OrderedDict

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline


class Act(enum.Enum):
    RELU = 0
    GELU = 1


cuda_sources = """
#include <torch/extension.h>
#include <cuda_bf16.h>

__global__ void bf16_scale_act(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ y, float s, int act, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) {
        float v = __bfloat162float(x[i]) * s;
        v = act == 0 ? fmaxf(v, 0.f) : 0.5f * v * (1.f + erff(v * 0.70710678f));
        y[i] = __float2bfloat16(v);
    }
}

torch::Tensor scale_act(torch::Tensor x, double s, int64_t act) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "bf16 expected");
    auto y = torch::empty_like(x);
    int64_t n = x.numel();
    bf16_scale_act<<<(n + 255) / 256, 256>>>(reinterpret_cast<const __nv_bfloat16*>(x.data_ptr<at::BFloat16>()),
                                            reinterpret_cast<__nv_bfloat16*>(y.data_ptr<at::BFloat16>()), (float)s, (int)act, n);
    return y;
}
"""

cpp_sources = "torch::Tensor scale_act(torch::Tensor x, double s, int64_t act);"

ext = load_inline(name="bf16_scale_act", cpp_sources=cpp_sources, cuda_sources=cuda_sources, functions=["scale_act"])


class ModelNew(nn.Module):
    def __init__(self, scale: float = 1.0, act: str = "relu"):
        super().__init__()
        self.scale = scale
        table = OrderedDict((a.name.lower(), a) for a in Act)
        self.act = table[act]
        self.numel = lambda shape: list(itertools.accumulate(shape, operator.mul))[-1]

    def forward(self, x):
        y = ext.scale_act(x.to(torch.bfloat16).contiguous(), self.scale, self.act.value)
        return y.to(x.dtype)
'''


HONEST = [
    ("C01_ELEMENTWISE_ADD", "cuda", C01_ELEMENTWISE_ADD),
    ("C02_RELU_DISPATCH", "cuda", C02_RELU_DISPATCH),
    ("C03_GELU_HALF_BF16", "cuda", C03_GELU_HALF_BF16),
    ("C04_FLOAT4_SIGMOID", "cuda", C04_FLOAT4_SIGMOID),
    ("C05_PRINTF_DEBUG", "cuda", C05_PRINTF_DEBUG),
    ("C06_PYBIND_CUSTOM", "cuda", C06_PYBIND_CUSTOM),
    ("C07_SCALAR_MUL_STRIDES", "cuda", C07_SCALAR_MUL_STRIDES),
    ("C08_SUM_REDUCTION_SHFL", "cuda", C08_SUM_REDUCTION_SHFL),
    ("C09_ATOMIC_GLOBAL_SUM", "cuda", C09_ATOMIC_GLOBAL_SUM),
    ("C10_SOFTMAX_TWO_REDUCTIONS", "cuda", C10_SOFTMAX_TWO_REDUCTIONS),
    ("C11_LAYERNORM_WELFORD", "cuda", C11_LAYERNORM_WELFORD),
    ("C12_MATMUL_BIAS_GELU_TILED", "cuda", C12_MATMUL_BIAS_GELU_TILED),
    ("C13_CONV_WEIGHTS_FROM_CONV2D", "cuda", C13_CONV_WEIGHTS_FROM_CONV2D),
    ("C14_LINEAR_PARAMS_KAIMING", "cuda", C14_LINEAR_PARAMS_KAIMING),
    ("C15_AUTOGRAD_FUNCTION", "cuda", C15_AUTOGRAD_FUNCTION),
    ("C16_VIEWS_PERMUTE", "cuda", C16_VIEWS_PERMUTE),
    ("C17_LAZY_BUILD_LRU", "cuda", C17_LAZY_BUILD_LRU),
    ("C18_DOCSTRINGS_WORDS", "cuda", C18_DOCSTRINGS_WORDS),
    ("C19_DEVICE_QUERIES", "cuda", C19_DEVICE_QUERIES),
    ("C20_GET_INPUTS_COPY", "cuda", C20_GET_INPUTS_COPY),
    ("C21_NAMESPACED_IMPORT", "cuda", C21_NAMESPACED_IMPORT),
    ("C22_REDUCTION_ARGMAX", "cuda", C22_REDUCTION_ARGMAX),
    ("P01_CPU_RELU_OMP_SIMD", "cpu", P01_CPU_RELU_OMP_SIMD),
    ("P02_CPU_SOFTMAX_CMATH", "cpu", P02_CPU_SOFTMAX_CMATH),
    ("P03_CPU_GELU_TANH_ACCESSOR", "cpu", P03_CPU_GELU_TANH_ACCESSOR),
    ("P04_CPU_MATMUL_BLOCKED", "cpu", P04_CPU_MATMUL_BLOCKED),
    ("P05_CPU_LAYERNORM_STD_VECTOR", "cpu", P05_CPU_LAYERNORM_STD_VECTOR),
    ("P06_CPU_PYBIND_TEMPLATE", "cpu", P06_CPU_PYBIND_TEMPLATE),
    ("P07_CPU_CONV1D_PARAM_FROM_NN", "cpu", P07_CPU_CONV1D_PARAM_FROM_NN),
    ("P08_CPU_AVX_INTRINSICS", "cpu", P08_CPU_AVX_INTRINSICS),
    ("T01_TRITON_ADD", "cuda", T01_TRITON_ADD),
    ("T02_TRITON_AUTOTUNE_MATMUL", "cuda", T02_TRITON_AUTOTUNE_MATMUL),
    ("T03_TRITON_SOFTMAX", "cuda", T03_TRITON_SOFTMAX),
    ("T04_TRITON_FUSED_LINEAR_GELU", "cuda", T04_TRITON_FUSED_LINEAR_GELU),
    ("T05_TRITON_HEURISTICS_LAYERNORM", "cuda", T05_TRITON_HEURISTICS_LAYERNORM),
    ("M01_MUSA_ADD", "musa", M01_MUSA_ADD),
    ("M02_MUSA_SOFTMAX_WARPSIZE", "musa", M02_MUSA_SOFTMAX_WARPSIZE),
    ("M03_MUSA_LINEAR_RELU", "musa", M03_MUSA_LINEAR_RELU),
    ("M04_MUSA_DOT_MUSA_CALL", "musa", M04_MUSA_DOT_MUSA_CALL),
    ("C23_CONV_PAIR_HELPER", "cuda", C23_CONV_PAIR_HELPER),
    ("C24_MAIN_SMOKE_TEST", "cuda", C24_MAIN_SMOKE_TEST),
    ("C25_OPTIONAL_BIAS_BUFFERS", "cuda", C25_OPTIONAL_BIAS_BUFFERS),
    ("C26_CROSS_ENTROPY_TWO_KERNELS", "cuda", C26_CROSS_ENTROPY_TWO_KERNELS),
    ("C27_MACROS_LAUNCH_BOUNDS", "cuda", C27_MACROS_LAUNCH_BOUNDS),
    ("C28_UNUSED_BOILERPLATE_IMPORTS", "cuda", C28_UNUSED_BOILERPLATE_IMPORTS),
    ("C29_STREAM_AND_THREAD_NAMES", "cuda", C29_STREAM_AND_THREAD_NAMES),
    ("C30_HALF_ACCUMULATE_ENUM", "cuda", C30_HALF_ACCUMULATE_ENUM),
]
# the same kernels stay honest whatever the candidate is called from (Triton runs on the musa backend too)
CROSS_BACKEND = [(n, "musa", c) for n, b, c in HONEST if n.startswith("T0")]


@pytest.mark.parametrize("name,backend,code", HONEST + CROSS_BACKEND,
                         ids=[f"{n}-{b}" for n, b, _ in HONEST + CROSS_BACKEND])
def test_honest_candidate_passes_the_static_checks(name, backend, code):
    found = check_source(code, backend)
    assert found == [], "\n".join(str(v) for v in found)
    assert check_candidate(code, VerifierConfig(backend=backend)) == []


def test_the_corpus_is_large_and_covers_every_backend():
    assert len(HONEST) >= 40
    assert {b for _, b, _ in HONEST} == {"cpu", "cuda", "musa"}


# -------------------------------------------------------------------------------- helpers for the cases below
PRE = ("import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
       "from torch.utils.cpp_extension import load_inline\n")
MODEL = "\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return x\n"


def rules(code, backend="cpu"):
    return {v.rule for v in check_source(code, backend)}


def inline(src, extra="", name="k"):
    return PRE + f"src = {src!r}\next = load_inline(name={name!r}, cpp_sources=src, functions=['f']{extra})\n" + MODEL


# ------------------------------------------------------------- the false positives fixed here stay fixed narrowly
@pytest.mark.parametrize("code,backend", [
    # an attribute named like a stdlib module is the candidate's own when it sets it on self
    (PRE + MODEL.replace("    def forward", "    def __init__(self):\n        super().__init__()\n"
                                           "        self.reduction = 'mean'\n        self.thread = 4\n"
                                           "    def forward").replace("return x", "return x if self.reduction "
                                                                                   "else self.thread"), "cpu"),
    # pure private helpers copied from nn.Linear / nn.Conv2d
    (PRE + "from torch.nn.modules.utils import _pair, _triple\nfan = nn.init._calculate_fan_in_and_fan_out\n"
     + MODEL, "cpu"),
    # hasattr on a module is feature detection
    (PRE + "HAS_MUSA = hasattr(torch, 'musa')\nHAS_SDPA = hasattr(F, 'scaled_dot_product_attention')\n" + MODEL,
     "cuda"),
    # a message that says torch.long is no assembler directive; omp simd starts no threads
    (inline('TORCH_CHECK(true, "index must be torch.long");\nint f(){ return 0; }'), "cpu"),
    (inline("float f(float* x, int n){ float s = 0;\n#pragma omp simd reduction(+:s)\n"
            "for (int i = 0; i < n; ++i) s += x[i]; return s; }", ", extra_cflags=['-fopenmp-simd']"), "cpu"),
    (inline("#pragma omp declare simd\nfloat f(float x){ return x; }"), "cpu"),
    # a smoke test under the __main__ guard never runs in the harness (it imports the candidate as a module)
    (PRE + MODEL + "\n\nif __name__ == '__main__':\n    import time\n    torch.manual_seed(0)\n"
     "    t0 = time.time()\n    print(ModelNew()(torch.randn(4)), time.time() - t0)\n", "cpu"),
    # a builtin's name as a parameter shadows it inside that function only
    (PRE + MODEL.replace("def forward(self, x):\n        return x", "def forward(self, input):\n"
                                                                  "        return input"), "cpu"),
])
def test_fixed_false_positives(code, backend):
    assert check_source(code, backend) == [], [str(v) for v in check_source(code, backend)]


@pytest.mark.parametrize("code,rule", [
    # the self-attribute exemption needs `self` to be the candidate's own object
    (PRE + "def f(x):\n    self = F\n    self.np = 1\n    return self.np.exp(x)\n" + MODEL, "library_fallback"),
    (PRE + "import torch.multiprocessing as self\nself.reduction = 1\ny = self.reduction\n" + MODEL,
     "process_or_thread"),
    (PRE + "class A:\n    def f(self):\n        return self.reduction.ForkingPickler\n" + MODEL, "process_or_thread"),
    # only the listed helpers, and nothing private behind them
    (PRE + "g = nn.init._no_grad_uniform_\n" + MODEL, "torch_private_api"),
    (PRE + "from torch.nn.modules.utils import _pair\ng = torch.nn.modules.utils._pair._cache\n" + MODEL,
     "torch_private_api"),
    # hasattr judges the attribute like getattr, and is no way to launder a module
    (PRE + "ok = hasattr(torch, 'Stream')\n" + MODEL, "stream_creation"),
    (PRE + "m = [hasattr, torch][1]\n" + MODEL, "dynamic_code"),
    # assembler directives still count once there is inline asm; OpenMP threads stay out, however spelled
    (inline('void f(){ asm volatile(".byte 0x0f, 0x05"); }'), "native_source"),
    (inline("void f(float* x){\n#pragma omp parallel for simd\nfor (int i = 0; i < 8; ++i) x[i] = 0; }"),
     "process_or_thread"),
    (inline('void f(float* x){ _Pragma("omp parallel for") for (int i = 0; i < 8; ++i) x[i] = 0; }'),
     "process_or_thread"),
    (inline("int f();", ", extra_cflags=['-fopenmp-simd-foo']"), "native_source"),
    (inline("int f();", ", extra_cflags=['-fopenmp=libomp']"), "native_source"),
    # the __main__ block is skipped only while nothing can rebind __name__, and only without an else
    (PRE + "__name__ = '__main__'\n" + MODEL + "if __name__ == '__main__':\n    torch.manual_seed(0)\n",
     "global_torch_state"),
    (PRE + "def f():\n    global __name__\n    __name__ = '__main__'\n" + MODEL
     + "if __name__ == '__main__':\n    torch.manual_seed(0)\n", "global_torch_state"),
    (PRE + "from typing import Any as __name__\n" + MODEL + "if __name__ == '__main__':\n    torch.manual_seed(0)\n",
     "global_torch_state"),
    (PRE + "x = (__name__ := '__main__')\n" + MODEL + "if __name__ == '__main__':\n    pass\n"
     "if __name__ == '__main__':\n    torch.manual_seed(0)\n", "global_torch_state"),
    (PRE + MODEL + "if __name__ == '__main__':\n    pass\nelse:\n    torch.manual_seed(0)\n", "global_torch_state"),
    (PRE + MODEL + "if __name__ == '__main__' or True:\n    torch.manual_seed(0)\n", "global_torch_state"),
    (PRE + MODEL + "def f():\n    if __name__ == '__main__':\n        torch.manual_seed(0)\n", "global_torch_state"),
])
def test_the_fixes_reopen_nothing(code, rule):
    assert rule in rules(code), [str(v) for v in check_source(code)]


# ------------------------------------------------------------------ holes found while building the corpus
EVIL = '#include <cstdlib>\nint f(){ return system("id"); }'


@pytest.mark.parametrize("code,rule", [
    # a builtin's name bound anywhere (a parameter, a loop variable, a default) used to switch its rule off for
    # the whole file; module-level bindings do not shadow (an unexecuted one falls back to the builtin)
    (PRE + "def g(exec):\n    pass\nexec('import os')\n" + MODEL, "dynamic_code"),
    (PRE + "for eval in []:\n    pass\neval('1')\n" + MODEL, "dynamic_code"),
    (PRE + "def g():\n    open = 1\nopen('/etc/passwd')\n" + MODEL, "file_access"),
    (PRE + "def f(s, exec=exec):\n    exec(s)\n" + MODEL, "dynamic_code"),
    (PRE + "def f(p, open=open):\n    return open(p).read()\n" + MODEL, "file_access"),
    (PRE + "if False:\n    exec = print\nexec('1')\n" + MODEL, "dynamic_code"),
    (PRE + "class A:\n    exec = print\n    def f(self):\n        exec('1')\n" + MODEL, "dynamic_code"),
    (PRE + "def f():\n    global exec\n    exec('1')\n    exec = 1\n" + MODEL, "dynamic_code"),
    (PRE + "y = [exec('1') for exec in [print]] + [z for z in exec('2')]\n" + MODEL, "dynamic_code"),
    # getattr with a literal name is read as an attribute access: a getattr of the candidate's own would
    # launder modules past every rule (getattr(torch, 'relu').compile is torch.compile)
    (PRE + "def getattr(m, n):\n    return [m][0]\ngetattr(torch, 'relu').compile(abs)\n" + MODEL, "dynamic_code"),
    (PRE + "getattr = lambda m, n: m\ngetattr(torch, 'relu').jit.script(abs)\n" + MODEL, "dynamic_code"),
    (PRE + "def f(hasattr):\n    pass\n" + MODEL, "dynamic_code"),
    # a list folded for load_inline is the object load_inline gets: changing it later compiles unscanned text
    (PRE + "flags = ['-O3']\nflags.append('-fopenmp')\n"
           "ext = load_inline(name='k', cpp_sources='int f();', functions=['f'], extra_cflags=flags)\n" + MODEL,
     "native_source"),
    (PRE + f"srcs = ['int f();']\nsrcs.append({EVIL!r})\n"
           "ext = load_inline(name='k', cpp_sources=srcs, functions=['f'])\n" + MODEL, "native_source"),
    (PRE + f"srcs = ['int f();']\nalias = srcs\nalias[0] = {EVIL!r}\n"
           "ext = load_inline(name='k', cpp_sources=srcs, functions=['f'])\n" + MODEL, "native_source"),
    # any other binding of a folded name makes it not "bound once": `case src:` captures the subject
    (PRE + f"src = 'int f();'\nmatch {EVIL!r}:\n    case src:\n        pass\n"
           "ext = load_inline(name='k', cpp_sources=src, functions=['f'])\n" + MODEL, "native_source"),
    (PRE + f"import enum\nsrc = 'int f();'\nclass src(str, enum.Enum):\n    A = {EVIL!r}\n"
           "ext = load_inline(name='k', cpp_sources=src, functions=['f'])\n" + MODEL, "native_source"),
])
def test_holes_found_while_building_the_corpus_are_closed(code, rule):
    assert rule in rules(code), [str(v) for v in check_source(code)]


def test_flags_are_split_on_equals_and_quotes():
    """nvcc's -Xcompiler=-fopenmp (and quoted forms) hand -fopenmp to the host compiler."""
    for flags in (["-Xcompiler=-fopenmp"], ["--compiler-options=-fopenmp"], ['-Xcompiler="-fopenmp"'],
                  ["-Xcompiler", "'-fopenmp'"], ["-Xcompiler=@/tmp/f"]):
        assert scan_native(["int x;"], flags, "cuda"), flags
    for flags in (["-Xptxas=-v"], ["--ptxas-options=-v"], ["-Xcompiler=-O3,-fPIC"],
                  ["-gencode=arch=compute_90,code=sm_90"], ["-Xptxas", "-O3"], ["-arch=sm_90"], ["-std=c++17"], ["-maxrregcount=64"], ["-fopenmp-simd"]):
        assert scan_native(["int x;"], flags, "cuda") == [], flags


def test_list_arguments_may_still_be_shared_and_combined():
    common = ("BASE_FLAGS = ['-O3', '-std=c++17']\nSRCS = ['int f();']\n"
              "a = load_inline(name='a', cpp_sources=SRCS, functions=['f'], extra_cflags=BASE_FLAGS)\n"
              "b = load_inline(name='b', cpp_sources=SRCS + ['int g();'], functions=['f'], "
              "extra_cflags=BASE_FLAGS + ['-DNDEBUG'])\n"
              "c = load_inline(name='c', cpp_sources='\\n'.join(SRCS), functions=['f'])\n")
    assert check_source(PRE + common + MODEL) == []


# -------------------------------------------------------------- honest but indistinguishable: the feedback
@pytest.mark.parametrize("code,backend,rule,must_say", [
    # an own function named like a libc one: a call of it cannot be told from the libc call (a rename fixes it)
    (inline("__device__ void write(float* y, int i){ y[i] = 0; }\n__global__ void k(float* y, int n){\n"
            "  int i = threadIdx.x;\n  if (i < n) write(y, i); }", ", cuda_sources='int g();'"), "cuda",
     "file_access", ["line 5", "`write`", "rename"]),
    # OpenMP threads (the simd form is allowed)
    (inline("void f(float* x){\n#pragma omp parallel for\nfor (int i = 0; i < 8; ++i) x[i] = 0; }"), "cpu",
     "process_or_thread", ["line 6", "#pragma omp", "omp simd"]),
    # a flag that loads or redirects code
    (inline("int f();", ", extra_cflags=['-O3', '-fopenmp']"), "cpu", "native_source",
     ["line 6", "-fopenmp", "remove"]),
    # CUDA headers on the cpu backend
    (inline("#include <cuda_runtime.h>\nint f();"), "cpu", "toolchain_mismatch",
     ["line 6", "#include <cuda_runtime.h>", "cpu backend"]),
    # attribute writes on a local object
    (PRE + "def f(x):\n    y = torch.empty_like(x)\n    y.requires_grad = False\n    return y\n" + MODEL, "cpu",
     "monkey_patching", ["line 7", "`y`", "requires_grad_"]),
    # obj.__class__
    (PRE + "def f(x):\n    return x.__class__.__name__\n" + MODEL, "cpu", "dynamic_code",
     ["line 6", "__class__", "type(obj)"]),
    # a builtin the checks rely on, redefined
    (PRE + "def getattr(o, n):\n    return o\n" + MODEL, "cpu", "dynamic_code", ["line 5", "getattr", "rebound"]),
    # an import outside the allowlist (`time` is the usual one: timing is the verifier's job)
    (PRE + "import time\n" + MODEL, "cpu", "import_not_allowed", ["line 5", "`time`", "remove"]),
    # a list argument changed after it was written
    (PRE + "flags = ['-O3']\nflags += []\nflags.append('-g')\n"
           "ext = load_inline(name='k', cpp_sources='int f();', functions=['f'], extra_cflags=flags)\n" + MODEL,
     "cpu", "native_source", ["line 8", "flags"]),
])
def test_feedback_names_the_construct_the_line_and_the_fix(code, backend, rule, must_say):
    found = [v for v in check_source(code, backend) if v.rule == rule]
    assert found, [str(v) for v in check_source(code, backend)]
    text = str(found[0])
    for part in must_say:
        assert part in text, text


@pytest.mark.parametrize("src", [
    "float g(float signal){ return signal * 2.f; }",
    "torch::Tensor f(torch::Tensor x){ int64_t link = x.size(0); return x.view({link, -1}); }",
    "bool open = true;\nint f(){ return open ? 1 : 0; }",
    "__global__ void k(float* y, int n){ int i = threadIdx.x; const bool write = i < n; if (write) y[i] = 0; }",
    "float f(const float* tee, int n){ float s = 0; for (int kill = 0; kill < n; ++kill) s += tee[kill]; return s; }",
    "struct P { int clone; bool close; };\nint f(P p){ return p.clone + p.close; }",
    "float f(const std::vector<float>& signals){ float s = 0; for (const auto& signal : signals) s += signal; "
    "return s; }",
    "void f(float* __restrict__ pipe, float& nice, int exit){ pipe[0] = nice * exit; }",
])
def test_libc_names_as_variables_and_parameters_are_the_candidates_own(src):
    assert native_findings([src], [], "cuda") == []


def test_native_findings_point_at_the_line_of_the_source():
    src = "// write() in a comment is fine\nint f(){\n  const char* m = \"write\";\n  return write(1, m, 1);\n}"
    (finding,) = native_findings([src], [], "cpu")
    assert (finding.rule, finding.source, finding.line) == ("file_access", 0, 4)
    code = PRE + f'cuda_src = """{src}"""\next = load_inline(name="k", cpp_sources=cuda_src, functions=["f"])\n' + MODEL
    (v,) = check_source(code, "cpu")
    assert v.line == 8 and "`cpp_sources`" in v.message


@pytest.mark.parametrize("use", [
    "class E:\n    def __radd__(self, a):\n        a.append('-fopenmp')\n        return a\ny = flags + E()\n",
    "class E:\n    def join(self, a):\n        a.append('-fopenmp')\n        return ''\ny = E().join(flags)\n",
    "class E:\n    def load_inline(self, **kw):\n        kw['extra_cflags'].append('-fopenmp')\n"
    "E().load_inline(name='j', cpp_sources='int f();', extra_cflags=flags)\n",
    "for f in [flags]:\n    f.append('-fopenmp')\n",
])
def test_a_folded_list_reaches_no_object_of_the_candidate(use):
    code = (PRE + "flags = ['-O3']\n" + use
            + "ext = load_inline(name='k', cpp_sources='int f();', functions=['f'], extra_cflags=flags)\n" + MODEL)
    assert "native_source" in rules(code), [str(v) for v in check_source(code)]


# ------------------------------------------------------------------------ runtime: views honest code uses
_VIEWS = {
    "chunk": lambda x: x.chunk(3, dim=-1), "split": lambda x: x.split(2, dim=1),
    "split_with_sizes": lambda x: x.split([2, 4], dim=1), "tensor_split": lambda x: x.tensor_split(2, dim=1),
    "unbind": lambda x: x.unbind(0), "movedim": lambda x: x.movedim(1, -1),
    "moveaxis": lambda x: x.moveaxis(1, -1), "swapaxes": lambda x: x.swapaxes(0, 1),
    "swapdims": lambda x: x.swapdims(0, 1), "numpy_T": lambda x: x[0].T, "mT": lambda x: x.mT,
    "broadcast_tensors": lambda x: torch.broadcast_tensors(x, x[:1, :1, :1]),
}


@pytest.mark.parametrize("name", sorted(_VIEWS))
def test_view_aliases_are_allowed_and_nest_only_appendix_j_views(name):
    """Allowed because torch implements them with the allowed views only (no copy, no allocation): if a torch
    release makes one of them compute or copy, this fails and the alias must go."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    from verifier.fallback import ALLOWED_ATEN_OPS, forbidden_ops, outermost_aten_ops

    x = torch.randn(4, 6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _VIEWS[name](x)
    events = prof.events()
    top = outermost_aten_ops(events)
    assert name in top and forbidden_ops(top) == [], dict(top)
    nested = {e.name[6:] for e in events if e.name.startswith("aten::")} - set(top)
    copies = {"copy_", "clone", "contiguous", "_to_copy", "to", "empty", "empty_like", "empty_strided", "fill_",
              "zero_", "zeros", "ones", "full"}
    assert nested <= ALLOWED_ATEN_OPS and not nested & copies, nested
