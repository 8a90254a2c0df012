"""How products run where: the module swaps applied to a loaded model, so that the model files hold plain modules
named as in the checkpoint.

On the CPU (kernels/cpu_linear.py, kernels/onednn_packing.py, formats/): bf16 Linears and float experts of the
text model take torch's matrix-vector kernel for one or two rows, input projections that read the same input are
fused into one product, and the vision tower's bf16 matrices are packed for oneDNN. Where oneDNN has no bf16 kernels
(CPUs without AVX-512) bf16 products of more rows, the vision tower's included, are computed in fp32. With
dense_format int8 or int4 the text model's dense matrices are quantized first (formats/dense.py), and with gguf they
were kept in the file's blocks at load (models/checkpoint_layout.py); an owner whose input projections are then not
all bf16 Linears is not fused. Quantized expert stores and FP8 dense layers
(formats/stores.py, fp8.py) are built by the family's loader; int8, int4, FP8 and bf16 ones on the CPU compute a
decoding step's routed experts in one numba call per layer (formats/kernel_stores.py, kernels/cpu_numba.py) when
numba is there; with numba, a model whose compute dtype is not fp32 also decodes its int8, int4 and large bf16 dense
products and its Gated DeltaNet steps in numba calls, and a bf16 model its MoE blocks' steps and its norms
(step_kernels.py).
int4 matrices that no kernel computes are repacked for torch's int4 kernel.
glibc_heap.py keeps the C heap's freed memory for reuse while a generation runs, when asked. The constants tuned for
one CPU live in kernels/cpu_linear.py, formats/int8.py and step_kernels.py and say which CPU.
"""
from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..formats.dense import QuantizedLinear, quantize_dense
from ..formats.kernel_stores import swap_in_kernels
from ..kernels.arrays import plain_cpu
from ..formats.int4 import TorchInt4Stack
from ..formats.stores import CpuFloatExperts, QuantizedExperts
from ..formats.table import BF16, INT4, format_named
from ..kernels.cpu_linear import fuse_input_projections, use_cpu_linears
from ..kernels.onednn_packing import pack_cpu_linears, packing_available
from .step_kernels import attach_step_kernels


def is_float_experts(module: nn.Module) -> bool:
    """A family's float expert store: fused gate_up_proj / down_proj Parameters, as the BF16 releases name them."""
    return isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and not isinstance(module, CpuFloatExperts)


def prepare_cpu(text: nn.Module, vision: nn.Module | None, release_text: Callable[[str], None],
                release_vision: Callable[[str], None], dense_format: str = BF16) -> None:
    """The CPU's swaps on a placed model (modules on a GPU are left as they are). `release_*(name)` is told each
    swapped module whose checkpoint pages can be dropped. `dense_format` is the plan's: int8 / int4 quantizes the
    text model's dense matrices on the CPU (dense.py); a float format keeps them as loaded."""
    if format_named(dense_format).converted:
        quantize_dense(text, dense_format, release_text)
    fuse_input_projections(text, release_text)
    use_cpu_linears(text)
    for name, module in list(text.named_modules()):
        if is_float_experts(module) and module.gate_up_proj.device.type == "cpu":
            parent, _, leaf = name.rpartition(".")
            setattr(text.get_submodule(parent), leaf, CpuFloatExperts(module.gate_up_proj, module.down_proj))
    swap_in_kernels(text)
    attach_step_kernels(text)
    repack_int4_for_torch(text)
    if vision is not None and packing_available():
        pack_cpu_linears(vision, release_vision)
    elif vision is not None:  # no oneDNN bf16 kernels: the widened products of `linear`
        use_cpu_linears(vision)


def repack_int4_for_torch(text: nn.Module) -> None:
    """Gives the int4 matrices of `text` that no numba kernel computes (numba missing or off, an fp32 model's dense
    matrices) torch's int4 packing, whose kernel is faster than dequantizing each product."""
    for module in list(text.modules()):
        if isinstance(module, QuantizedExperts) and module.fmt == INT4 and plain_cpu(*module.buffers()):
            module.gate_up_proj = TorchInt4Stack(module.gate_up_proj)
            module.down_proj = TorchInt4Stack(module.down_proj)
        elif isinstance(module, QuantizedLinear) and module.fmt == INT4 and module.rows_kernel is None \
                and plain_cpu(*module.buffers()):
            module.matrix = TorchInt4Stack(module.matrix)
