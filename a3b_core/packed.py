"""bf16 matrices re-laid-out once for oneDNN's CPU matmul ("packed" into its blocked weight format).

Measured on this project's AVX-512 CPU: a batch-1 product reads a packed bf16 matrix about 1.3-1.4x faster than
torch's default bf16 path, and prefill-sized products gain about as much; results are the same to the bit. Only bf16
matrices on the CPU are packed, one at a time, and the checkpoint's mapped pages of each are dropped once it is
packed, so loading never holds two copies. Where oneDNN is missing or refuses, the plain weights stay.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from .experts import FloatExperts


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
    """[out, in] bf16 -> oneDNN's blocked layout, chosen for batch-1 products (decoding)."""
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


class FusedPackedLinear(nn.Module):
    """Several bias-free bf16 Linears that read the same input as one packed product, split into their outputs:
    fewer, larger products (the small ones, such as a router or a per-head gate, cost mostly call overhead)."""

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.sizes = [w.shape[0] for w in weights]
        self.register_buffer("packed_weight", pack(torch.cat(weights)), persistent=False)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(packed_matmul(x, self.packed_weight).split(self.sizes, dim=-1))


class PackedExperts(nn.Module):
    """FloatExperts' products with each expert's two matrices packed; x is bf16 (the compute dtype of any model
    that packs)."""

    def __init__(self, experts: FloatExperts):
        super().__init__()
        self.gate_up_proj = PackedStack(experts.gate_up_proj.data)
        self.down_proj = PackedStack(experts.down_proj.data)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return packed_matmul(x, self.gate_up_proj.matrices[e])

    def down(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return packed_matmul(x, self.down_proj.matrices[e])


class PackedStack(nn.Module):
    def __init__(self, stack: torch.Tensor):
        super().__init__()
        for e, w in enumerate(stack):
            self.register_buffer(f"expert{e}", pack(w), persistent=False)
        self.matrices = [getattr(self, f"expert{e}") for e in range(len(stack))]


def pack_cpu_weights(module: nn.Module, release: Callable[[str], None], dense: bool) -> None:
    """Swaps, in place, every bf16 CPU FloatExperts (and with `dense`, every bf16 CPU Linear) of `module`
    for its packed form; `release(name)` is told each swapped submodule's name, whose source can then be dropped.
    With `dense`, the Linears a submodule lists in `input_projections` become one fused product."""
    if not packing_available():
        return
    if dense:
        fuse_input_projections(module, release)
    for name in [name for name, _ in module.named_modules()]:  # names only: a swapped module must be freeable
        child = module.get_submodule(name)
        if isinstance(child, FloatExperts) and child.gate_up_proj.dtype == torch.bfloat16 \
                and child.device.type == "cpu":
            packed: nn.Module = PackedExperts(child)
        elif dense and isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16 \
                and child.weight.device.type == "cpu":
            packed = PackedLinear(child.weight.data, None if child.bias is None else child.bias.data)
        else:
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(parent), leaf, packed)
        del child, packed
        release(name)


def fuse_input_projections(module: nn.Module, release: Callable[[str], None]) -> None:
    for name in [name for name, child in module.named_modules() if hasattr(child, "input_projections")]:
        owner = module.get_submodule(name)
        linears = [owner.get_submodule(p) for p in owner.input_projections]
        if not all(isinstance(lin, nn.Linear) and lin.bias is None and lin.weight.dtype == torch.bfloat16
                   and lin.weight.device.type == "cpu" for lin in linears):
            continue
        owner.fused_projection = FusedPackedLinear([lin.weight.data for lin in linears])
        del linears
        for p in owner.input_projections:
            parent, _, leaf = p.rpartition(".")
            setattr(owner.get_submodule(parent), leaf, None)
            release(f"{name}.{p}")
