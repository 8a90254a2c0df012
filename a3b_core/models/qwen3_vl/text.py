"""The Qwen3-VL text decoder (MoE and dense): the Qwen3 decoder with interleaved M-RoPE over whole heads.

Every layer is grouped-query full attention with per-head q/k RMSNorm (models/layers.py), then a softmax top-k mixture
of experts without a shared expert (or, in the dense sizes and any mlp_only_layers, a SwiGLU MLP). Norms are plain
RMSNorm (y = x / rms(x) * w). DeepStack features of images are added after the first layers (layers.DecoderModel).
Parameter names equal the checkpoint's, minus the "model.language_model." prefix.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kv_cache import KVCache
from ..layers import Attention, DecoderModel, DenseMLP, RMSNorm, RoutedExperts, project, within_fp16
from .config import TextConfig

NORM_OFFSET = 0.0  # plain RMSNorm weights


class SparseMoE(RoutedExperts):
    input_projections = ("gate",)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        (router,) = project(self, x)
        top_i, top_p = self.route(router, x.dtype)
        return self.routed_experts(x, top_i, top_p, decoding=shape[-2] == 1).view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer, output_gate=False, norm_offset=NORM_OFFSET)
        self.mlp = SparseMoE(cfg) if cfg.moe_layers[layer] else DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, NORM_OFFSET)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, NORM_OFFSET)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                token_mask: torch.Tensor | None, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = within_fp16(x + self.self_attn(self.input_layernorm(x), cos, sin, cache, key_mask))
        return within_fp16(x + self.mlp(self.post_attention_layernorm(x)))


class TextModel(DecoderModel):
    def __init__(self, cfg: TextConfig):
        super().__init__(cfg, (DecoderLayer(cfg, i) for i in range(cfg.num_layers)),
                         RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, NORM_OFFSET))


def new_cache(cfg: TextConfig, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", kv_dtype: str | None = None) -> KVCache:
    """Keys and values of every layer: Qwen3-VL has no other generation state."""
    return KVCache(range(cfg.num_layers), cfg.num_kv_heads, cfg.head_dim, batch, max_len, dtype, device, kv_dtype)
