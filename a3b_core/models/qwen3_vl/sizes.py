"""Qwen3-VL memory sizes the planner and the generation loop need: the KV cache of its layers (all attend fully),
and the activations of a prompt token while prefilling. There is no recurrent state."""
from __future__ import annotations

from ...formats.table import BF16
from ...release.config import ModelConfig
from .. import kv_cache
from ..layers import ATTENTION_SCORES_BYTES

# fp32 copies of a layer's widest activation alive at once while prefilling (Qwen3.5's measured bound, which holds
# here too: these layers keep fewer temporaries than a DeltaNet layer)
ACTIVATION_COPIES = 6
MIN_PREFILL_CHUNK = 64


def kv_bytes(config: ModelConfig, tokens: int, kv_dtype: str, compute_format: str = BF16) -> int:
    """Keys and values of every layer for `tokens` tokens of one sequence (kv_cache.kv_bytes)."""
    t = config.text
    return kv_cache.kv_bytes(t.num_layers, t.num_kv_heads, t.head_dim, tokens, kv_dtype, compute_format)


def state_bytes(config: ModelConfig) -> int:
    """Qwen3-VL keeps no state besides keys and values."""
    return 0


def prefill_chunk(config: ModelConfig, workspace_bytes: int, rows: int, compute_format: str) -> int:
    """Prompt tokens per forward pass for a batch of `rows`: what `workspace_bytes` of activations hold besides the
    attention scores (layers.ATTENTION_SCORES_BYTES), bounded by the layer's widest activation."""
    t = config.text
    widest = max(t.hidden_size, (t.num_heads + 2 * t.num_kv_heads) * t.head_dim, 2 * t.intermediate_size,
                 2 * t.moe_intermediate_size * t.num_experts_per_tok, t.num_experts)
    tokens = (workspace_bytes - ATTENTION_SCORES_BYTES) // (rows * ACTIVATION_COPIES * widest * 4)
    return max(MIN_PREFILL_CHUNK, tokens)
