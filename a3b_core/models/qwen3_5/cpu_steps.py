"""Qwen3.5's decoding steps as numba kernels, made of the generic kernels of kernels/cpu_numba.py and
kernels/gguf_numba.py: a Gated DeltaNet layer's step after its input projections, a sparse MoE block's step, and a
MoE decoder layer's whole step (Gated DeltaNet or gated full attention) in one compiled call. runtime/step_kernels.py
attaches them to the model's modules.

Imported only once the generic kernels compile (it imports numba). Weights come in named bundles (NamedTuples, which
numba reads in nopython mode), built once when the kernels are attached: a matrix is a kernels.arrays.Matrix (its
format code and the arrays the kernels read) or a BlockMatrix (a GGUF file's blocks), the routed experts a
RoutedExperts or a BlockExperts; the kernel each bundle's product takes is chosen at compile time by its type
(matrix_product, routed_sum). Each intermediate is rounded to bf16 where torch's bf16 path rounds it.
numba's on-disk cache of these kernels holds the generic kernels they call compiled in, while numba itself notices
changes to this file only: numba_threads.key_cache_on adds a hash of the generic kernels' files to their cache's
stamp, so a changed generic kernel (an update of the pack) compiles them again.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ...kernels import cpu_numba, gguf_numba, gguf_vector
from ...kernels.arrays import BlockExperts, BlockMatrix, Matrix, RoutedExperts
from ...kernels.gguf_numba import coded_product, coded_routed_step
from ...kernels.numba_threads import key_cache_on
from ...kernels.cpu_numba import (FAST, attend_cached, bf16_bits, bf16_half_bits, bf16_product, bf16_rows,
                                  normed_bf16, rms_norm_rows, rotate_half, round_bf16, routed_step)


class DeltaRule(NamedTuple):
    """A Gated DeltaNet layer's small parameters in fp32, as gated_delta_step reads them."""
    conv_w: np.ndarray  # the causal conv's taps [C, K]
    a_log: np.ndarray  # [nv]
    dt_bias: np.ndarray  # [nv]
    norm_w: np.ndarray  # the gated norm's weight [dv]
    eps: np.float32  # the gated norm's eps
    key_heads: int


class MoeWeights(NamedTuple):
    """A sparse MoE block: the router, the shared expert's mixing weight (both bf16), the shared expert's gate, up and
    down (one format), the routed experts (in a kernel format or a GGUF file's blocks) and how many of them each row
    takes."""
    router: Matrix
    mix: Matrix
    gate: Matrix | BlockMatrix
    up: Matrix | BlockMatrix
    down: Matrix | BlockMatrix
    experts: RoutedExperts | BlockExperts
    top_k: int


class LayerNorms(NamedTuple):
    """A decoder layer's input and post-attention RMSNorms: their scales (weight plus offset, fp32) and their eps,
    which the layer's other norms share."""
    before: np.ndarray
    after: np.ndarray
    eps: np.float32


class DeltaNetWeights(NamedTuple):
    """A Gated DeltaNet token mixer: its input projections (qkv and z in one format, b and a bf16), its output
    projection (qkv's format) and its delta rule."""
    qkv: Matrix | BlockMatrix
    z: Matrix | BlockMatrix
    b: Matrix
    a: Matrix
    out: Matrix | BlockMatrix
    rule: DeltaRule


class AttentionWeights(NamedTuple):
    """A gated full-attention token mixer: its q (each head's queries, then its gate channels), k, v and o projections
    (one format), the per-head norms' scales (weight plus offset) and the query heads."""
    q: Matrix | BlockMatrix
    k: Matrix | BlockMatrix
    v: Matrix | BlockMatrix
    o: Matrix | BlockMatrix
    q_norm: np.ndarray
    k_norm: np.ndarray
    heads: int


@njit(cache=True, fastmath=FAST, parallel=True)
def gated_delta_step(qkv, z, beta_in, a_in, rule, history, state, out):
    """One decoding token of a Gated DeltaNet layer for each of B sequences, from its input projections to the gated
    norm's output (text.py, GatedDeltaNet.forward with one token, in fp32): qkv [B, C] and z [B, nv * dv]
    (projections), beta_in / a_in [B, nv]; rule a DeltaRule; history [B, K-1, C] (the conv's previous inputs,
    updated); state [B, nv, dk, dv] (updated); out [B, nv * dv]."""
    conv_w, a_log, dt_bias, norm_w, eps = rule.conv_w, rule.a_log, rule.dt_bias, rule.norm_w, rule.eps
    batch, channels = qkv.shape
    taps = conv_w.shape[1]
    heads, dk, dv = state.shape[1], state.shape[2], state.shape[3]
    key_dim = rule.key_heads * dk
    conv = np.empty((batch, channels), np.float32)
    # the causal conv's step and SiLU, channel by channel; the history shifts by one input
    for c in prange(channels):
        for s in range(batch):
            acc = qkv[s, c] * conv_w[c, taps - 1]
            for i in range(taps - 1):
                acc += history[s, i, c] * conv_w[c, i]
            for i in range(taps - 2):
                history[s, i, c] = history[s, i + 1, c]
            history[s, taps - 2, c] = qkv[s, c]
            conv[s, c] = acc / (1 + np.exp(-acc))
    # per value head: its key head's q, k (L2-normalized, q scaled by dk^-1/2), the delta rule, the gated norm
    for item in prange(batch * heads):
        s, h = item // heads, item % heads
        kh = h // (heads // rule.key_heads)
        q = conv[s, kh * dk:(kh + 1) * dk]
        k = conv[s, key_dim + kh * dk:key_dim + (kh + 1) * dk]
        v = conv[s, 2 * key_dim + h * dv:2 * key_dim + (h + 1) * dv]
        q_sq, k_sq = np.float32(0.0), np.float32(0.0)
        for i in range(dk):
            q_sq += q[i] * q[i]
            k_sq += k[i] * k[i]
        q_scale = np.float32(1.0) / np.sqrt(q_sq + np.float32(1e-6)) / np.sqrt(np.float32(dk))
        k_scale = np.float32(1.0) / np.sqrt(k_sq + np.float32(1e-6))
        beta = np.float32(1.0) / (1 + np.exp(-beta_in[s, h]))
        a = a_in[s, h] + dt_bias[h]
        softplus = a if a > 20 else np.log1p(np.exp(a))  # torch's softplus (threshold 20)
        decay = np.exp(-np.exp(a_log[h]) * softplus)
        st = state[s, h]
        u = np.zeros(dv, np.float32)  # k @ state (before the decay), then the update's row
        for i in range(dk):
            ki = k[i] * k_scale
            for j in range(dv):
                u[j] += ki * st[i, j]
        for j in range(dv):
            u[j] = (v[j] - decay * u[j]) * beta
        o = np.zeros(dv, np.float32)
        for i in range(dk):
            ki, qi = k[i] * k_scale, q[i] * q_scale
            for j in range(dv):
                new = decay * st[i, j] + ki * u[j]
                st[i, j] = new
                o[j] += qi * new
        o_sq = np.float32(0.0)
        for j in range(dv):
            o_sq += o[j] * o[j]
        o_scale = np.float32(1.0) / np.sqrt(o_sq / dv + eps)
        for j in range(dv):
            g = z[s, h * dv + j]
            out[s, h * dv + j] = o[j] * o_scale * norm_w[j] * (g / (1 + np.exp(-g)))


@njit(cache=True)
def product(matrix, x):
    """The rows x [T, in] (fp32 holding bf16 values) times a Matrix or BlockMatrix (matrix_product), plus its LoRA
    side path if it has one, rounded to bf16."""
    out = matrix_product(matrix, x)
    if matrix.side_a.shape[0]:
        add_side_path(matrix.side_a, matrix.side_b, x, out)
    return out


def matrix_product(matrix, x):
    """x times the matrix, rounded to bf16, in the kernel of the matrix's kind: compiled code only (overloaded below,
    by the bundle's type, whose arrays differ)."""
    raise NotImplementedError("matrix_product is called from compiled kernels only")


@overload(matrix_product)
def matrix_product_of(matrix, x):
    if is_bundle(matrix, BlockMatrix):
        def blocks_product(matrix, x):
            out = np.empty((x.shape[0], matrix.q.shape[0]), np.float32)
            coded_product(matrix.type_id, matrix.q, x, matrix.order, out)
            round_bf16(out.reshape(-1))
            return out
        return blocks_product
    return lambda matrix, x: bf16_product(matrix.code, matrix.q, matrix.scale, x)


def routed_sum(experts, x, ids, weights, out):
    """out += the routed experts' weighted sum for rows x (ids, weights [T, k]), by the kernel of the experts' kind:
    compiled code only (overloaded below)."""
    raise NotImplementedError("routed_sum is called from compiled kernels only")


@overload(routed_sum)
def routed_sum_of(experts, x, ids, weights, out):
    if is_bundle(experts, BlockExperts):
        def blocks_sum(experts, x, ids, weights, out):
            routed = np.empty(out.shape, np.float32)
            coded_routed_step(experts.types, experts.row_bytes, experts.inter, experts.gate_up, experts.down, x, ids,
                              weights, routed)
            out += routed
        return blocks_sum

    def kernel_sum(experts, x, ids, weights, out):
        gate_up, down = experts.gate_up, experts.down
        routed_step(gate_up.code, experts.inter, gate_up.q, gate_up.scale, down.q, down.scale, x, ids, weights, out)
    return kernel_sum


def is_bundle(value: object, bundle: type) -> bool:
    """Whether a numba type is that of the NamedTuple class `bundle`."""
    return isinstance(value, types.BaseNamedTuple) and value.instance_class is bundle


@njit(cache=True, fastmath=FAST)
def add_side_path(a, b, x, out):
    """out += (x a^T) b^T for rows x [T, in] and out [T, out] (fp32 holding bf16 values), each product and the sum
    rounded to bf16 as torch's bf16 path rounds them (formats/lora.py)."""
    out += small_product(small_product(x, a), b)
    round_bf16(out.reshape(-1))


@njit(cache=True, fastmath=FAST)
def small_product(x, m):
    """x [T, k] times m^T (m [n, k], few rows or few columns) summed in fp32, rounded to bf16."""
    out = np.empty((x.shape[0], m.shape[0]), np.float32)
    for t in range(x.shape[0]):
        for r in range(m.shape[0]):
            total = np.float32(0.0)
            for j in range(x.shape[1]):
                total += x[t, j] * m[r, j]
            out[t, r] = total
    round_bf16(out.reshape(-1))
    return out


@njit(cache=True)
def sparse_moe_step(moe, x_bits, out):
    """A sparse MoE block's decoding step (moe_step) for the bf16 rows of x_bits (int16 [T, H]) into out
    (int16 [T, H], bf16)."""
    bf16_bits(moe_step(moe, bf16_rows(x_bits)), out)


@njit(cache=True)
def moe_step(moe, x):
    """A sparse MoE block's decoding step (text.py, SparseMoE.forward) for rows x (fp32 [T, H] holding bf16 values),
    returned as fp32 [T, H] holding bf16 values: the router's product and the shared expert's mixing weight, the
    top-k softmax routing, the routed experts (routed_step) and the shared expert scaled by the sigmoid of its mixing
    weight (moe, MoeWeights). Each intermediate is rounded to bf16 where torch's bf16 path rounds it, so the step
    returns what that path returns with the dense and routed kernels, up to fp32 rounding."""
    tokens, top_k = x.shape[0], moe.top_k
    logits = product(moe.router, x)
    mix = product(moe.mix, x)
    gate = product(moe.gate, x)
    up = product(moe.up, x)
    # the top-k logits (the first of equal ones) and their softmax, rounded to bf16
    experts = logits.shape[1]
    ids = np.empty((tokens, top_k), np.int64)
    weights = np.empty((tokens, top_k), np.float32)
    for t in range(tokens):
        taken = np.zeros(experts, np.bool_)
        for j in range(top_k):
            best = -1
            for e in range(experts):
                if not taken[e] and (best < 0 or logits[t, e] > logits[t, best]):
                    best = e
            taken[best] = True
            ids[t, j] = best
        total = np.float32(0.0)
        for j in range(top_k):
            weights[t, j] = np.exp(logits[t, ids[t, j]] - logits[t, ids[t, 0]])
            total += weights[t, j]
        for j in range(top_k):
            weights[t, j] /= total
    round_bf16(weights.reshape(-1))
    routed = np.zeros(x.shape, np.float32)
    routed_sum(moe.experts, x, ids, weights, routed)
    round_bf16(routed.reshape(-1))
    # the shared expert: SiLU(gate) rounded, times up rounded, down; times the sigmoid of its mixing weight (each
    # step in place, rounded where torch rounds it)
    act = gate.reshape(-1)  # gate's own storage: gate [T, I] becomes the activation
    for k in range(act.shape[0]):
        act[k] = act[k] / (1 + np.exp(-act[k]))
    round_bf16(act)
    act *= up.reshape(-1)
    round_bf16(act)
    shared = product(moe.down, gate)
    mix_weight = mix.reshape(-1)  # [T]
    for t in range(tokens):
        mix_weight[t] = 1 / (1 + np.exp(-mix_weight[t]))
    round_bf16(mix_weight)
    for t in range(tokens):
        shared[t] *= mix_weight[t]
    round_bf16(shared.reshape(-1))
    shared += routed
    round_bf16(shared.reshape(-1))
    return shared


@njit(cache=True)
def residual_moe(x, mixed, norms, moe, out):
    """The second half of a MoE decoder layer's decoding step: the residual x + mixed (x, mixed: fp32 [T, H] holding
    bf16 values; x is overwritten), the post-attention norm, the MoE block (moe_step) and the residual, rounded to
    bf16 into out (int16 [T, H])."""
    x += mixed
    round_bf16(x.reshape(-1))
    x += moe_step(moe, normed_bf16(x, norms.after, norms.eps))
    bf16_bits(x, out)


@njit(cache=True)
def deltanet_layer_step(norms, mixer, moe, history, state, x_bits, out):
    """A Gated DeltaNet decoder layer's decoding step (text.py, DecoderLayer.forward) for the bf16 rows of x_bits
    (int16 [T, H]) into out (int16 [T, H], bf16): the input norm (norms, LayerNorms), the input projections, the
    DeltaNet step (gated_delta_step on history and state, updated), the output projection (mixer, DeltaNetWeights),
    then residual_moe (moe, MoeWeights). Each intermediate is rounded to bf16 where the layer's path with the
    separate kernels rounds it, so the step returns what that path returns."""
    x = bf16_rows(x_bits)
    h = normed_bf16(x, norms.before, norms.eps)
    z = product(mixer.z, h)
    mixed = np.empty(z.shape, np.float32)
    gated_delta_step(product(mixer.qkv, h), z, product(mixer.b, h), product(mixer.a, h), mixer.rule, history, state,
                     mixed)
    round_bf16(mixed.reshape(-1))
    residual_moe(x, product(mixer.out, mixed), norms, moe, out)


@njit(cache=True)
def attention_layer_step(norms, mixer, moe, cos, sin, keys, values, start, x_bits, out):
    """A gated full-attention decoder layer's decoding step (DecoderLayer.forward with models/layers.py's Attention,
    output_gate) for the bf16 rows of x_bits (int16 [T, H]) into out (int16 [T, H], bf16): the input norm (norms,
    LayerNorms), the q, k and v projections, the per-head norms, the rotary embedding of the first cos.shape[1]
    channels (cos, sin [T, rotary_dim] fp32), the new key and value stored at token `start` of keys and values (bf16
    bit patterns [T, kv_heads, max_len, head_dim]), attention over the tokens up to it, the sigmoid gate, the output
    projection (mixer, AttentionWeights), then residual_moe (moe, MoeWeights). Intermediates are rounded to bf16
    where the layer's path rounds them; attention sums in fp32 in its own order (torch's attention too rounds only
    its output)."""
    x = bf16_rows(x_bits)
    tokens, heads = x.shape[0], mixer.heads
    kv_heads, head_dim = keys.shape[1], keys.shape[3]
    h = normed_bf16(x, norms.before, norms.eps)
    q_gate = product(mixer.q, h)  # [T, heads * 2 * head_dim]
    q = np.empty((tokens * heads, head_dim), np.float32)
    gate = np.empty((tokens, heads * head_dim), np.float32)
    for t in range(tokens):
        for i in range(heads):
            q[t * heads + i] = q_gate[t, 2 * i * head_dim:(2 * i + 1) * head_dim]
            gate[t, i * head_dim:(i + 1) * head_dim] = q_gate[t, (2 * i + 1) * head_dim:(2 * i + 2) * head_dim]
    k = product(mixer.k, h).reshape(tokens * kv_heads, head_dim)
    v = product(mixer.v, h)
    for rows, scale, per_token in ((q, mixer.q_norm, heads), (k, mixer.k_norm, kv_heads)):
        rms_norm_rows(rows, scale, norms.eps)
        round_bf16(rows.reshape(-1))
        rotate_half(rows, cos, sin, per_token)
        round_bf16(rows.reshape(-1))
    for t in range(tokens):
        keys[t, :, start] = bf16_half_bits(k[t * kv_heads:(t + 1) * kv_heads])
        values[t, :, start] = bf16_half_bits(v[t].reshape(kv_heads, head_dim))
    mixed = np.empty((tokens, heads * head_dim), np.float32)
    attend_cached(q, keys, values, start + 1, heads // kv_heads, mixed)
    round_bf16(mixed.reshape(-1))
    for t in range(tokens):  # the gate: sigmoid rounded, the product rounded
        for c in range(heads * head_dim):
            gate[t, c] = np.float32(1.0) / (np.float32(1.0) + np.exp(-gate[t, c]))
    round_bf16(gate.reshape(-1))
    mixed *= gate
    round_bf16(mixed.reshape(-1))
    residual_moe(x, product(mixer.o, mixed), norms, moe, out)


# the kernels here compile the generic kernels in: stamped with their files' text too
key_cache_on((gated_delta_step, product, sparse_moe_step, moe_step, residual_moe, deltanet_layer_step,
              attention_layer_step), cpu_numba.__file__, gguf_numba.__file__, gguf_vector.__file__)
