"""Qwen3.5's fused decoding steps (models/qwen3_5/cpu_steps.py) attached to its modules: a Gated DeltaNet layer's
step after its projections (DeltaNetKernel), a sparse MoE block's step (MoeStepKernel) and a MoE decoder layer's whole
step (DeltaNetLayerKernel, AttentionLayerKernel), each given its weights as the named bundles the kernels read, built
once from the kernels of its parts, and each checked at load against the path it replaces (step_kernels.py says what
each is worth).
"""
from __future__ import annotations

import warnings
from functools import cache
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..formats.dense import QuantizedLinear, ReleasedMatrix
from ..formats.gguf import q8_0_blocks
from ..formats.kernel_stores import KernelExperts, compiled_kernels
from ..formats.kernel_stores import matrix as expert_matrix
from ..formats.stores import CpuFloatExperts, QuantizedExperts
from ..formats.table import BF16, GGUF
from ..kernels.arrays import BlockExperts, RoutedExperts, plain_cpu
from ..kernels.gguf_blocks import BlocksRows
from ..kernels.numba_threads import LOCK, set_threads
from ..models.kv_cache import KVCache
from ..release.gguf_file import BLOCK_TYPES
from .row_kernels import (DenseKernel, NormKernel, bf16_arrays, bf16_tensor, dense_kernel, input_matrices,
                          with_side_path)

if TYPE_CHECKING:
    from ..models.qwen3_5.cpu_steps import AttentionWeights, DeltaNetWeights, LayerNorms, MoeWeights


def qwen3_5_steps() -> ModuleType:
    """Qwen3.5's fused steps (models/qwen3_5/cpu_steps.py), imported where a kernel is made of them: it imports
    numba."""
    from ..models.qwen3_5 import cpu_steps
    return cpu_steps


class DeltaNetKernel:
    """A Gated DeltaNet layer's decoding step after its input projections (cpu_steps.gated_delta_step), for the
    layer that calls it; holds fp32 copies of the layer's small parameters (conv taps, decay and norm weights)."""

    def __init__(self, layer: nn.Module | SimpleNamespace, kernels: ModuleType):
        self.kernels, self.steps = kernels, qwen3_5_steps()
        taps = layer.conv1d.weight.shape[-1]
        conv_w = layer.conv1d.weight.detach().float().reshape(-1, taps).contiguous().numpy()
        a_log, dt_bias, norm_w = (p.detach().float().contiguous().numpy()
                                  for p in (layer.A_log, layer.dt_bias, layer.norm.weight))
        self.rule = self.steps.DeltaRule(conv_w, a_log, dt_bias, norm_w, np.float32(layer.cfg.rms_norm_eps), layer.nk)

    def takes(self, history: torch.Tensor, state: torch.Tensor) -> bool:
        """Whether the kernel can update this cache's tensors in place (plain, contiguous fp32 on the CPU)."""
        return all(plain_cpu(t) and t.is_contiguous() and t.dtype == torch.float32 for t in (history, state))

    def __call__(self, qkv: torch.Tensor, z: torch.Tensor, beta: torch.Tensor, a: torch.Tensor,
                 history: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The gated norm's output [B, 1, nv * dv] (fp32) for projections [B, 1, ...]; history and state updated."""
        qkv, z, beta, a = (t.detach()[:, 0].float().contiguous().numpy() for t in (qkv, z, beta, a))
        out = np.empty(z.shape, np.float32)
        with LOCK:
            set_threads()
            self.steps.gated_delta_step(qkv, z, beta, a, self.rule, history.numpy(), state.numpy(), out)
        return torch.from_numpy(out)[:, None]


MOE_PARTS = ("gate", "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert_gate",
             "shared_expert.down_proj")  # a Qwen3.5 SparseMoE's matrices: router, shared expert, its mixing weight


class MoeStepKernel:
    """A Qwen3.5 sparse MoE block's decoding step (router, routing, routed and shared experts, their sum) in one
    numba call (cpu_steps.sparse_moe_step), for the block that calls it: about 25 torch calls and three kernel calls
    become one. The router and the mixing weight are bf16; the shared expert's three matrices share one format (bf16,
    dense_format's int8 / int4, or a GGUF file's blocks); the routed experts are a kernel store's (KernelExperts) or
    a GGUF file's blocks (QuantizedExperts.step_experts); the matrices are read where they are held (no copies). The
    result is the block's with the dense and routed kernels, intermediates rounded to bf16 as there."""

    def __init__(self, parts: dict[str, DenseKernel | BlocksRows], experts: RoutedExperts | BlockExperts, top_k: int,
                 kernels: ModuleType):
        router, gate, up, mix, down = (parts[name].matrix for name in MOE_PARTS)
        self.kernels, self.steps = kernels, qwen3_5_steps()
        self.weights = self.steps.MoeWeights(router, mix, gate, up, down, experts, top_k)

    @classmethod
    def of(cls, moe: nn.Module, kernels: ModuleType) -> MoeStepKernel | None:
        """The kernel of a SparseMoE whose matrices and experts the kernels read, or None."""
        matrices = [*input_matrices(moe), with_side_path(moe.shared_expert.down_proj)]
        parts = [dense_kernel(m, kernels, side) for m, side in matrices]
        experts = moe.experts.step_experts() if hasattr(moe.experts, "step_experts") else None
        if experts is None or any(p is None for p in parts):
            return None
        router, gate, up, mix, down = parts
        if router.fmt != BF16 or mix.fmt != BF16 or not gate.fmt == up.fmt == down.fmt:
            return None
        if not checked_moe_step(gate.fmt, moe.experts.fmt):
            return None
        return cls(dict(zip(MOE_PARTS, parts)), experts, moe.cfg.num_experts_per_tok, kernels)

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        return x.dtype == torch.bfloat16 and plain_cpu(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for decoding rows x [N, H] (bf16)."""
        rows, out = bf16_arrays(x)
        with LOCK:
            set_threads()
            self.steps.sparse_moe_step(self.weights, rows, out.numpy())
        return bf16_tensor(out, x.shape)


class LayerStepKernel:
    """A Qwen3.5 MoE decoder layer's decoding step in one numba call, for the layer that calls it, from the weights of
    its parts' kernels (the matrices read where they are held): its two norms, its token mixer (DeltaNetLayerKernel,
    AttentionLayerKernel), the MoE block and the residuals. About ten kernel calls and 20-40 torch calls become one.
    It returns what the layer's path with the separate kernels returns, except that products torch computes there
    (bf16 matrices below step_kernels.BF16_KERNEL_MIN_ROWS rows, and attention) are summed in the kernels' order: a
    result may differ by one bf16 rounding."""

    def __init__(self, layer: int, norms: LayerNorms, mixer: DeltaNetWeights | AttentionWeights, moe: MoeWeights,
                 kernels: ModuleType):
        self.layer, self.kernels, self.steps = layer, kernels, qwen3_5_steps()
        self.norms, self.mixer, self.moe = norms, mixer, moe

    @staticmethod
    def shared_weights(layer: nn.Module) -> tuple[LayerNorms, MoeWeights] | None:
        """The weights every layer step reads first (the two norms: cpu_steps.LayerNorms) and last (the MoE step's
        MoeWeights), or None where a part has no kernel; the mixer's norms must share the eps."""
        norms = (layer.input_layernorm.norm_kernel, layer.post_attention_layernorm.norm_kernel)
        moe = getattr(layer.mlp, "step_kernel", None)
        if not (all(isinstance(n, NormKernel) for n in norms) and isinstance(moe, MoeStepKernel)
                and norms[0].eps == norms[1].eps):
            return None
        return qwen3_5_steps().LayerNorms(norms[0].scale, norms[1].scale, norms[0].eps), moe.weights

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        """The layer's output for decoding rows x [B, 1, H] (bf16), the cache updated."""
        rows, out = bf16_arrays(x)
        with LOCK:
            set_threads()
            self.run(rows, cos, sin, cache, out.numpy())
        return bf16_tensor(out, x.shape)


class DeltaNetLayerKernel(LayerStepKernel):
    """A Gated DeltaNet layer's step (cpu_steps.deltanet_layer_step); its conv history and state are updated."""

    def __init__(self, layer: int, delta: DeltaNetKernel, norms: LayerNorms, mixer: DeltaNetWeights, moe: MoeWeights,
                 kernels: ModuleType):
        super().__init__(layer, norms, mixer, moe, kernels)
        self.delta = delta

    @classmethod
    def of(cls, layer: nn.Module, kernels: ModuleType, verdicts: dict) -> DeltaNetLayerKernel | None:
        """The kernel of a DeltaNet decoder layer whose norms, DeltaNet step and MoE block have their kernels and
        whose projections the kernels read (qkv, z and the output projection in one format, b and a bf16), once it
        passes its check (checked_layer_step, `verdicts`); else None."""
        mixer, shared = layer.linear_attn, cls.shared_weights(layer)
        delta = mixer.step_kernel
        if shared is None or not isinstance(delta, DeltaNetKernel) or delta.rule.eps != shared[0].eps:
            return None
        qkv, z, b, a, out = (dense_kernel(m, kernels, side)
                             for m, side in (*input_matrices(mixer), with_side_path(mixer.out_proj)))
        if any(p is None for p in (qkv, z, b, a, out)) or not qkv.fmt == z.fmt == out.fmt \
                or not b.fmt == a.fmt == BF16:
            return None
        weights = delta.steps.DeltaNetWeights(qkv.matrix, z.matrix, b.matrix, a.matrix, out.matrix, delta.rule)
        kernel = cls(mixer.layer, delta, shared[0], weights, shared[1], kernels)
        return kernel if checked_layer_step(kernel, layer, verdicts) else None

    def takes(self, x: torch.Tensor, cache, key_mask: torch.Tensor | None) -> bool:
        """Whether the kernel computes this step: a decoding step's (one token per sequence) plain bf16 CPU rows,
        with a cache whose DeltaNet tensors the kernel updates in place."""
        return x.dtype == torch.bfloat16 and x.shape[1] == 1 and plain_cpu(x) and cache is not None \
            and self.delta.takes(cache.conv_state(self.layer), cache.recurrent_state(self.layer))

    def run(self, rows: np.ndarray, cos: torch.Tensor, sin: torch.Tensor, cache, out: np.ndarray) -> None:
        history, state = cache.conv_state(self.layer).numpy(), cache.recurrent_state(self.layer).numpy()
        self.steps.deltanet_layer_step(self.norms, self.mixer, self.moe, history, state, rows, out)


# attention products (cached tokens x query heads x head_dim) up to which a layer step computes attention itself:
# its attention took 2-4x torch's bf16 attention's time (16 query heads of 256 channels, 2 threads: 0.37 against
# 0.09 ms over 512 tokens, 1.1 against 0.39 over 2048, 15 against 8-10 over 16384), while the layer step saved about
# 1 ms of calls per attention layer. Beyond it (2048 tokens on Qwen3.5-35B-A3B), the layer's path with the separate
# kernels and torch's attention.
LAYER_ATTENTION_MAX = 2 ** 23


class AttentionLayerKernel(LayerStepKernel):
    """A gated full-attention layer's step (cpu_steps.attention_layer_step) with a cache that stores its keys and
    values in bf16 and has no padding, up to LAYER_ATTENTION_MAX; the new key and value are stored in the cache."""

    def __init__(self, layer: int, norms: LayerNorms, mixer: AttentionWeights, moe: MoeWeights, kernels: ModuleType,
                 token_work: int):
        super().__init__(layer, norms, mixer, moe, kernels)
        self.token_work = token_work  # the attention products of one cached token: query heads x head_dim

    @classmethod
    def of(cls, layer: nn.Module, kernels: ModuleType, verdicts: dict) -> AttentionLayerKernel | None:
        """The kernel of a full-attention decoder layer with the output gate whose norms and MoE block have their
        kernels and whose projections the kernels read (q, k, v and o in one format), once it passes its check
        (checked_layer_step, `verdicts`); else None."""
        attn, shared = layer.self_attn, cls.shared_weights(layer)
        head_norms = (attn.q_norm.norm_kernel, attn.k_norm.norm_kernel)
        if shared is None or not attn.output_gate or not all(
                isinstance(n, NormKernel) and n.eps == shared[0].eps for n in head_norms):
            return None
        q, k, v, o = (dense_kernel(m, kernels, side)
                      for m, side in (*input_matrices(attn), with_side_path(attn.o_proj)))
        if any(p is None for p in (q, k, v, o)) or not q.fmt == k.fmt == v.fmt == o.fmt:
            return None
        weights = qwen3_5_steps().AttentionWeights(q.matrix, k.matrix, v.matrix, o.matrix, head_norms[0].scale,
                                                   head_norms[1].scale, attn.cfg.num_heads)
        kernel = cls(attn.layer, shared[0], weights, shared[1], kernels, attn.cfg.num_heads * attn.cfg.head_dim)
        return kernel if checked_layer_step(kernel, layer, verdicts) else None

    def takes(self, x: torch.Tensor, cache, key_mask: torch.Tensor | None) -> bool:
        """Whether the kernel computes this step: a decoding step's plain bf16 CPU rows, with no padding, and a cache
        holding this layer's keys and values as plain contiguous bf16 tensors, one row per input row, within
        LAYER_ATTENTION_MAX."""
        if not (x.dtype == torch.bfloat16 and x.shape[1] == 1 and plain_cpu(x) and cache is not None
                and key_mask is None and not cache.scratch
                and (cache.length + 1) * self.token_work <= LAYER_ATTENTION_MAX):
            return False
        keys, values = cache.keys[self.layer], cache.values[self.layer]
        return all(plain_cpu(t) and t.is_contiguous() and t.dtype == torch.bfloat16 and t.shape[0] == x.shape[0]
                   for t in (keys, values))

    def run(self, rows: np.ndarray, cos: torch.Tensor, sin: torch.Tensor, cache, out: np.ndarray) -> None:
        cos, sin = (t[:, 0].float().contiguous().numpy() for t in (cos, sin))
        keys, values = (t[self.layer].view(torch.int16).numpy() for t in (cache.keys, cache.values))
        self.steps.attention_layer_step(self.norms, self.mixer, self.moe, cos, sin, keys, values, cache.length, rows,
                                        out)


CHECK_CACHED = 5  # tokens in the cache a layer step is checked with


def checked_layer_step(kernel: LayerStepKernel, layer: nn.Module, verdicts: dict) -> bool:
    """Whether the layer kernel compiles and reproduces two decoding rows of its layer's own path from the same
    random cache (a DeltaNet layer's conv history and state; an attention layer's CHECK_CACHED keys and values), and
    leaves the same cache, within bf16's roundings: the compile happens at load, not in the middle of a generation.
    False with a warning if not. One layer is checked per kind and compiled signature (the arrays' dtypes and
    dimensions), its verdict kept in `verdicts` for the model's other layers: the check reads up to 16 experts' weights
    of its layer, which on a large model may still be on disk."""
    signature = (type(kernel), *(array_types(weights) for weights in (kernel.norms, kernel.mixer, kernel.moe)))
    if signature not in verdicts:
        verdicts[signature] = layer_step_reproduces(kernel, layer)
    return verdicts[signature]


def array_types(value: object) -> object:
    """The dtypes and dimensions of the arrays in nested tuples of kernel weights (the types of their other values):
    what their compiled signature depends on."""
    if isinstance(value, tuple):
        return tuple(array_types(v) for v in value)
    return (value.dtype, value.ndim) if isinstance(value, np.ndarray) else type(value)


def layer_step_reproduces(kernel: LayerStepKernel, layer: nn.Module) -> bool:
    """checked_layer_step's check of one layer."""
    x = torch.randn(2, 1, layer.input_layernorm.weight.shape[0], generator=torch.Generator().manual_seed(0))
    x = x.bfloat16()
    rotary = layer.self_attn.cfg.rotary_dim if hasattr(layer, "self_attn") else 2
    angles = torch.rand(2, 1, rotary, generator=torch.Generator().manual_seed(1)) * 6.3
    try:
        (got_state, got_cache), (want_state, want_cache) = (check_cache(layer, 2) for _ in range(2))
        got = kernel(x, angles.cos(), angles.sin(), got_cache)
        with torch.no_grad():
            want = layer(x, angles.cos(), angles.sin(), want_cache, None, None)
        pairs = [(got, want), *zip(got_state, want_state)]
        if not all(torch.allclose(a.float(), b.float(), rtol=0.03, atol=0.03 * b.float().abs().max().item())
                   for a, b in pairs):
            raise ValueError("the layer step differs from the layer's")
    except Exception as exc:  # numba's compile errors have many types; any failure means the separate kernels
        warnings.warn(f"a3b_core: numba could not compile the CPU decoder layer step ({exc}); using separate kernel "
                      "calls.", stacklevel=2)
        return False
    return True


def check_cache(layer: nn.Module, rows: int) -> tuple[list[torch.Tensor], KVCache | SimpleNamespace]:
    """A cache for checking a decoder layer's step, the same at each call, and the tensors the step changes in it:
    a DeltaNet layer's random conv history and state (as Qwen3.5's cache holds them), or a KV cache of the attention
    layer with CHECK_CACHED random bf16 tokens before the step's."""
    g = torch.Generator().manual_seed(2)
    if hasattr(layer, "linear_attn"):
        mixer = layer.linear_attn
        history = torch.randn(rows, mixer.conv1d.weight.shape[-1] - 1, mixer.conv_dim, generator=g)
        state = torch.randn(rows, mixer.nv, mixer.dk, mixer.dv, generator=g) * 0.1
        return [history, state], SimpleNamespace(conv_state=lambda _: history, recurrent_state=lambda _: state)
    cfg, index = layer.self_attn.cfg, layer.self_attn.layer
    cache = KVCache([index], cfg.num_kv_heads, cfg.head_dim, rows, CHECK_CACHED + 1, torch.bfloat16)
    for buffers in (cache.keys, cache.values):
        buffers[index][:, :, :CHECK_CACHED] = torch.randn(buffers[index][:, :, :CHECK_CACHED].shape, generator=g)
    cache.extend_mask(None, CHECK_CACHED)
    cache.advance(CHECK_CACHED)
    cache.extend_mask(None, 1)  # the step's token, as the model records it before its layers
    return [cache.keys[index], cache.values[index]], cache


@cache
def checked_moe_step(shared: str, routed: str) -> bool:
    """Whether the MoE step compiles for shared-expert matrices in format `shared` and routed experts in `routed`, and
    reproduces a small block's step (two rows, four experts, top 2, routing margins far above bf16's rounding): the
    compile happens at load, not in the middle of a generation. False with a warning if not."""
    kernels = compiled_kernels()
    try:
        check_moe_step(kernels, shared, routed)
    except Exception as exc:  # numba's compile errors have many types; any failure means torch's path
        warnings.warn(f"a3b_core: numba could not compile the CPU MoE step ({exc}); using separate kernel calls.",
                      stacklevel=2)
        return False
    return True


def check_moe_step(kernels: ModuleType, shared: str, routed: str) -> None:
    """The MoE step of two rows against the same block in fp64 (from the formats' own weights), within bf16's
    roundings of the step's intermediates."""
    g = torch.Generator().manual_seed(0)
    hidden, inter, experts = 64, 32, 4
    x = torch.randn(2, hidden, generator=g).bfloat16()
    router = (torch.randn(experts, hidden, generator=g)).bfloat16()  # logits ~8 apart: no bf16 rounding flips a choice
    mix = (torch.randn(1, hidden, generator=g) * 0.1).bfloat16()
    matrices = {}
    for name, shape in (("shared_expert.gate_proj", (inter, hidden)), ("shared_expert.up_proj", (inter, hidden)),
                        ("shared_expert.down_proj", (hidden, inter))):
        w = torch.randn(*shape, generator=g) * shape[1] ** -0.5
        matrices[name] = w.bfloat16() if shared == BF16 else QuantizedLinear(shared, ReleasedMatrix(
            shape, (q8_0_blocks(w),), None) if shared == GGUF else w)
    parts = {name: dense_kernel(m, kernels) for name, m in {"gate": router, "shared_expert_gate": mix,
                                                          **matrices}.items()}
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
    down = torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5
    if routed == BF16:
        store = CpuFloatExperts(nn.Parameter(gate_up.bfloat16()), nn.Parameter(down.bfloat16()))
    elif routed == GGUF:  # a file's Q8_0 blocks
        q8_0 = BLOCK_TYPES["Q8_0"]
        stored = {"gate_up_proj": (((q8_0, 2 * inter),),), "down_proj": (((q8_0, hidden),),)}
        store = QuantizedExperts(routed, experts, hidden, inter, stored=stored)
        for e in range(experts):
            store.gate_up_proj.set_released(e, q8_0_blocks(gate_up[e]))
            store.down_proj.set_released(e, q8_0_blocks(down[e]))
    else:
        store = QuantizedExperts(routed, experts, hidden, inter)
        for e in range(experts):
            store.gate_up_proj.set(e, gate_up[e])
            store.down_proj.set(e, down[e])
    step_experts = store.step_experts() if routed == GGUF else KernelExperts(store, kernels).step_experts()
    got = MoeStepKernel(parts, step_experts, 2, kernels)(x).double()

    def exact(m: nn.Module | torch.Tensor) -> torch.Tensor:
        return (m.matrix.dequantize(0) if isinstance(m, QuantizedLinear) else m).double()

    xd = x.double()
    logits, top_i = (xd @ exact(router).t()).topk(2)
    top_p = torch.softmax(logits, -1)
    shared_gate, shared_up = (xd @ exact(matrices[name]).t() for name in MOE_PARTS[1:3])
    want = torch.sigmoid(xd @ exact(mix).t()) * (F.silu(shared_gate) * shared_up @ exact(matrices[MOE_PARTS[4]]).t())
    for t in range(2):
        for p, e in zip(top_p[t].tolist(), top_i[t].tolist()):
            gate, up = (expert_matrix(store.gate_up_proj, e).double() @ xd[t]).chunk(2)
            want[t] += p * expert_matrix(store.down_proj, e).double() @ (F.silu(gate) * up)
    if not torch.allclose(got, want, rtol=0.03, atol=0.03 * want.abs().max().item()):
        raise ValueError("the MoE step differs from the block's")
