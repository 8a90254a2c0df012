"""Qwen3.5/3.6 memory sizes the planner and the generation loop need: the KV cache of the full-attention layers,
the DeltaNet state, and the activations of a prompt token while prefilling."""
from __future__ import annotations

from ...formats.table import BF16
from ...release.config import ModelConfig
from .. import kv_cache
from ..layers import ATTENTION_SCORES_BYTES
from .text import GDN_CHUNK

# fp32 copies of a layer's widest activation alive at once while prefilling (measured on the real 35B's shapes:
# 5.2, tests/test_vram.py)
ACTIVATION_COPIES = 6


def kv_bytes(config: ModelConfig, tokens: int, kv_dtype: str, compute_format: str = BF16) -> int:
    """Keys and values of the full-attention layers for `tokens` tokens of one sequence (kv_cache.kv_bytes)."""
    t = config.text
    return kv_cache.kv_bytes(t.layer_types.count("full_attention"), t.num_kv_heads, t.head_dim, tokens, kv_dtype,
                             compute_format)


def activation_bytes_per_token(config: ModelConfig, compute_format: str) -> int:
    """An upper bound on the temporaries one prompt token adds inside a decoder layer while prefilling (the
    DeltaNet layers' fp32 intermediates dominate), as measured on the real model's shapes in the tests."""
    t = config.text
    conv_dim = 2 * t.linear_num_key_heads * t.linear_key_head_dim + t.linear_num_value_heads * t.linear_value_head_dim
    value_dim = t.linear_num_value_heads * t.linear_value_head_dim
    widest = max(conv_dim + value_dim, t.hidden_size, 2 * t.num_heads * t.head_dim)
    return ACTIVATION_COPIES * widest * 4


def deltanet_state_bytes(config: ModelConfig) -> int:
    """The DeltaNet layers' conv history and recurrent state of one sequence, in fp32, at any length."""
    t = config.text
    conv_dim = 2 * t.linear_num_key_heads * t.linear_key_head_dim + t.linear_num_value_heads * t.linear_value_head_dim
    per_layer = (conv_dim * (t.linear_conv_kernel_dim - 1)
                 + t.linear_num_value_heads * t.linear_key_head_dim * t.linear_value_head_dim) * 4
    return t.layer_types.count("linear_attention") * per_layer


def prefill_chunk(config: ModelConfig, workspace_bytes: int, rows: int, compute_format: str) -> int:
    """Prompt tokens per forward pass for a batch of `rows`: what `workspace_bytes` of activations hold besides the
    attention scores (layers.ATTENTION_SCORES_BYTES), in whole DeltaNet chunks."""
    per_token = rows * activation_bytes_per_token(config, compute_format)
    tokens = (workspace_bytes - ATTENTION_SCORES_BYTES) // per_token
    return max(GDN_CHUNK, tokens // GDN_CHUNK * GDN_CHUNK)
