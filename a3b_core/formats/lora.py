"""LoRA adapters as low-rank side paths beside a weight in any format: the base matrix computes as it always does (bf16,
fp32, int8, int4, FP8, on the CPU or a GPU) and the side path adds scale * B (A x) in the compute dtype, so a quantized
base is never dequantized or quantized again, and taking the side path off leaves the base exactly as it was.

Several adapters on one matrix are one side path: their ranks concatenated, each B multiplied by its scale and
strength.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LowRank(nn.Module):
    """x -> (x a^T) b^T for a [R, in] and b [out, R] (b holding the scales): a Linear's side path."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.a, self.b = nn.Buffer(a, persistent=False), nn.Buffer(b, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x.to(self.a.dtype), self.a), self.b)


class EmbeddingLowRank(LowRank):
    """ids -> a^T[ids] b^T for a [R, vocab] and b [hidden, R]: an embedding table's side path."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(F.embedding(ids, self.a.t()), self.b)


class ExpertLowRank(nn.Module):
    """Expert e's side path of one expert stack: (x a[e]^T) b[e]^T for a [E, R, in] and b [E, out, R]."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.a, self.b = nn.Buffer(a, persistent=False), nn.Buffer(b, persistent=False)

    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x.to(self.a.dtype), self.a[e]), self.b[e])


class AdaptedExperts(nn.Module):
    """A layer's routed experts with side paths on gate_up_proj and/or down_proj (None: that stack has none). Offers
    the expert-store interface (`device`, `gate_up`, `down`) and no whole-step kernel, so the MoE block computes each
    chosen expert's products, each with its side path."""

    def __init__(self, store: nn.Module, gate_up: ExpertLowRank | None, down: ExpertLowRank | None):
        super().__init__()
        self.store, self.gate_up_side, self.down_side = store, gate_up, down

    @property
    def device(self) -> torch.device:
        return self.store.device

    def gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return with_side_path(self.store.gate_up(e, x), self.gate_up_side, e, x)

    def down(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return with_side_path(self.store.down(e, x), self.down_side, e, x)


def with_side_path(out: torch.Tensor, side: ExpertLowRank | None, e: int, x: torch.Tensor) -> torch.Tensor:
    return out if side is None else out + side(e, x).to(out.dtype)


def add_side_path(side: LowRank, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A module's output with its side path added, in the output's dtype."""
    return out + side(x).to(out.dtype)
