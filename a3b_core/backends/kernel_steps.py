"""Decoding work other than the routed experts computed by the numba kernels (cpu_kernels.py), attached at load to
the modules that call them: a dense matrix's product with a few rows (a quantised matrix's products of more rows take
its kernel-dequantised weights), and a Gated DeltaNet layer's token step.

A decoding step of the text model is mostly small products and many small torch calls, each with a fixed cost.
- Dense products of up to GEMV_MAX_ROWS rows, those of decoding (QuantizedLinear in int8 and int4; CpuLinear and
  FusedLinear in bf16): torch's weight-only int8 kernel took 2-2.5x the kernel's time at every size from 64 to 1024 rows
  (1024 inputs, 2 threads, an AVX2 EPYC). bf16 is summed as torch's matrix-vector kernel does (fp32 sums of the exact
  weights, rounded once), and the kernel only pays from about BF16_KERNEL_MIN_ROWS rows on (1024 rows: 141 against 163
  us; 512 rows: 99 against 88 us): smaller bf16 matrices (routers, gates, small projections) keep torch's product.
- A Gated DeltaNet layer's step from its input projections to its gated norm (the conv's step, the L2 norms, the
  delta rule on the fp32 state, the gated RMSNorm): about 40 torch calls become one.
Both compute in fp32 (the DeltaNet step is the fp32 computation itself; torch's bf16 path rounds its intermediates to
bf16), and a row's result does not depend on the other rows of a batch. They are attached only to models whose
compute dtype is not fp32: the fp32 mode stays the reference's, layer for layer. Without numba (kernel_experts.py
says when) nothing is attached and torch's path runs.
"""
from __future__ import annotations

import warnings
from functools import cache
from types import ModuleType, SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .dense import QuantizedLinear
from .kernel_experts import FORMAT_CODES, KERNEL_FORMATS, LOCK, compiled_kernels, dequantized_product, \
    kernel_arrays, kernels_enabled, plain_cpu, set_threads
from .products import GEMV_MAX_ROWS, CpuLinear, FusedLinear

BF16_KERNEL_MIN_ROWS = 1024


class DenseKernel:
    """A dense matrix's product with few rows by the numba kernel (cpu_kernels.matrix_rows), for the CpuLinear,
    FusedLinear or QuantizedLinear that holds the matrix and calls it (not a module: the matrix stays its owner's).
    Rows are summed in fp32 from the exact weights and rounded once to the input's dtype. A quantised matrix's
    products of more rows take its kernel-dequantised weights and torch's product, as the routed experts' do."""

    def __init__(self, fmt: str, stack: nn.Module | torch.Tensor, kernels: ModuleType):
        self.code, self.kernels = FORMAT_CODES[fmt], kernels
        self.arrays = kernel_arrays(fmt, stack)
        self.quantised = fmt != "bf16"
        self.shape = tuple(stack.shape[1:])  # (out, in)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the kernel computes this product: a plain CPU tensor of few rows, or of any rows when quantised."""
        return (self.quantised or x.numel() <= GEMV_MAX_ROWS * x.shape[-1]) and plain_cpu(x)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.numel() > GEMV_MAX_ROWS * x.shape[-1]:  # quantised (takes): no bias
            return dequantized_product(self.kernels, self.code, self.arrays, self.shape, 0, x)
        rows = x.detach().float().reshape(-1, x.shape[-1]).contiguous().numpy()
        out = torch.empty(*x.shape[:-1], self.shape[0])
        with LOCK:
            set_threads(self.kernels)
            self.kernels.matrix_rows(self.code, *self.arrays, rows, out.view(len(rows), -1).numpy())
        if bias is not None:
            out += bias
        return out.to(x.dtype)


class DeltaNetKernel:
    """A Gated DeltaNet layer's decoding step after its input projections (cpu_kernels.gated_delta_step), for the
    layer that calls it; holds fp32 copies of the layer's small parameters (conv taps, decay and norm weights)."""

    def __init__(self, layer: nn.Module | SimpleNamespace, kernels: ModuleType):
        self.kernels = kernels
        taps = layer.conv1d.weight.shape[-1]
        self.conv_w = layer.conv1d.weight.detach().float().reshape(-1, taps).contiguous().numpy()
        self.a_log, self.dt_bias, self.norm_w = (p.detach().float().contiguous().numpy()
                                                 for p in (layer.A_log, layer.dt_bias, layer.norm.weight))
        self.eps, self.key_heads = np.float32(layer.cfg.rms_norm_eps), layer.nk

    def takes(self, history: torch.Tensor, state: torch.Tensor) -> bool:
        """Whether the kernel can update this cache's tensors in place (plain, contiguous fp32 on the CPU)."""
        return all(plain_cpu(t) and t.is_contiguous() and t.dtype == torch.float32 for t in (history, state))

    def __call__(self, qkv: torch.Tensor, z: torch.Tensor, beta: torch.Tensor, a: torch.Tensor,
                 history: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The gated norm's output [B, 1, nv * dv] (fp32) for projections [B, 1, ...]; history and state updated."""
        qkv, z, beta, a = (t.detach()[:, 0].float().contiguous().numpy() for t in (qkv, z, beta, a))
        out = np.empty(z.shape, np.float32)
        with LOCK:
            set_threads(self.kernels)
            self.kernels.gated_delta_step(qkv, z, beta, a, self.conv_w, history.numpy(), self.a_log, self.dt_bias,
                                          self.norm_w, self.eps, self.key_heads, state.numpy(), out)
        return torch.from_numpy(out)[:, None]


@cache
def checked_step_kernels() -> ModuleType | None:
    """The kernels once this module's two have compiled (every signature it calls) and reproduced small cases, or
    None with a warning: a kernel that cannot compile fails at load, not in the middle of a generation."""
    kernels = compiled_kernels()
    try:
        check_step_kernels(kernels)
    except Exception as exc:  # numba's compile errors have many types; any failure means torch's path
        warnings.warn(f"a3b_core: numba could not compile the CPU decoding kernels ({exc}); using torch's products "
                      "for dense matrices and the DeltaNet step.", stacklevel=2)
        return None
    return kernels


def check_step_kernels(kernels: ModuleType) -> None:
    """A product of two rows with a bf16, an int8 and an int4 matrix; a DeltaNet step from an empty state and
    history, where the delta rule reduces to o = (q . k) * beta * v."""
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(64, 64, generator=g).bfloat16(), torch.randn(2, 64, generator=g)
    cases = [(DenseKernel("bf16", weight[None], kernels)(x), weight.float())]
    for fmt in ("int8", "int4"):
        quantised = QuantizedLinear(fmt, weight.float()).matrix
        cases.append((DenseKernel(fmt, quantised, kernels)(x), quantised.dequantize(0)))
    for got, matrix in cases:
        if not torch.allclose(got, x @ matrix.t(), rtol=1e-4, atol=1e-4):
            raise ValueError("the dense kernel's product differs from torch's")
    heads, dim, taps = 2, 16, 4
    qkv, z = torch.randn(1, 1, 3 * heads * dim, generator=g), torch.randn(1, 1, heads * dim, generator=g)
    beta, a = torch.randn(1, 1, heads, generator=g), torch.randn(1, 1, heads, generator=g)
    conv_w = torch.randn(3 * heads * dim, 1, taps, generator=g)
    history, state = torch.zeros(1, taps - 1, 3 * heads * dim), torch.zeros(1, heads, dim, dim)
    layer = SimpleNamespace(conv1d=SimpleNamespace(weight=conv_w), A_log=torch.zeros(heads),
                            dt_bias=torch.zeros(heads), norm=SimpleNamespace(weight=torch.ones(dim)),
                            cfg=SimpleNamespace(rms_norm_eps=1e-6), nk=heads)  # a GatedDeltaNet's parameters
    got = DeltaNetKernel(layer, kernels)(qkv, z, beta, a, history, state)[0, 0].view(heads, dim)
    q, k, v = F.silu(qkv[0, 0] * conv_w[:, 0, -1]).view(3, heads, dim)
    o = (F.normalize(q, dim=-1) * F.normalize(k, dim=-1)).sum(-1, keepdim=True) * dim ** -0.5 \
        * torch.sigmoid(beta[0, 0])[:, None] * v
    want = F.rms_norm(o, (dim,), eps=1e-6) * F.silu(z[0, 0]).view(heads, dim)
    if not (torch.allclose(got, want, rtol=1e-4, atol=1e-4) and torch.equal(history[0, -1], qkv[0, 0])):
        raise ValueError("the DeltaNet kernel's step differs from the delta rule's")


def attach_step_kernels(text: nn.Module) -> None:
    """Gives the CPU modules of `text` their kernels (`rows_kernel`, `step_kernel`), when kernels are enabled, compile
    and check, and the compute dtype is not fp32."""
    if not kernels_enabled() or text.embed_tokens.weight.dtype == torch.float32:
        return
    kernels = checked_step_kernels()
    if kernels is None:
        return
    for module in text.modules():
        if isinstance(module, (CpuLinear, FusedLinear)):
            weight = module.weight.data
            if weight.dtype == torch.bfloat16 and plain_cpu(weight) and weight.is_contiguous() \
                    and weight.shape[0] >= BF16_KERNEL_MIN_ROWS:
                module.rows_kernel = DenseKernel("bf16", weight[None], kernels)
        elif isinstance(module, QuantizedLinear):
            if module.fmt in KERNEL_FORMATS and plain_cpu(*module.buffers()):
                module.rows_kernel = DenseKernel(module.fmt, module.matrix, kernels)
        elif hasattr(module, "step_kernel") and plain_cpu(*(p.data for p in module.parameters())):
            module.step_kernel = DeltaNetKernel(module, kernels)
