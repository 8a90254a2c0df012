"""The Qwen3.5 text decoder (MoE and dense), readable top to bottom.

Layers alternate Gated DeltaNet (linear attention with a recurrent state) and gated full attention with partial,
interleaved M-RoPE; every MLP is a softmax top-k mixture of experts with a sigmoid-gated shared expert (or a dense
SwiGLU MLP in the dense sizes). Norms, softmaxes and the DeltaNet state are computed in fp32 whatever the weights are.
Parameter names equal the checkpoint's, minus the "model.language_model." prefix.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cache import Cache
from .config import TextConfig

GDN_CHUNK = 64
FP16_LIMIT = 65000.0  # below fp16's largest value, 65504 (fp16 is the compute dtype of GPUs without bf16)
# Scores a masked attention call may hold at once, and the bytes a kernel that materialises them needs per score
# (measured: 13.8 for bf16 in torch's math kernel, scores and softmax together)
ATTENTION_SCORES_BYTES = 128 << 20
SCORE_BYTES = 16


def within_fp16(x: torch.Tensor) -> torch.Tensor:
    """The residual stream clamped below fp16's largest value, in fp16 only: one outlier must not become inf and
    then NaN in the next norm."""
    return x.clamp_(-FP16_LIMIT, FP16_LIMIT) if x.dtype == torch.float16 else x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm, y = x / rms(x) * (1 + w), in fp32 (w is fp32 as loaded)."""
    return F.rms_norm(x.float(), weight.shape, 1.0 + weight, eps).to(x.dtype)


class ZeroCentredRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def projection(dim_in: int, dim_out: int) -> nn.Linear:
    """A bias-free Linear: every matrix of the text model is one."""
    return nn.Linear(dim_in, dim_out, bias=False)


def project(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """x times each Linear named in `module.input_projections` (all read the same input). Loading may replace them
    by one fused product, `module.fused_projection` (backends/products.py), which returns the same parts."""
    if module.fused_projection is not None:
        return module.fused_projection(x)
    return [module.get_submodule(name)(x) for name in module.input_projections]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


# ----------------------------------------------------------------------------------------------------- rotary
def rotary_cos_sin(cfg: TextConfig, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
class GatedAttention(nn.Module):
    input_projections = ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: TextConfig, layer: int):
        super().__init__()
        self.fused_projection: nn.Module | None = None
        self.cfg, self.layer = cfg, layer
        nh, nkv, hd, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = projection(h, nh * hd * 2)  # per head: hd query channels, then hd gate channels
        self.k_proj = projection(h, nkv * hd)
        self.v_proj = projection(h, nkv * hd)
        self.o_proj = projection(nh * hd, h)
        self.q_norm = ZeroCentredRMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Cache | None,
                key_mask: torch.Tensor | None) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, k, v = project(self, x)
        q, gate = q.view(b, t, nh, 2 * hd).split(hd, dim=-1)
        k, v = k.view(b, t, nkv, hd), v.view(b, t, nkv, hd)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k), cos, sin)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # heads first
        start = 0
        if cache is not None:
            start = cache.length
            k, v = cache.append_kv(self.layer, k, v)  # all cached keys/values [B, nkv, start + t, hd]
        o = attend(q, k, v, start, key_mask)
        o = o.transpose(1, 2).reshape(b, t, nh * hd)
        return self.o_proj(o * torch.sigmoid(gate.reshape(b, t, nh * hd)))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, key_mask: torch.Tensor | None) -> torch.Tensor:
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


# ------------------------------------------------------------------------------------------- gated deltanet
class GatedDeltaNet(nn.Module):
    input_projections = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def __init__(self, cfg: TextConfig, layer: int):
        super().__init__()
        self.fused_projection: nn.Module | None = None
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
    """w * rms_norm(x) * silu(z): a plain (not zero-centred) weight, the gate applied after normalising."""
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
    solve = lambda rhs: torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    u_value = solve(beta[..., None] * v)  # the part of U independent of the entering state
    u_state = solve(beta[..., None] * cum.exp()[..., None] * k)  # the part multiplied by it
    qk = (q @ k.transpose(-1, -2)) * decay
    decay_to_end = (cum[..., -1:] - cum).exp()[..., None]  # e^{G_last - G_j}
    out = v.new_empty(b, h, n, chunk, v.shape[-1])
    for c in range(n):
        u = u_value[:, :, c] - u_state[:, :, c] @ state
        out[:, :, c] = cum[:, :, c, :, None].exp() * (q[:, :, c] @ state) + qk[:, :, c] @ u
        state = cum[:, :, c, -1, None, None].exp() * state + (k[:, :, c] * decay_to_end[:, :, c]).transpose(-1, -2) @ u
    return out.reshape(b, h, n * chunk, -1)[:, :, :length], state


# ----------------------------------------------------------------------------------------------------- mlps
class FloatExperts(nn.Module):
    """Fused expert tensors as in the official BF16 release: gate_up_proj [E, 2I, H] (gate rows first), down_proj
    [E, H, I]. Also the trainable form (the demo model is trained with these parameters). Every expert store offers
    its interface: `device` (where the layer's experts are computed), `gate_up(e, x)` and `down(e, x)`."""

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


class SparseMoE(nn.Module):
    """Softmax router, top-k renormalised, SwiGLU experts, plus a shared expert scaled by a sigmoid gate."""
    input_projections = ("gate", "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert_gate")

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.fused_projection: nn.Module | None = None
        self.cfg = cfg
        h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.gate = projection(h, e)
        self.experts = FloatExperts(e, h, i)  # loading may put another expert store in its place (backends)
        self.shared_expert = DenseMLP(h, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = projection(h, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        router, shared_gate, shared_up, shared_scale = project(self, x)
        # the top-k of a softmax, renormalised, is the softmax of the top-k logits
        top_logits, top_i = router.float().topk(self.cfg.num_experts_per_tok, dim=-1)
        top_p = torch.softmax(top_logits, dim=-1).to(x.dtype)
        out = self.routed_experts(x, top_i, top_p)
        shared = self.shared_expert.down_proj(silu_mul(shared_gate, shared_up))
        out = out + torch.sigmoid(shared_scale) * shared
        return out.view(shape)

    def routed_experts(self, x: torch.Tensor, top_i: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Groups the (token, slot) pairs by expert and runs each used expert once on its tokens, on the device
        that holds the experts: hidden states and routing of experts kept in RAM travel to the CPU in one copy, and
        the result comes back in one (the routing has to reach the host anyway, to pick the experts)."""
        home = x.device
        if self.experts.device != home:
            x, top_i, top_p = moved_together(x, top_i, top_p, self.experts.device)
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


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for fused [..., 2I] rows, gate first."""
    return silu_mul(*gate_up.chunk(2, dim=-1))


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = projection(hidden, inter)
        self.up_proj = projection(hidden, inter)
        self.down_proj = projection(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


# ---------------------------------------------------------------------------------------------------- model
class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int):
        super().__init__()
        self.is_full_attention = cfg.layer_types[layer] == "full_attention"
        if self.is_full_attention:
            self.self_attn = GatedAttention(cfg, layer)
        else:
            self.linear_attn = GatedDeltaNet(cfg, layer)
        self.mlp = SparseMoE(cfg) if cfg.is_moe else DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, token_mask, key_mask):
        h = self.input_layernorm(x)
        if self.is_full_attention:
            h = self.self_attn(h, cos, sin, cache, key_mask)
        else:
            if token_mask is not None:  # padded tokens must not enter the recurrent state
                h = h * token_mask[..., None].to(h.dtype)
            h = self.linear_attn(h, cache)
        x = within_fp16(x + h)
        return within_fp16(x + self.mlp(self.post_attention_layernorm(x)))


class TextModel(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = projection(cfg.hidden_size, cfg.vocab_size)

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache: Cache | None = None,
                attention_mask: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """inputs_embeds [B, T, H]; position_ids [3, B, T]; attention_mask [B, T] (1 = real token, 0 = left padding)
        covering only these T tokens. Returns fp32 logits [B, T, V] (or [B, 1, V] with last_only)."""
        cos, sin = rotary_cos_sin(self.cfg, position_ids)
        key_mask = None
        if cache is not None:
            key_mask = cache.extend_mask(attention_mask, inputs_embeds.shape[1])
        elif attention_mask is not None:
            key_mask = attention_mask.bool()
        token_mask = attention_mask
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, cos, sin, cache, token_mask, key_mask)
        if cache is not None:
            cache.advance(inputs_embeds.shape[1])
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x)).float()
