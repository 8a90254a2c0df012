"""Generation state: keys/values of the full-attention layers, conv history and recurrent state of DeltaNet layers.

Buffers are preallocated for the whole context, so decoding never allocates.
"""
from __future__ import annotations

import torch

from .config import TextConfig
from .errors import PromptError


class Cache:
    def __init__(self, cfg: TextConfig, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.max_len = max_len
        self.length = 0
        self.mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.state: dict[int, torch.Tensor] = {}
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
            cfg.linear_num_value_heads * cfg.linear_value_head_dim
        for layer, kind in enumerate(cfg.layer_types):
            if kind == "full_attention":
                shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
                self.keys[layer] = torch.zeros(shape, dtype=dtype, device=device)
                self.values[layer] = torch.zeros(shape, dtype=dtype, device=device)
            else:
                self.conv[layer] = torch.zeros(batch, conv_dim, cfg.linear_conv_kernel_dim - 1, device=device)
                self.state[layer] = torch.zeros(batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                                cfg.linear_value_head_dim, device=device)

    def _check_room(self, t: int) -> None:
        if self.length + t > self.max_len:
            raise PromptError(f"the context is full: {self.length} tokens are cached and {t} more do not fit in "
                              f"max_context={self.max_len}. Shorten the prompt, lower max_new_tokens, or raise "
                              "max_context.")

    def extend_mask(self, attention_mask: torch.Tensor | None, t: int) -> torch.Tensor:
        """Records which of the next t tokens are real; returns the key mask over everything cached so far."""
        self._check_room(t)
        new = self.mask[:, self.length:self.length + t]
        new.copy_(attention_mask.bool() if attention_mask is not None else torch.ones_like(new))
        return self.mask[:, :self.length + t]

    def append_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[1]
        self.keys[layer][:, self.length:end] = k
        self.values[layer][:, self.length:end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def conv_state(self, layer: int) -> torch.Tensor:
        return self.conv[layer]

    def recurrent_state(self, layer: int) -> torch.Tensor:
        return self.state[layer]

    def set_recurrent_state(self, layer: int, state: torch.Tensor) -> None:
        self.state[layer].copy_(state)

    def advance(self, t: int) -> None:
        self.length += t
