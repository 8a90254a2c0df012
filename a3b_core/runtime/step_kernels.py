"""Decoding work other than the routed experts computed by numba kernels, attached at load to the modules that call
them: a dense matrix's product with a few rows (a quantized matrix's products of more rows take its kernel-dequantized
weights; a GGUF file's Q4_K, Q6_K and Q8_0 matrices kept in their blocks take kernels/gguf_blocks.py's BlocksRows) and
RMSNorms of a decoding step's bf16 rows (row_kernels.py), a Gated DeltaNet layer's token step, a Qwen3.5
MoE block's whole token step and a Qwen3.5 MoE decoder layer's whole token step (layer_steps.py, calling
models/qwen3_5/cpu_steps.py).

A decoding step of the text model is mostly small products and many small torch calls, each with a fixed cost
(2-6 us on a 2-core Xeon, where torch's RMSNorm of one 1024-wide bf16 row took 2.5-2.7x the norm kernel's call:
31-34 against 12 us in one window).
- Dense products of up to GEMV_MAX_ROWS rows, those of decoding (QuantizedLinear in int8 and int4; CpuLinear and
  FusedLinear in bf16): torch's weight-only int8 kernel took 2-2.5x the kernel's time at every size from 64 to 1024 rows
  (1024 inputs, 2 threads, an AVX2 EPYC). bf16 is summed as torch's matrix-vector kernel does (fp32 sums of the exact
  weights, rounded once), and the kernel only pays from about BF16_KERNEL_MIN_ROWS rows on (1024 rows: 141 against 163
  us; 512 rows: 99 against 88 us): smaller bf16 matrices (routers, gates, small projections) keep torch's product.
- A Gated DeltaNet layer's step from its input projections to its gated norm (the conv's step, the L2 norms, the
  delta rule on the fp32 state, the gated RMSNorm): about 40 torch calls become one.
- A sparse MoE block's step (router, top-k softmax, routed experts, shared expert and its sigmoid weight): about 25
  torch calls and three kernel calls become one, with the block's intermediates rounded to bf16 where torch's bf16
  path rounds them, so that it returns what the block computes with the separate kernels.
- RMSNorms of a decoding step's bf16 rows (inputs [B, 1, ...]): each result rounded to bf16, as torch's (its sum
  in another order: a result may differ by one bf16 rounding, so a prefill keeps torch's norm).
- A Qwen3.5 MoE decoder layer's whole step (its norms, projections, DeltaNet step or attention over a bf16 KV cache,
  MoE block and residuals) in one call of the kernels above: each call from Python costs more than small kernels'
  work (an RMSNorm's call took 18 us, of which the kernel 4.6), and a layer made about ten of them. On the bench
  model (2 threads, alternating, two runs), int8 experts with dense int8 decoded at 25.6-29.7 against 18.1-23.7
  tokens/s, int4 with dense int4 at 25.1-38.3 against 21.8-30.9, bf16 at 11.9-17.2 against 12.5-15.5.
The products and the DeltaNet step compute in fp32 (the DeltaNet step is the fp32 computation itself; torch's bf16
path rounds its intermediates to bf16), and a row's result does not depend on the other rows of a batch. bf16 rows
pass to and from the kernels as their bit patterns (int16), with no torch conversion. The kernels are attached only
to models whose compute dtype is not fp32 (the norm and MoE step kernels: bf16): the fp32 mode stays the
reference's, layer for layer. Without numba (formats/kernel_stores.py says when) nothing is attached and torch's
path runs.
"""
from __future__ import annotations

import warnings
from functools import cache
from types import ModuleType, SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ..formats.dense import QuantizedLinear
from ..formats.kernel_stores import compiled_kernels, kernels_enabled
from ..kernels.arrays import plain_cpu
from ..formats.table import BF16, INT4, INT8
from ..kernels.cpu_linear import CpuLinear, FusedLinear
from .layer_steps import (AttentionLayerKernel, DeltaNetKernel, DeltaNetLayerKernel, LayerStepKernel,
                          MoeStepKernel)
from .row_kernels import DenseKernel, NormKernel, dense_kernel

BF16_KERNEL_MIN_ROWS = 1024


@cache
def checked_step_kernels() -> ModuleType | None:
    """The kernels once the dense products, the DeltaNet step and the norm have compiled (every signature they are
    called with) and reproduced small cases (check_step_kernels), or None with a warning: a kernel that cannot compile
    fails at load, not in the middle of a generation. The MoE and layer steps are checked in layer_steps.py."""
    kernels = compiled_kernels()
    try:
        check_step_kernels(kernels)
    except Exception as exc:  # numba's compile errors have many types; any failure means torch's path
        warnings.warn(f"a3b_core: numba could not compile the CPU decoding kernels ({exc}); using torch's products "
                      "for dense matrices and the DeltaNet step.", stacklevel=2)
        return None
    return kernels


def check_step_kernels(kernels: ModuleType) -> None:
    """A product of two fp32 rows and of two bf16 rows with a bf16, an int8 and an int4 matrix (of 128 inputs: int8's
    and int4's rows multiply codes of the activations, in vector code where the CPU has it); a DeltaNet step
    from an empty state and history, where the delta rule reduces to o = (q . k) * beta * v; an RMSNorm of three bf16
    rows."""
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(64, 128, generator=g).bfloat16(), torch.randn(2, 128, generator=g)
    matrices = {BF16: weight[None], **{fmt: QuantizedLinear(fmt, weight.float()).matrix for fmt in (INT8, INT4)}}
    for fmt, matrix in matrices.items():
        kernel, exact = DenseKernel(fmt, matrix, kernels), (matrix[0] if fmt == BF16 else matrix.dequantize(0)).float()
        for rows, bound in ((x, 1e-4), (x.bfloat16(), 1e-2)):  # bf16: the result rounded to bf16
            want = rows.float() @ exact.t()
            # bounds as a fraction of the largest |result|: int4 and int8 rows multiply int16 codes of activations
            if not torch.allclose(kernel(rows).float(), want, rtol=bound, atol=bound * want.abs().max().item()):
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
    norm = SimpleNamespace(weight=torch.randn(dim, generator=g), offset=1.0, eps=1e-6)  # an RMSNorm's parameters
    rows = torch.randn(3, dim, generator=g).bfloat16()
    want = F.rms_norm(rows.float(), (dim,), norm.weight + 1, 1e-6).bfloat16().float()
    if not torch.allclose(NormKernel(norm, kernels)(rows).float(), want, rtol=0.01, atol=0.01):
        raise ValueError("the norm kernel's rows differ from torch's")


def attach_step_kernels(text: nn.Module) -> None:
    """Gives the CPU modules of `text` their kernels (`rows_kernel`, `step_kernel`, `norm_kernel`), when kernels are
    enabled, compile and check, and the compute dtype is not fp32; the norm and MoE step kernels need bf16."""
    if not kernels_enabled() or text.embed_tokens.weight.dtype == torch.float32:
        return
    kernels = checked_step_kernels()
    if kernels is None:
        return
    bf16 = text.embed_tokens.weight.dtype == torch.bfloat16  # the norm and MoE kernels read bf16 rows
    for module in text.modules():
        if isinstance(module, (CpuLinear, FusedLinear)):
            weight = module.weight.data
            if weight.dtype == torch.bfloat16 and plain_cpu(weight) and weight.is_contiguous() \
                    and weight.shape[0] >= BF16_KERNEL_MIN_ROWS:
                module.rows_kernel = DenseKernel(BF16, weight[None], kernels)
        elif isinstance(module, QuantizedLinear):
            module.rows_kernel = dense_kernel(module, kernels)
        elif hasattr(module, "norm_kernel") and bf16 and plain_cpu(module.weight.data):
            module.norm_kernel = NormKernel(module, kernels)
        elif hasattr(module, "step_kernel") and hasattr(module, "experts"):  # a MoE block
            module.step_kernel = MoeStepKernel.of(module, kernels) if bf16 else None
        elif hasattr(module, "step_kernel") and hasattr(module, "conv1d") \
                and plain_cpu(*(p.data for p in module.parameters())):  # a Gated DeltaNet
            module.step_kernel = DeltaNetKernel(module, kernels)
    verdicts: dict = {}
    for module in text.modules():  # a Qwen3.5 decoder layer, once its parts have their kernels
        if hasattr(module, "step_kernel") and hasattr(module, "mlp") and bf16:
            module.step_kernel = layer_step_kernel(module, kernels, verdicts)


def layer_step_kernel(layer: nn.Module, kernels: ModuleType, verdicts: dict) -> LayerStepKernel | None:
    """A Qwen3.5 MoE decoder layer's whole-step kernel from its parts' kernels as they are, or None."""
    kind = DeltaNetLayerKernel if hasattr(layer, "linear_attn") else AttentionLayerKernel
    return kind.of(layer, kernels, verdicts)


def refit_step_kernels(layer: nn.Module, verdicts: dict) -> None:
    """Builds again the MoE-block and whole-layer step kernels a Qwen3.5 decoder layer has, from its parts as they
    are now (their LoRA side paths included: runtime/adapters.py), or sets them to None where they no longer fit."""
    moe = getattr(layer.mlp, "step_kernel", None)
    if moe is None and layer.step_kernel is None:
        return
    kernels = checked_step_kernels()
    if moe is not None:
        layer.mlp.step_kernel = MoeStepKernel.of(layer.mlp, kernels)
    if layer.step_kernel is not None:
        layer.step_kernel = None  # the new kernel is checked against the layer's own path
        layer.step_kernel = layer_step_kernel(layer, kernels, verdicts)
