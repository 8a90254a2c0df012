"""Text-decoder pieces the model families build from: RMSNorm, bias-free projections (which loading may fuse),
M-RoPE, causal grouped-query attention with per-head q/k norms, the routed experts of a mixture of experts, the SwiGLU
MLP, and the decoder stack around a family's layers (rotary tables, masks, DeepStack, final norm, LM head).

Norms, rotary angles, softmaxes and the router are computed in fp32 whatever the weights are. A family's text config
offers the fields these read: hidden_size, num_heads, num_kv_heads, head_dim, rotary_dim, rope_theta, mrope_section,
mrope_interleaved, rms_norm_eps, vocab_size, num_experts, num_experts_per_tok, moe_intermediate_size.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import KVCache

FP16_LIMIT = 65000.0  # below fp16's largest value, 65504 (fp16 is the compute dtype of GPUs without bf16)
# Scores a masked attention call may hold at once, and the bytes a kernel that materializes them needs per score
# (measured: 13.8 for bf16 in torch's math kernel, scores and softmax together)
ATTENTION_SCORES_BYTES = 128 << 20
SCORE_BYTES = 16


def within_fp16(x: torch.Tensor) -> torch.Tensor:
    """The residual stream clamped below fp16's largest value, in fp16 only: one outlier must not become inf and
    then NaN in the next norm."""
    return x.clamp_(-FP16_LIMIT, FP16_LIMIT) if x.dtype == torch.float16 else x


class RMSNorm(nn.Module):
    """y = x / rms(x) * (offset + w), in fp32 (w is fp32 as loaded). Qwen3.5 stores zero-centred weights (offset 1),
    Qwen3-VL plain ones (offset 0); a fresh norm is the identity scale either way."""

    def __init__(self, dim: int, eps: float, offset: float):
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))
        self.eps, self.offset = eps, offset
        self.norm_kernel = None  # loading may attach a kernel for a few bf16 rows (runtime/row_kernels.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_kernel is not None and self.norm_kernel.takes(x):
            return self.norm_kernel(x)
        scale = self.weight + self.offset if self.offset else self.weight
        return F.rms_norm(x.float(), self.weight.shape, scale, self.eps).to(x.dtype)


def projection(dim_in: int, dim_out: int) -> nn.Linear:
    """A bias-free Linear: every matrix of the text models is one."""
    return nn.Linear(dim_in, dim_out, bias=False)


def project(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """x times each Linear named in `module.input_projections` (all read the same input). Loading may replace them
    by one fused product, `module.fused_projection` (kernels/cpu_linear.py), which returns the same parts."""
    if module.fused_projection is not None:
        return module.fused_projection(x)
    return [module.get_submodule(name)(x) for name in module.input_projections]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for fused [..., 2I] rows, gate first."""
    return silu_mul(*gate_up.chunk(2, dim=-1))


# ----------------------------------------------------------------------------------------------------- rotary
def rotary_cos_sin(cfg: Any, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, T, rotary_dim] from (t, h, w) positions [3, B, T]; frequency j reads the axis M-RoPE assigns it.
    fp32 on the positions' device, as the reference computes them (MPS has no float64)."""
    device = position_ids.device
    half = cfg.rotary_dim // 2
    j = torch.arange(half, device=device)
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2, device=device).float() / cfg.rotary_dim)
    t, h, w = cfg.mrope_section
    if cfg.mrope_interleaved:
        axis = torch.where((j % 3 == 1) & (j < 3 * h), 1, torch.where((j % 3 == 2) & (j < 3 * w), 2, 0))
    else:
        axis = (j >= t).long() + (j >= t + h).long()
    pos = position_ids.float().index_select(0, axis)  # [half, B, T]: each frequency's own axis
    angles = (pos * inv_freq[:, None, None]).permute(1, 2, 0)  # [B, T, half]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the first rotary_dim channels of x [B, T, heads, D] (NeoX half rotation); the rest pass through."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd].float(), x[..., rd:]
    x1, x2 = rot.chunk(2, dim=-1)
    cos, sin = cos[:, :, None], sin[:, :, None]
    rotated = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rotated.to(x.dtype), rest], dim=-1)


# --------------------------------------------------------------------------------------------- full attention
class Attention(nn.Module):
    """Causal grouped-query attention with per-head RMSNorm on queries and keys and M-RoPE. With `output_gate`
    (Qwen3.5), q_proj also yields per head as many gate channels, and the attention output is scaled by their sigmoid
    before o_proj."""
    input_projections = ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: Any, layer: int, output_gate: bool, norm_offset: float):
        super().__init__()
        self.fused_projection: nn.Module | None = None
        self.cfg, self.layer, self.output_gate = cfg, layer, output_gate
        nh, nkv, hd, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = projection(h, nh * hd * (2 if output_gate else 1))  # per head: hd query, then hd gate channels
        self.k_proj = projection(h, nkv * hd)
        self.v_proj = projection(h, nkv * hd)
        self.o_proj = projection(nh * hd, h)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, norm_offset)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, norm_offset)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                key_mask: torch.Tensor | None) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, k, v = project(self, x)
        gate = None
        if self.output_gate:
            q, gate = q.view(b, t, nh, 2 * hd).split(hd, dim=-1)
        q, k, v = q.reshape(b, t, nh, hd), k.view(b, t, nkv, hd), v.view(b, t, nkv, hd)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k), cos, sin)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # heads first
        start = 0
        if cache is not None:
            start = cache.length
            k, v = cache.append_kv(self.layer, k, v)  # all cached keys/values [B, nkv, start + t, hd]
        o = attend(q, k, v, start, key_mask)
        o = o.transpose(1, 2).reshape(b, t, nh * hd)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(b, t, nh * hd))
        return self.o_proj(o)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
           key_mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of t queries [B, H, t, D] at positions start.. over s = start + t keys [B, Hkv, s, D]: causal over
    absolute positions, with padding (key_mask [B, S]) masked out.

    A whole unpadded prompt is plain causal: no mask is made, so GPUs use their fused kernels. Every other case folds
    each KV head's query heads into its query rows, so no kernel copies the keys and values once per query head (a
    kernel without native grouped-query support does, gigabytes late in a long context), and goes in query blocks
    whose scores fit ATTENTION_SCORES_BYTES, since a masked attention may be computed by a kernel that holds every
    score."""
    b, h, t, d = q.shape
    kv_heads, s = k.shape[1], k.shape[2]
    block = max(1, ATTENTION_SCORES_BYTES // (b * h * s * SCORE_BYTES))
    if key_mask is None and t == s and t <= block:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != kv_heads)
    group = h // kv_heads  # query head i reads KV head i // group
    outputs = []
    for first in range(0, t, block):
        last = min(t, first + block)
        keys = start + last  # these queries see no key after their last position
        mask = None
        if key_mask is not None or last - first > 1:
            query_pos = (start + torch.arange(first, last, device=q.device))[:, None]
            key_pos = torch.arange(keys, device=q.device)[None, :]
            mask = key_pos <= query_pos
            if key_mask is not None:  # a padding query still sees itself, so no row is empty (which would give NaN)
                mask = (mask & key_mask[:, None, None, :keys]) | (key_pos == query_pos)
            mask = mask.repeat(*[1] * (mask.dim() - 2), group, 1)  # the same rows for each folded head
        n = last - first
        folded = q[:, :, first:last].reshape(b, kv_heads, group * n, d)
        out = F.scaled_dot_product_attention(folded, k[:, :, :keys], v[:, :, :keys], attn_mask=mask)
        outputs.append(out.view(b, h, n, d))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


# ----------------------------------------------------------------------------------------------------- mlps
class FloatExperts(nn.Module):
    """Fused expert tensors gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I], as transformers holds
    them. Also the trainable form (the demo model is trained with these parameters). Every expert store offers its
    interface: `device` (where the layer's experts are computed), `gate_up(e, x)` and `down(e, x)`."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=dtype))

    @property
    def device(self) -> torch.device:
        return self.gate_up_proj.device

    # the product runs in the experts' own dtype (the plan's format, which may differ from the compute dtype)
    def gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.gate_up_proj.dtype), self.gate_up_proj[e])

    def down(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.down_proj.dtype), self.down_proj[e])


class RoutedExperts(nn.Module):
    """A router (`gate`) picking the top-k of `experts` per token by softmax, renormalized over the k, each a SwiGLU.
    A family's MoE block derives from it and adds what else it has (a shared expert)."""

    def __init__(self, cfg: Any):
        super().__init__()
        self.fused_projection: nn.Module | None = None
        self.cfg = cfg
        h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.gate = projection(h, e)
        self.experts = FloatExperts(e, h, i)  # loading may put another expert store in its place (formats/)

    def route(self, router_logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k expert ids and their weights; the top-k of a softmax, renormalized, is the softmax of
        the top-k logits."""
        top_logits, top_i = router_logits.float().topk(self.cfg.num_experts_per_tok, dim=-1)
        return top_i, torch.softmax(top_logits, dim=-1).to(dtype)

    def routed_experts(self, x: torch.Tensor, top_i: torch.Tensor, top_p: torch.Tensor,
                       decoding: bool = False) -> torch.Tensor:
        """Groups the (token, slot) pairs by expert and runs each used expert once on its tokens, on the device
        that holds the experts: hidden states and routing of experts kept in RAM travel to the CPU in one copy, and
        the result comes back in one (the routing has to reach the host anyway, to pick the experts). When
        `decoding` (each row is one sequence's next token), a store with `routed_step` (formats/kernel_stores.py)
        computes the whole step itself, for the rows it `takes`."""
        home = x.device
        if self.experts.device != home:
            x, top_i, top_p = moved_together(x, top_i, top_p, self.experts.device)
        if decoding and hasattr(self.experts, "routed_step") and self.experts.takes(x, top_i, top_p):
            return self.experts.routed_step(x, top_i, top_p).to(home)
        if x.shape[0] == 1:  # decoding one token: nothing to group, and the k experts' small ops run batched
            chosen = top_i[0].cpu().tolist()  # the one copy to the host this layer needs
            act = swiglu(torch.cat([self.experts.gate_up(e, x) for e in chosen]).to(x.dtype))  # [k, I]
            down = torch.cat([self.experts.down(e, row) for e, row in zip(chosen, act.split(1))]).to(x.dtype)
            return (down * top_p[0, :, None]).sum(0, keepdim=True).to(home)
        out = torch.zeros_like(x)
        flat_e = top_i.reshape(-1)
        order = flat_e.argsort(stable=True)
        # tokens per expert (bincount's output size depends on the data, which a graph or fake tensor cannot know)
        counts = flat_e.new_zeros(self.cfg.num_experts).index_add_(0, flat_e, torch.ones_like(flat_e)).cpu().tolist()
        tokens = order // top_i.shape[1]
        weights = top_p.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = tokens[start:start + n]
            out.index_add_(0, idx, self.expert(e, x[idx]) * weights[start:start + n, None])
            start += n
        return out.to(home)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Routed expert e's SwiGLU on the rows of x."""
        return self.experts.down(e, swiglu(self.experts.gate_up(e, x).to(x.dtype))).to(x.dtype)


def moved_together(x: torch.Tensor, top_i: torch.Tensor, top_p: torch.Tensor,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H], top_i [N, k] and top_p [N, k] on `device`, moved as one fp32 tensor: one transfer (and one wait)
    instead of three. Expert ids are exact in fp32 (below 2**24)."""
    h, k = x.shape[1], top_i.shape[1]
    packed = torch.cat([x.float(), top_p.float(), top_i.float()], dim=1).to(device)
    return packed[:, :h].to(x.dtype), packed[:, h + k:].long(), packed[:, h:h + k].to(top_p.dtype)


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = projection(hidden, inter)
        self.up_proj = projection(hidden, inter)
        self.down_proj = projection(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


# ---------------------------------------------------------------------------------------------------- model
class DecoderModel(nn.Module):
    """embed_tokens, a family's decoder layers, the final norm and lm_head. Each layer is called as
    `layer(x, cos, sin, cache, token_mask, key_mask)` and returns the new residual stream. Parameter names equal the
    checkpoint's, minus the language model's prefix."""

    def __init__(self, cfg: Any, layers: Iterable[nn.Module], norm: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = projection(cfg.hidden_size, cfg.vocab_size)

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache: KVCache | None = None,
                attention_mask: torch.Tensor | None = None, last_only: bool = False,
                deepstack: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """inputs_embeds [B, T, H]; position_ids [3, B, T]; attention_mask [B, T] (1 = real token, 0 = left padding)
        covering only these T tokens; `deepstack` (DeepStack models with images): the image positions as indices
        into the B*T tokens [n] and their features [n, levels, H], level i added to the hidden states there after
        decoder layer i. Returns fp32 logits [B, T, V] (or [B, 1, V] with last_only)."""
        cos, sin = rotary_cos_sin(self.cfg, position_ids)
        key_mask = None
        if cache is not None:
            key_mask = cache.extend_mask(attention_mask, inputs_embeds.shape[1])
        elif attention_mask is not None:
            key_mask = attention_mask.bool()
        levels = deepstack[1].shape[1] if deepstack is not None else 0
        x = inputs_embeds
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, attention_mask, key_mask)
            if index < levels:
                rows, features = deepstack
                x = x.flatten(0, 1).index_add(0, rows, features[:, index].to(x.dtype)).view_as(x)
        if cache is not None:
            cache.advance(inputs_embeds.shape[1])
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x)).float()
