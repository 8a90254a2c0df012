"""Generation state of Qwen3.5: the keys and values of the full-attention layers (kv_cache.KVCache), and the conv
history and recurrent state of the DeltaNet layers, in fp32."""
from __future__ import annotations

import torch

from ..kv_cache import KVCache
from .config import TextConfig


class Cache(KVCache):
    STATE_BUFFERS = ("conv", "state")

    def __init__(self, cfg: TextConfig, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", kv_dtype: str | None = None):
        full = [layer for layer, kind in enumerate(cfg.layer_types) if kind == "full_attention"]
        super().__init__(full, cfg.num_kv_heads, cfg.head_dim, batch, max_len, dtype, device, kv_dtype)
        self.conv: dict[int, torch.Tensor] = {}
        self.state: dict[int, torch.Tensor] = {}
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
            cfg.linear_num_value_heads * cfg.linear_value_head_dim
        for layer, kind in enumerate(cfg.layer_types):
            if kind == "linear_attention":
                self.conv[layer] = torch.zeros(batch, cfg.linear_conv_kernel_dim - 1, conv_dim, device=device)
                self.state[layer] = torch.zeros(batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                                cfg.linear_value_head_dim, device=device)

    def conv_state(self, layer: int) -> torch.Tensor:
        return self.conv[layer]

    def recurrent_state(self, layer: int) -> torch.Tensor:
        return self.state[layer]

    def set_recurrent_state(self, layer: int, state: torch.Tensor) -> None:
        self.state[layer].copy_(state)
