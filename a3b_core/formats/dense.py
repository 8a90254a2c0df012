"""The text model's dense matrices on the CPU held as int8 or int4 (load option dense_format), or kept in a GGUF
file's blocks: the attention and DeltaNet projections, the shared experts' and dense MLPs' matrices and an untied
lm_head, each held exactly as one routed expert's matrix is (a QuantizedStack of one matrix: quantized per output row
the same way, or the file's blocks as stored; the same products).

Kept in the compute dtype: the routers and the shared expert's gate (they choose and weigh experts, where a small
error flips a choice), DeltaNet's in_proj_a / in_proj_b (per-head decay and gate inputs, tiny), the embedding table
(a row lookup, and a tied lm_head is that same table), norms and the vision tower.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from .stores import SET_ROWS_MULTIPLE, QuantizedStack

# rows quantized at a time: the fp32 copy and the quantizer's temporaries stay small (for a 248k-row lm_head, 32 MiB
# at 2048 inputs instead of 2 GiB and more for the whole matrix)
QUANTISE_ROWS = 32 * SET_ROWS_MULTIPLE

# leaf names of the text model's Linears that stay in the compute dtype (see the module docstring)
FLOAT_LINEARS = ("gate", "shared_expert_gate", "in_proj_a", "in_proj_b")


def is_quantised_dense(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a dense text-model matrix (checkpoint or module name ending in ".weight") is held in dense_format."""
    leaf = name.removesuffix(".weight").rpartition(".")[2]
    return name.endswith(".weight") and len(shape) == 2 and leaf not in FLOAT_LINEARS and leaf != "embed_tokens"


class ReleasedMatrix(NamedTuple):
    """A dense matrix [out, in] as the checkpoint stores it, for a format kept as released (GGUF: its parts, as
    QuantizedStack.set_released takes them), and the order its product reads its inputs in (None: as given)."""
    shape: tuple[int, int]
    parts: tuple
    input_order: torch.Tensor | None


class QuantizedLinear(nn.Module):
    """A bias-free Linear held as int8 (symmetric, one scale per output row) or int4 (asymmetric, groups of 128
    inputs, or 64/32 where the input size asks), or in a GGUF file's blocks (its inputs reordered first where the
    converter reordered its columns), its products of few rows computed by the numba kernels or torch's weight-only
    CPU kernels (experts.QuantizedStack says which); the output is in the input's dtype.

    Error bounds against the fp32 model on the tiny test checkpoints (tests/test_dense_quant.py; logits' spread, max -
    min per token, ~3.4): mean |logit error| under 0.1 (3% of the spread) with int8, under 0.6 (18%) with int4; the
    worst logit under 0.4 / 3.0 on the dense model, under 2.5 / 4.0 on the MoE, where it is a flipped router choice."""

    def __init__(self, fmt: str, weight: torch.Tensor | ReleasedMatrix):
        """weight: a float matrix quantized into `fmt`, or a ReleasedMatrix kept as stored (GGUF blocks)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if isinstance(weight, ReleasedMatrix):
            stored = (tuple((kind, part.shape[0]) for kind, part in weight.parts),)
            self.matrix = QuantizedStack(fmt, (1, *weight.shape), stored=stored)
            self.matrix.set_released(0, *weight.parts)
            input_order = weight.input_order
        else:
            self.matrix = QuantizedStack(fmt, (1, *weight.shape))
            for first in range(0, weight.shape[0], QUANTISE_ROWS):
                self.matrix.set(0, weight[first:first + QUANTISE_ROWS].float(), first)
            input_order = None
        self.register_buffer("input_order", input_order)
        self.fmt = self.matrix.fmt
        # products of few rows, when the numba kernels load: step_kernels.DenseKernel, gguf_blocks.BlocksRows
        self.rows_kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows_kernel is not None and self.rows_kernel.takes(x):  # a GGUF one reorders the inputs itself
            return self.rows_kernel(x)
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        rows = self.matrix.matmul(0, x.reshape(-1, x.shape[-1]))
        return rows.to(x.dtype).reshape(*x.shape[:-1], rows.shape[-1])


def quantize_dense(text: nn.Module, fmt: str, release: Callable[[str], None]) -> None:
    """Swaps every dense Linear of `text` on the CPU that is_quantised_dense names for a QuantizedLinear in `fmt`
    (int8 or int4); `release(name)` is told each, whose checkpoint pages can then be dropped. A tied lm_head is
    the embedding table itself and stays as it is."""
    embedding = text.embed_tokens.weight
    for name, module in list(text.named_modules()):
        if not (isinstance(module, nn.Linear) and module.bias is None and module.weight.device.type == "cpu"
                and module.weight is not embedding and is_quantised_dense(f"{name}.weight", module.weight.shape)):
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(text.get_submodule(parent), leaf, QuantizedLinear(fmt, module.weight.data))
        release(name)
