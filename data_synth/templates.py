"""Stage-3 tasks: module-level templates (blocks of real networks), each with sampled sizes and variants.

A template is a function ``(rng, sizes, dtype) -> Template``; its class body is written here and the rest
of the file (constants, get_inputs, get_init_inputs) by ``render.render_module``. Families and ops are
declared by the template so diagnosis and reporting see them without profiling.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Callable

from .ir import Dim, InputSpec, TensorSpec
from .render import Rendered, render_module
from .sizes import SizeSampler


@dataclasses.dataclass
class Template:
    name: str
    rendered: Rendered
    families: list[str]
    ops: list[str]


def _act(rng: random.Random) -> tuple[str, str]:
    return rng.choice((("relu", "torch.relu({})"), ("gelu", "F.gelu({})"), ("silu", "F.silu({})"),
                       ("tanh", "torch.tanh({})")))


def mlp(rng: random.Random, s: SizeSampler, dtype: str) -> Template:
    b = s.dim("batch_size", (16, 64), (256, 2048))
    i, h, o = s.dim("in_features", (32, 128), (512, 2048)), s.dim("hidden", (64, 256), (1024, 8192)), \
        s.dim("out_features", (16, 128), (256, 2048))
    a, expr = _act(rng)
    r = render_module(f"Two-layer MLP: Linear, {a}, Linear.", ["in_features", "hidden", "out_features"],
                      ["self.fc1 = nn.Linear(in_features, hidden)", "self.fc2 = nn.Linear(hidden, out_features)"],
                      ["x"], [f"x = {expr.format('self.fc1(x)')}", "return self.fc2(x)"], [b, i, h, o], [],
                      [InputSpec("x", TensorSpec((b, i), dtype))])
    return Template("MLP_" + a.capitalize(), r, ["gemm", "elementwise"], ["linear", a, "linear"])


def ffn_residual(rng, s, dtype):
    b = s.dim("batch_size", (4, 16), (8, 64))
    t = s.dim("seq_len", (8, 64), (128, 1024))
    d = s.dim("d_model", (32, 128), (512, 2048))
    h = Dim(d.cpu * 4, d.gpu * 4, s.names.take("d_ff"))
    r = render_module("Pre-norm transformer feed-forward block with a residual connection.",
                      ["d_model", "d_ff"],
                      ["self.norm = nn.LayerNorm(d_model)", "self.up = nn.Linear(d_model, d_ff)",
                       "self.down = nn.Linear(d_ff, d_model)"],
                      ["x"], ["h = F.gelu(self.up(self.norm(x)))", "return x + self.down(h)"], [b, t, d, h], [],
                      [InputSpec("x", TensorSpec((b, t, d), dtype))])
    return Template("FFN_Residual", r, ["normalization", "gemm", "elementwise"],
                    ["layer_norm", "linear", "gelu", "linear", "add"])


def attention_block(rng, s, dtype):
    b = s.dim("batch_size", (1, 4), (4, 16))
    t = s.dim("seq_len", (16, 64), (256, 1024))
    heads, hd = rng.choice((2, 4)), rng.choice((8, 16, 32))
    nh = Dim(heads, heads * 4, s.names.take("num_heads"))
    hdim = Dim(hd, 64, s.names.take("head_dim"))
    embed = Dim(heads * hd, heads * 4 * 64, s.names.take("embed_dim"))
    causal = rng.random() < 0.5
    r = render_module(f"Multi-head self-attention{' (causal)' if causal else ''}: QKV projection, scaled "
                      "dot-product attention, output projection.", ["num_heads", "head_dim"],
                      ["self.num_heads = num_heads", "self.head_dim = head_dim",
                       "self.qkv = nn.Linear(num_heads * head_dim, 3 * num_heads * head_dim)",
                       "self.proj = nn.Linear(num_heads * head_dim, num_heads * head_dim)"],
                      ["x"], ["b, t, _ = x.shape",
                              "q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim)"
                              ".permute(2, 0, 3, 1, 4)",
                              f"y = F.scaled_dot_product_attention(q, k, v, is_causal={causal})",
                              "return self.proj(y.transpose(1, 2).reshape(b, t, -1))"],
                      [b, t, nh, hdim, embed], [], [InputSpec("x", TensorSpec((b, t, embed), dtype))])
    return Template("Self_Attention", r, ["gemm", "attention", "layout"], ["linear", "sdpa", "linear"])


def conv_block(rng, s, dtype):
    n = s.dim("batch_size", (2, 8), (16, 64))
    c = s.dim("in_channels", (3, 16), (16, 64))
    o = s.dim("out_channels", (8, 32), (64, 256))
    hw = s.dim("height", (16, 48), (64, 224))
    w = Dim(hw.cpu, hw.gpu, s.names.take("width"))
    pool = rng.choice(("max", "avg"))
    r = render_module(f"Conv2d, BatchNorm2d (training mode), ReLU, {pool} pooling.", ["in_channels", "out_channels"],
                      ["self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)",
                       "self.bn = nn.BatchNorm2d(out_channels)"],
                      ["x"], ["x = torch.relu(self.bn(self.conv(x)))", f"return F.{pool}_pool2d(x, 2)"],
                      [n, c, o, hw, w], [], [InputSpec("x", TensorSpec((n, c, hw, w), dtype))])
    return Template("Conv_BN_ReLU_Pool", r, ["conv", "normalization", "elementwise", "pooling"],
                    ["conv2d", "batch_norm2d", "relu", f"{pool}_pool2d"])


def residual_block(rng, s, dtype):
    n = s.dim("batch_size", (2, 4), (8, 32))
    c = s.dim("channels", (8, 32), (64, 128))
    hw = s.dim("height", (8, 32), (32, 112))
    w = Dim(hw.cpu, hw.gpu, s.names.take("width"))
    r = render_module("ResNet basic block: two 3x3 convolutions with BatchNorm, identity shortcut, ReLU.",
                      ["channels"],
                      ["self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)",
                       "self.bn1 = nn.BatchNorm2d(channels)",
                       "self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)",
                       "self.bn2 = nn.BatchNorm2d(channels)"],
                      ["x"], ["y = torch.relu(self.bn1(self.conv1(x)))", "y = self.bn2(self.conv2(y))",
                              "return torch.relu(x + y)"], [n, c, hw, w], [],
                      [InputSpec("x", TensorSpec((n, c, hw, w), dtype))])
    return Template("ResNet_Basic_Block", r, ["conv", "normalization", "elementwise"],
                    ["conv2d", "batch_norm2d", "relu", "conv2d", "batch_norm2d", "add", "relu"])


def rmsnorm_swiglu(rng, s, dtype):
    b = s.dim("batch_size", (4, 16), (8, 32))
    t = s.dim("seq_len", (8, 32), (128, 1024))
    d = s.dim("d_model", (32, 128), (512, 2048))
    h = s.dim("d_ff", (64, 256), (1024, 8192))
    r = render_module("RMSNorm followed by a SwiGLU feed-forward layer.", ["d_model", "d_ff"],
                      ["self.norm = nn.RMSNorm(d_model, eps=1e-6)", "self.gate = nn.Linear(d_model, d_ff, bias=False)",
                       "self.up = nn.Linear(d_model, d_ff, bias=False)",
                       "self.down = nn.Linear(d_ff, d_model, bias=False)"],
                      ["x"], ["h = self.norm(x)", "return self.down(F.silu(self.gate(h)) * self.up(h))"],
                      [b, t, d, h], [], [InputSpec("x", TensorSpec((b, t, d), dtype))])
    return Template("RMSNorm_SwiGLU", r, ["normalization", "gemm", "elementwise"],
                    ["rms_norm", "linear", "silu", "mul", "linear"])


def gru_cell(rng, s, dtype):
    b = s.dim("batch_size", (8, 64), (256, 2048))
    i = s.dim("input_size", (16, 128), (256, 1024))
    h = s.dim("hidden_size", (16, 128), (256, 1024))
    r = render_module("One GRU cell step written with linear layers and gates.", ["input_size", "hidden_size"],
                      ["self.x2h = nn.Linear(input_size, 3 * hidden_size)",
                       "self.h2h = nn.Linear(hidden_size, 3 * hidden_size)"],
                      ["x", "h"], ["xr, xz, xn = self.x2h(x).chunk(3, dim=-1)",
                                   "hr, hz, hn = self.h2h(h).chunk(3, dim=-1)",
                                   "r = torch.sigmoid(xr + hr)", "z = torch.sigmoid(xz + hz)",
                                   "n = torch.tanh(xn + r * hn)", "return (1 - z) * n + z * h"],
                      [b, i, h], [], [InputSpec("x", TensorSpec((b, i), dtype)),
                                      InputSpec("h", TensorSpec((b, h), dtype))])
    return Template("GRU_Cell", r, ["gemm", "elementwise"], ["linear", "linear", "sigmoid", "tanh", "mul", "add"])


def depthwise_separable(rng, s, dtype):
    n = s.dim("batch_size", (2, 8), (16, 64))
    c = s.dim("in_channels", (8, 32), (32, 128))
    o = s.dim("out_channels", (8, 64), (64, 256))
    hw = s.dim("height", (16, 48), (56, 112))
    w = Dim(hw.cpu, hw.gpu, s.names.take("width"))
    r = render_module("Depthwise-separable convolution: depthwise 3x3, BatchNorm, ReLU6, pointwise 1x1.",
                      ["in_channels", "out_channels"],
                      ["self.dw = nn.Conv2d(in_channels, in_channels, 3, padding=1, groups=in_channels, bias=False)",
                       "self.bn = nn.BatchNorm2d(in_channels)", "self.pw = nn.Conv2d(in_channels, out_channels, 1)"],
                      ["x"], ["return self.pw(F.relu6(self.bn(self.dw(x))))"], [n, c, o, hw, w], [],
                      [InputSpec("x", TensorSpec((n, c, hw, w), dtype))])
    return Template("Depthwise_Separable_Conv", r, ["conv", "normalization", "elementwise"],
                    ["conv2d_depthwise", "batch_norm2d", "relu6", "conv2d"])


def classifier_head(rng, s, dtype):
    n = s.dim("batch_size", (4, 16), (32, 256))
    c = s.dim("channels", (16, 64), (256, 1024))
    hw = s.dim("height", (4, 16), (7, 28))
    w = Dim(hw.cpu, hw.gpu, s.names.take("width"))
    k = s.dim("num_classes", (10, 100), (1000, 4096))
    r = render_module("Classifier head: global average pooling, linear layer, log-softmax.",
                      ["channels", "num_classes"], ["self.fc = nn.Linear(channels, num_classes)"],
                      ["x"], ["x = F.adaptive_avg_pool2d(x, 1).flatten(1)",
                              "return torch.log_softmax(self.fc(x), dim=1)"],
                      [n, c, hw, w, k], [], [InputSpec("x", TensorSpec((n, c, hw, w), dtype))])
    return Template("Classifier_Head", r, ["pooling", "gemm", "softmax"],
                    ["adaptive_avg_pool2d", "linear", "log_softmax"])


def embedding_pool(rng, s, dtype):
    b = s.dim("batch_size", (4, 32), (64, 512))
    t = s.dim("seq_len", (8, 64), (128, 512))
    v = s.dim("vocab_size", (500, 4000), (32000, 64000))
    e = s.dim("embed_dim", (32, 128), (256, 1024))
    r = render_module("Embedding lookup, mean over the sequence, LayerNorm.", ["vocab_size", "embed_dim"],
                      ["self.embedding = nn.Embedding(vocab_size, embed_dim)", "self.norm = nn.LayerNorm(embed_dim)"],
                      ["ids"], ["return self.norm(self.embedding(ids).mean(dim=1))"], [b, t, v, e], [],
                      [InputSpec("ids", TensorSpec((b, t), "int64", "index", high=v))])
    return Template("Embedding_Mean_LayerNorm", r, ["indexing", "reduction", "normalization"],
                    ["embedding", "mean", "layer_norm"])


def manual_attention(rng, s, dtype):
    b = s.dim("batch_size", (2, 8), (8, 32))
    t = s.dim("seq_len", (16, 128), (256, 2048))
    d = s.dim("head_dim", (16, 64), (64, 128))
    r = render_module("Attention written out: scaled scores, softmax over keys, weighted sum of values.", [],
                      [], ["q", "k", "v"], ["scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])",
                                            "return torch.matmul(torch.softmax(scores, dim=-1), v)"],
                      [b, t, d], [], [InputSpec(n_, TensorSpec((b, t, d), dtype)) for n_ in ("q", "k", "v")])
    return Template("Manual_Attention", r, ["gemm", "softmax"], ["matmul", "softmax", "matmul"])


TEMPLATES: dict[str, Callable[[random.Random, SizeSampler, str], Template]] = {
    "mlp": mlp, "ffn_residual": ffn_residual, "attention_block": attention_block, "conv_block": conv_block,
    "residual_block": residual_block, "rmsnorm_swiglu": rmsnorm_swiglu, "gru_cell": gru_cell,
    "depthwise_separable": depthwise_separable, "classifier_head": classifier_head,
    "embedding_pool": embedding_pool, "manual_attention": manual_attention,
}
