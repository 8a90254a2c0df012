"""The keys and values of a model's attention layers during generation, and their size.

Buffers are preallocated for the whole context, so decoding never allocates.

Keys and values are stored in the compute dtype ("auto"), in another float format (bf16, fp16, fp32), or as
int8 with one fp32 scale per (row, token, KV head): scale = absmax / 127 over the head's channels, so every stored
element is within scale / 2 = absmax / 254 of its exact value (round to nearest). When the stored format is not the
compute dtype, each layer's cached prefix is converted into one shared scratch pair in the compute dtype just before
its attention, so the int8 cache costs (head_dim + 4) / (head_dim * compute bytes) of the float cache, plus one
layer's float keys and values. Stated logit error: 32 cached decode steps with the int8 cache stay within 0.02 x the
standard deviation of the fp32-cache logits (1.0% measured on the test models; real models have not been measured).
"""
from __future__ import annotations

import copy
from collections.abc import Iterable

import torch

from ..errors import PromptError
from ..formats.table import FLOAT_FORMATS, INT8, checked_kv_format

INT8_MAX = 127


class KVCache:
    """Keys and values of the `layers` (decoder layer indices with attention), the padding mask and the length. A
    family whose layers keep other state derives from it and names those per-layer buffers in STATE_BUFFERS."""

    TOKEN_BUFFERS = ("keys", "values", "key_scales", "value_scales")  # per-layer dicts of [B, heads, max_len, ...]
    STATE_BUFFERS: tuple[str, ...] = ()  # per-layer dicts of [B, ...] state that has no token axis

    def __init__(self, layers: Iterable[int], num_kv_heads: int, head_dim: int, batch: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", kv_dtype: str | None = None):
        kv_format = checked_kv_format(kv_dtype)
        self.quantized = kv_format == INT8
        store = torch.int8 if self.quantized else FLOAT_FORMATS.get(kv_format, dtype)
        self.max_len = max_len
        self.length = 0
        self.padded = False  # whether any row has padding, so attention needs the mask
        self.mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.key_scales: dict[int, torch.Tensor] = {}  # int8 only: [B, kv_heads, max_len, 1] fp32
        self.value_scales: dict[int, torch.Tensor] = {}
        shape = (batch, num_kv_heads, max_len, head_dim)  # heads first: each head's keys are contiguous
        for layer in layers:
            self.keys[layer] = torch.zeros(shape, dtype=store, device=device)
            self.values[layer] = torch.zeros(shape, dtype=store, device=device)
            if self.quantized:
                self.key_scales[layer] = torch.zeros(shape[:-1] + (1,), device=device)
                self.value_scales[layer] = torch.zeros(shape[:-1] + (1,), device=device)
        # stored in another format: one layer's keys and values in the compute dtype, reused by every layer in turn
        self.scratch = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(2)) \
            if store != dtype and self.keys else ()

    @property
    def token_buffers(self) -> tuple[dict[int, torch.Tensor], ...]:
        return tuple(getattr(self, name) for name in self.TOKEN_BUFFERS)

    @property
    def state_buffers(self) -> tuple[dict[int, torch.Tensor], ...]:
        return tuple(getattr(self, name) for name in self.STATE_BUFFERS)

    @property
    def row_buffers(self) -> tuple[dict[int, torch.Tensor], ...]:
        """Every per-layer buffer whose first dimension is the batch row."""
        return self.token_buffers + self.state_buffers

    def _check_room(self, t: int) -> None:
        if self.length + t > self.max_len:
            raise PromptError(f"the context is full: {self.length} tokens are cached and {t} more do not fit in "
                              f"max_context={self.max_len}. Shorten the prompt, lower max_new_tokens, or raise "
                              "max_context.")

    def extend_mask(self, attention_mask: torch.Tensor | None, t: int) -> torch.Tensor | None:
        """Records which of the next t tokens are real; returns the key mask over everything cached so far, or None
        while no row has padding."""
        self._check_room(t)
        new = self.mask[:, self.length:self.length + t]
        if attention_mask is None:
            new.fill_(True)
        else:
            new.copy_(attention_mask.bool())
            self.padded = True
        return self.mask[:, :self.length + t] if self.padded else None

    def append_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores the new keys/values [B, kv_heads, t, head_dim]; returns all cached ones, in the compute dtype."""
        start, end = self.length, self.length + k.shape[2]
        if not self.scratch:
            self.keys[layer][:, :, start:end] = k
            self.values[layer][:, :, start:end] = v
            return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
        out = []
        for new, store, scales, scratch in ((k, self.keys, self.key_scales, self.scratch[0]),
                                            (v, self.values, self.value_scales, self.scratch[1])):
            if self.quantized:
                quantize_kv_int8(new, store[layer][:, :, start:end], scales[layer][:, :, start:end])
                out.append(torch.mul(store[layer][:, :, :end], scales[layer][:, :, :end], out=scratch[:, :, :end]))
            else:
                store[layer][:, :, start:end] = new
                out.append(scratch[:, :, :end].copy_(store[layer][:, :, :end]))
        return out[0], out[1]

    def advance(self, t: int) -> None:
        self.length += t

    def window(self, rows: slice, start: int) -> KVCache:
        """An empty cache over rows `rows` of this one, whose token 0 is this one's token `start`, sharing its memory:
        what is generated into the window lands in those rows from `start` on (the tokens before stay padding)."""
        window = copy.copy(self)
        window.max_len, window.length, window.padded = self.max_len - start, 0, False
        window.mask = self.mask[rows, start:]
        for name in self.TOKEN_BUFFERS:
            setattr(window, name, {layer: buffer[rows, :, start:] for layer, buffer in getattr(self, name).items()})
        for name in self.STATE_BUFFERS:
            setattr(window, name, {layer: buffer[rows] for layer, buffer in getattr(self, name).items()})
        window.scratch = tuple(buffer[rows, :, start:] for buffer in self.scratch)
        return window

    def start_from(self, source: KVCache) -> None:
        """Starts this empty cache from what `source` (one row, or as many as this cache, the same kind and format)
        holds: its cached tokens and its state, in every row."""
        n = source.length
        self._check_room(n)
        for mine, theirs in zip(self.token_buffers, source.token_buffers):
            for layer, buffer in theirs.items():
                mine[layer][:, :, :n] = buffer[:, :, :n]
        for mine, theirs in zip(self.state_buffers, source.state_buffers):
            for layer, buffer in theirs.items():
                mine[layer].copy_(buffer.expand_as(mine[layer]))
        self.mask[:, :n] = source.mask[:, :n]
        self.padded = source.padded
        self.length = n

    def filled_through_windows(self, length: int) -> None:
        """Takes the first `length` tokens as written (through windows); rows whose mask is False there are padded."""
        self.length = length
        self.padded = not bool(self.mask[:, :length].all())

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drops the other batch rows (finished sequences): keeps `rows`, indices into the current batch, in order.
        The kept rows move to the front of each buffer in place, so the cache never exists twice."""
        self.mask = keep_front(self.mask, rows)
        for buffers in self.row_buffers:
            for layer, buffer in buffers.items():
                buffers[layer] = keep_front(buffer, rows)
        self.scratch = tuple(buffer[:len(rows)] for buffer in self.scratch)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the stored keys and values (and their int8 scales), without the scratch pair."""
        return sum(t.numel() * t.element_size() for buffers in (self.keys, self.values, self.key_scales,
                                                                 self.value_scales) for t in buffers.values())

    @property
    def nbytes(self) -> int:
        """Every buffer this cache holds: keys/values, scales, scratch, padding mask, and a family's own state."""
        return sum(t.numel() * t.element_size() for buffers in self.row_buffers for t in buffers.values()) + sum(
            t.numel() * t.element_size() for t in (self.mask, *self.scratch))


def keep_front(buffer: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """buffer[rows] written over the buffer's first rows (only one copy of those rows is made), as a view."""
    kept = buffer[:len(rows)]
    kept.copy_(buffer.index_select(0, rows))
    return kept


def quantize_kv_int8(x: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor) -> None:
    """Symmetric int8 with one scale per vector of the last dimension, written into `out` and `scale_out`."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero vector stays exactly zero
    out.copy_((xf / scale).round_().clamp_(-INT8_MAX, INT8_MAX))
    scale_out.copy_(scale)


def kv_bytes(layers: int, num_kv_heads: int, head_dim: int, tokens: int, kv_dtype: str, compute_format: str) -> int:
    """Keys and values of `layers` attention layers for `tokens` tokens of one sequence, plus the padding mask; a
    cache stored in another format than the compute one adds one layer's keys and values in the compute format."""
    vectors = tokens * layers * 2 * num_kv_heads
    scratch = 2 * tokens * num_kv_heads * head_dim * FLOAT_FORMATS[compute_format].itemsize \
        if layers and kv_dtype != compute_format else 0
    stored = vectors * (head_dim + 4) if kv_dtype == INT8 else vectors * head_dim * FLOAT_FORMATS[kv_dtype].itemsize
    return stored + scratch + tokens
