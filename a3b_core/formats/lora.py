"""LoRA adapters as low-rank side paths beside a weight in any format: the base matrix computes as it always does (bf16,
fp32, int8, int4, FP8, on the CPU or a GPU) and the side path adds scale * B (A x) in the compute dtype, so a quantized
base is never dequantized or quantized again, and taking the side path off leaves the base exactly as it was.

Several adapters on one matrix are one side path: their ranks concatenated, each B multiplied by its scale and
strength. A module's side paths are its attribute `lora_side_paths` ({None: side} for a Linear or an embedding,
{part: side} for a fused product's parts), which a forward hook adds to its output and which the CPU's fused decoding
steps read (runtime/row_kernels.py).
"""
from __future__ import annotations

from collections.abc import Callable

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


def side_paths(module: nn.Module) -> dict[int | None, LowRank]:
    """The side paths a module's output takes (none: {})."""
    return getattr(module, "lora_side_paths", {})


def add_side_paths(module: nn.Module, args: tuple, out: torch.Tensor | list[torch.Tensor]
                   ) -> torch.Tensor | list[torch.Tensor]:
    """The forward hook of a module with side paths: its output (or each part of a fused product's) plus the side
    path of its input, in the output's dtype."""
    sides, x = module.lora_side_paths, args[0]
    if isinstance(out, list):
        return [o + sides[i](x).to(o.dtype) if i in sides else o for i, o in enumerate(out)]
    return out + sides[None](x).to(out.dtype)


def attach_side_paths(module: nn.Module, sides: dict[int | None, LowRank]) -> Callable[[], None]:
    """Gives `module` these side paths; returns what takes them off again."""
    module.lora_side_paths = sides
    hook = module.register_forward_hook(add_side_paths)

    def detach() -> None:
        hook.remove()
        del module.lora_side_paths
    return detach
