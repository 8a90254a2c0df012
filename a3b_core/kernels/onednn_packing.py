"""The vision tower's bf16 matrices re-laid-out once for oneDNN's CPU matmul ("packed" into its blocked weight format).

A product of many rows (the vision tower's are hundreds of patches) reads a packed bf16 matrix faster than torch's
default bf16 path (1.3-1.4x on an AVX-512 EPYC, in the README), and the results are the same to the bit. The text
model is not packed: decoding multiplies single rows, which cpu_linear.py runs faster on plain matrices. Only
bf16 matrices on the CPU are packed, one at a time, and the checkpoint's mapped pages of each are dropped once it is
packed, so loading never holds two copies. Where oneDNN is missing or refuses, the plain weights stay.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn


@cache
def packing_available() -> bool:
    """oneDNN present, able to pack bf16, and its product equal to torch's on a small case."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        w = torch.linspace(-1, 1, 32 * 48).reshape(48, 32).bfloat16()
        x = torch.linspace(-2, 2, 3 * 32).reshape(3, 32).bfloat16()
        return torch.equal(packed_matmul(x, pack(w)), F.linear(x, w))
    except RuntimeError:
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bf16 -> oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] bf16 @ W^T (+ bias, bf16) for a packed W."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """A bf16 Linear with a packed weight (the bias, if any, in bf16 as the plain layer would add it)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed_weight", pack(weight), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_matmul(x, self.packed_weight, self.bias)


def pack_cpu_linears(module: nn.Module, release: Callable[[str], None]) -> None:
    """Swaps, in place, every bf16 CPU Linear of `module` for its packed form, where packing_available() says so;
    `release(name)` is told each swapped Linear's name, whose source can then be dropped."""
    for name in [name for name, _ in module.named_modules()]:  # names only: a swapped module must be freeable
        child = module.get_submodule(name)
        if not (isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16
                and child.weight.device.type == "cpu"):
            continue
        packed = PackedLinear(child.weight.data, None if child.bias is None else child.bias.data)
        parent, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(parent), leaf, packed)
        del child, packed
        release(name)
