"""The Qwen3.5 text decoder (MoE and dense), readable top to bottom.

Layers alternate Gated DeltaNet (linear attention with a recurrent state) and gated full attention with partial,
interleaved M-RoPE; every MLP is a softmax top-k mixture of experts with a sigmoid-gated shared expert (or a dense
SwiGLU MLP in the dense sizes). Norms are zero-centred. Norms, softmaxes and the DeltaNet state are computed in fp32
whatever the weights are. Parameter names equal the checkpoint's, minus the "model.language_model." prefix. The
pieces Qwen3.5 shares with other families are in models/layers.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import (Attention, DecoderModel, DenseMLP, RMSNorm, RoutedExperts, project, projection, silu_mul,
                      within_fp16)
from .cache import Cache
from .config import TextConfig

GDN_CHUNK = 64
NORM_OFFSET = 1.0  # zero-centred RMSNorm weights: y = x / rms(x) * (1 + w)


# ------------------------------------------------------------------------------------------- gated deltanet
class GatedDeltaNet(nn.Module):
    input_projections = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def __init__(self, cfg: TextConfig, layer: int):
        super().__init__()
        self.fused_projection: nn.Module | None = None
        # loading may attach a kernel that computes a decoding token's step after the projections in one call
        # (runtime/layer_steps.py, DeltaNetKernel)
        self.step_kernel = None
        self.cfg, self.layer = cfg, layer
        h = cfg.hidden_size
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = projection(h, self.conv_dim)
        self.in_proj_z = projection(h, self.value_dim)
        self.in_proj_b = projection(h, self.nv)
        self.in_proj_a = projection(h, self.nv)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.linear_conv_kernel_dim, groups=self.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.dv))
        self.out_proj = projection(self.value_dim, h)

    def forward(self, x: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        b, t, _ = x.shape
        qkv, z, beta, a = project(self, x)
        history = cache.conv_state(self.layer) if cache is not None else None
        if t == 1 and history is not None and self.step_kernel is not None:
            state = cache.recurrent_state(self.layer)
            if self.step_kernel.takes(history, state):
                return self.out_proj(self.step_kernel(qkv, z, beta, a, history, state).to(x.dtype))
        qkv = F.silu(causal_conv(qkv, self.conv1d.weight, history))
        qk, v = qkv.float().split([2 * self.key_dim, self.value_dim], dim=-1)
        qk = l2_normalize(qk.view(b, t, 2 * self.nk, self.dk))  # the query heads, then the key heads
        # value head m reads key head m // (nv / nk): repeat-interleave
        q, k = qk.repeat_interleave(self.nv // self.nk, dim=2).split(self.nv, dim=2)
        q = q * self.dk ** -0.5
        v = v.view(b, t, self.nv, self.dv)
        beta = torch.sigmoid(beta.float())
        g = -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)  # A_log, dt_bias: fp32 as loaded
        state = cache.recurrent_state(self.layer) if cache is not None else x.new_zeros(
            b, self.nv, self.dk, self.dv, dtype=torch.float32)
        q, k, v, beta, g = (z.transpose(1, 2) for z in (q, k, v, beta, g))  # heads first
        if t == 1:
            o = delta_rule_step(q, k, v, beta, g, state)  # the cache's state is updated in place
        else:
            # copied heads-first here, so that their token-major tensors are freed: a matmul of strided views would
            # copy them at every use
            q, k, v = (z.contiguous() for z in (q, k, v))
            o, state = delta_rule_chunked(q, k, v, beta, g, state)
            if cache is not None:
                cache.set_recurrent_state(self.layer, state)
        o = gated_rms_norm(o.transpose(1, 2), z.view(b, t, self.nv, self.dv), self.norm.weight,
                           self.cfg.rms_norm_eps)
        return self.out_proj(o.reshape(b, t, self.value_dim).to(x.dtype))


def causal_conv(x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal conv of x [B, T, C] with weight [C, 1, K]; `history` [B, K-1, C] holds the previous inputs
    and is updated in place. Computed in fp32 without torch's depthwise conv, which is slow on CPUs: one windowed
    product when decoding, K multiply-adds over contiguous rows for long inputs (where the windowed product, on
    strided windows, is 7x slower)."""
    b, t, c = x.shape
    kernel = weight.shape[-1]
    past = history if history is not None else x.new_zeros(b, kernel - 1, c, dtype=torch.float32)
    full = torch.cat([past, x.float()], dim=1)  # [B, K-1+T, C]
    w = weight.float().view(c, kernel)
    if t == 1:
        out = (full.unfold(1, kernel, 1) * w).sum(-1)  # windows [B, T, C, K]
    else:
        taps = w.t().contiguous()  # [K, C]
        out = full[:, :t] * taps[0]
        for i in range(1, kernel):
            out.addcmul_(full[:, i:i + t], taps[i])
    if history is not None:
        history.copy_(full[:, -(kernel - 1):])
    return out.to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps), as one fused rms_norm: sum + eps = d * (mean + eps / d)."""
    d = x.shape[-1]
    return F.rms_norm(x, (d,), eps=eps / d) * d ** -0.5


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * rms_norm(x) * silu(z): a plain (not zero-centred) weight, the gate applied after normalizing."""
    return F.rms_norm(x.float(), weight.shape, weight, eps) * F.silu(z.float())  # weight: fp32 as loaded


def delta_rule_step(q, k, v, beta, g, state):
    """One token: q, k [B, H, 1, dk], v [B, H, 1, dv], beta/g [B, H, 1]; `state` [B, H, dk, dv] (fp32) is updated
    in place (fresh 1 MB tensors per layer and token cost more than the arithmetic). Returns o [B, H, 1, dv]."""
    state.mul_(g.exp()[..., None])
    u = (v - k @ state) * beta[..., None]  # [B, H, 1, dv]
    b, h, dk, dv = state.shape
    state.view(b * h, dk, dv).baddbmm_(k.reshape(b * h, 1, dk).transpose(1, 2), u.reshape(b * h, 1, dv))
    return q @ state


def delta_rule_chunked(q, k, v, beta, g, state, chunk: int = GDN_CHUNK):
    """The same recurrence over many tokens, `chunk` at a time: inside a chunk it is a triangular solve and matmuls;
    only the state passes between chunks. Shapes as delta_rule_step with L tokens."""
    b, h, length, dk = k.shape
    pad = -length % chunk
    if pad:  # zero k/v/beta and g=0 on padding leave the state untouched
        q, k, v = (F.pad(z, (0, 0, 0, pad)) for z in (q, k, v))
        beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    n = (length + pad) // chunk
    q, k, v = (z.reshape(b, h, n, chunk, -1) for z in (q, k, v))
    beta, g = beta.reshape(b, h, n, chunk), g.reshape(b, h, n, chunk)
    cum = g.cumsum(-1)  # G_i
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # e^{G_i - G_j}, j <= i
    kk = k @ k.transpose(-1, -2)
    a = (beta[..., None] * decay * kk).tril(-1)
    eye = torch.eye(chunk, dtype=k.dtype, device=k.device)
    # (I + A)^-1 once, then products: a triangular solve per right-hand side took 1.4x as long on 2 cores (it copies
    # each [chunk, d] side into LAPACK's column-major order)
    inverse = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
    # (I + A)^-1 diag(beta) v: beta scales the inverse's columns, not v's longer rows
    u_value = (inverse * beta[..., None, :]) @ v  # the part of U independent of the entering state
    u_state = (inverse * (beta * cum.exp())[..., None, :]) @ k  # the part multiplied by it
    qk = (q @ k.transpose(-1, -2)) * decay
    decay_to_end = (cum[..., -1:] - cum).exp()[..., None]  # e^{G_last - G_j}
    out = v.new_empty(b, h, n, chunk, v.shape[-1])
    for c in range(n):
        u = u_value[:, :, c] - u_state[:, :, c] @ state
        out[:, :, c] = cum[:, :, c, :, None].exp() * (q[:, :, c] @ state) + qk[:, :, c] @ u
        state = cum[:, :, c, -1, None, None].exp() * state + (k[:, :, c] * decay_to_end[:, :, c]).transpose(-1, -2) @ u
    return out.reshape(b, h, n * chunk, -1)[:, :, :length], state


# ----------------------------------------------------------------------------------------------------- mlps
class SparseMoE(RoutedExperts):
    """Softmax router, top-k renormalized, SwiGLU experts, plus a shared expert scaled by a sigmoid gate."""
    input_projections = ("gate", "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert_gate")

    def __init__(self, cfg: TextConfig):
        super().__init__(cfg)
        self.shared_expert = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = projection(cfg.hidden_size, 1)
        # loading may attach a kernel that computes a decoding step's whole block in one call
        # (runtime/layer_steps.py, MoeStepKernel)
        self.step_kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if shape[-2] == 1 and self.step_kernel is not None and self.step_kernel.takes(x):
            return self.step_kernel(x).view(shape)
        router, shared_gate, shared_up, shared_scale = project(self, x)
        top_i, top_p = self.route(router, x.dtype)
        out = self.routed_experts(x, top_i, top_p, decoding=shape[-2] == 1)
        shared = self.shared_expert.down_proj(silu_mul(shared_gate, shared_up))
        out = out + torch.sigmoid(shared_scale) * shared
        return out.view(shape)


# ---------------------------------------------------------------------------------------------------- model
class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int):
        super().__init__()
        self.is_full_attention = cfg.layer_types[layer] == "full_attention"
        if self.is_full_attention:
            self.self_attn = Attention(cfg, layer, output_gate=True, norm_offset=NORM_OFFSET)
        else:
            self.linear_attn = GatedDeltaNet(cfg, layer)
        self.mlp = SparseMoE(cfg) if cfg.is_moe else DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, NORM_OFFSET)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, NORM_OFFSET)
        # loading may attach a kernel that computes the layer's decoding step in one call
        # (runtime/layer_steps.py, LayerStepKernel)
        self.step_kernel = None

    def forward(self, x, cos, sin, cache, token_mask, key_mask):
        if self.step_kernel is not None and token_mask is None and self.step_kernel.takes(x, cache, key_mask):
            return self.step_kernel(x, cos, sin, cache)
        h = self.input_layernorm(x)
        if self.is_full_attention:
            h = self.self_attn(h, cos, sin, cache, key_mask)
        else:
            if token_mask is not None:  # padded tokens must not enter the recurrent state
                h = h * token_mask[..., None].to(h.dtype)
            h = self.linear_attn(h, cache)
        x = within_fp16(x + h)
        return within_fp16(x + self.mlp(self.post_attention_layernorm(x)))


class TextModel(DecoderModel):
    def __init__(self, cfg: TextConfig):
        super().__init__(cfg, (DecoderLayer(cfg, i) for i in range(cfg.num_layers)),
                         RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, NORM_OFFSET))
