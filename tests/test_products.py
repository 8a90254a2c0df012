"""CPU products: one-row bf16 products as matrix-vector products (fp32 sums), fused input projections, and the
vision tower's oneDNN-packed matrices (the same products as torch's plain bf16 path, to the bit)."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from a3b_core import load_model
from a3b_core.formats.kernel_stores import KernelExperts, kernels_enabled
from a3b_core.formats.stores import CpuFloatExperts
from a3b_core.kernels import cpu_linear as products
from a3b_core.kernels.cpu_linear import CpuLinear, FusedLinear, linear
from a3b_core.kernels.onednn_packing import PackedLinear, packing_available
from a3b_core.release.safetensors import Checkpoint
from a3b_core.runtime import cpu_swaps
from tests.tiny_qwen3_vl import build_qwen3_vl_fixtures


def bf16_rounded_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.double(), w.double()).bfloat16()


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_products_are_fp32_sums_rounded_once(rows):
    torch.manual_seed(0)
    w = (torch.randn(384, 1024) * 0.05).bfloat16()
    x = torch.randn(rows, 1024).bfloat16()
    # within one bf16 step of the exact product: sums in fp32, rounded to bf16 once
    torch.testing.assert_close(linear(x, w).float(), bf16_rounded_reference(x, w).float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("native", [True, False])
def test_a_cpu_without_bf16_matrix_kernels_multiplies_in_fp32(native, monkeypatch):
    """Where oneDNN has no bf16 kernels (CPUs without AVX-512), products of more rows than the matrix-vector kernel
    takes widen to fp32, the weights a block of rows at a time (a small block here, so the blocks are joined), and
    round once: the result is the fp32 product rounded to bf16, the bias added before the rounding."""
    monkeypatch.setattr(products, "bf16_matmul_is_native", lambda: native)
    monkeypatch.setattr(products, "WIDENED_ROWS", 100)
    torch.manual_seed(0)
    w, bias = (torch.randn(384, 256) * 0.05).bfloat16(), torch.randn(384).bfloat16()
    x = torch.randn(2, 5, 256).bfloat16()
    got = linear(x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 5, 384)
    want = (F.linear(x.double(), w.double()) + bias.double()).bfloat16()
    if native:  # oneDNN's own bf16 product: within one bf16 step
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
    else:
        assert torch.equal(got, (F.linear(x.float(), w.float()) + bias.float()).bfloat16())
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


def test_vision_linears_take_the_widened_products_where_nothing_packs(fixtures, monkeypatch):
    monkeypatch.setattr(cpu_swaps, "packing_available", lambda: False)
    model = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="bfloat16", weight_format="bf16")
    linears = [m for m in model.vision.modules() if isinstance(m, (torch.nn.Linear, PackedLinear, CpuLinear))]
    assert linears and all(isinstance(m, CpuLinear) for m in linears)
    assert any(m.bias is not None for m in linears)


def test_one_row_product_leaves_onednn_switched_on():
    w, x = torch.randn(64, 32).bfloat16(), torch.randn(1, 1, 32).bfloat16()
    before = torch.backends.mkldnn.enabled
    linear(x, w)
    assert torch.backends.mkldnn.enabled == before


@pytest.mark.parametrize("tokens", [1, 6])
def test_fused_projections_equal_each_product(tokens):
    torch.manual_seed(0)
    weights = [(torch.randn(rows, 256) * 0.05).bfloat16() for rows in (384, 128, 4, 1)]
    x = torch.randn(1, tokens, 256).bfloat16()
    parts = FusedLinear(weights)(x)
    assert all(torch.equal(part, linear(x, w)) for part, w in zip(parts, weights, strict=True))


@pytest.mark.skipif(not packing_available(), reason="this torch build cannot pack bf16 for oneDNN")
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(7, 256), (2, 5, 256)])
def test_packed_linear_equals_plain_bf16(shape, with_bias):
    torch.manual_seed(0)
    w = (torch.randn(384, 256) * 0.05).bfloat16()
    bias = torch.randn(384) if with_bias else None  # kept fp32 like a loaded vector; added in bf16
    x = torch.randn(shape).bfloat16()
    assert torch.equal(PackedLinear(w, bias)(x), F.linear(x, w, None if bias is None else bias.bfloat16()))


def cpu_float_experts(text: torch.nn.Module) -> list[torch.nn.Module]:
    """The text model's bf16 expert stores on the CPU: as CpuFloatExperts, or as the numba kernel's swap of them
    (each then read through `gate_up_proj.q` / `down_proj.q`, the same tensors)."""
    stores = [m for m in text.modules() if isinstance(m, CpuFloatExperts)]
    kernels = [SimpleNamespace(gate_up_proj=m.gate_up_proj.q, down_proj=m.down_proj.q) for m in text.modules()
               if isinstance(m, KernelExperts) and m.fmt == "bf16"]
    assert not (stores and kernels) and bool(kernels) == kernels_enabled()
    return stores + kernels


def test_bf16_cpu_load_fuses_projections_packs_vision_and_fp32_neither(fixtures):
    model = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="bfloat16", weight_format="bf16")
    text = model.text
    owners = [m for m in text.modules() if hasattr(m, "input_projections")]
    assert len(owners) == 2 * len(text.layers)  # each layer's mixer and MoE
    assert all(isinstance(m.fused_projection, FusedLinear) for m in owners)
    assert len(cpu_float_experts(text)) == len(text.layers)
    assert not any(isinstance(m, torch.nn.Linear) for m in text.modules())  # each took the matrix-vector route
    if packing_available():
        assert not any(isinstance(m, torch.nn.Linear) for m in model.vision.modules())
    fp32 = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="float32")
    assert not any(isinstance(m, (PackedLinear, FusedLinear)) for m in [*fp32.text.modules(), *fp32.vision.modules()])


def test_the_qwen3_vl_decoder_takes_the_same_cpu_swaps_on_contiguous_experts():
    """Qwen3-VL's BF16 release stores the fused experts transposed: loaded in bf16 they are laid out as the model
    reads them (a transposed view would make every expert product a strided one), the decoder gets the same swaps as
    Qwen3.5's, and its logits equal those of the same weights in the plain modules."""
    vl = build_qwen3_vl_fixtures()
    model = load_model(vl.moe_bf16, preset="cpu", compute_dtype="bfloat16", weight_format="bf16")
    text = model.text
    owners = [m for m in text.modules() if hasattr(m, "input_projections")]
    assert len(owners) == 2 * len(text.layers)  # each layer's attention and MoE
    assert all(isinstance(m.fused_projection, FusedLinear) for m in owners)
    experts = cpu_float_experts(text)
    assert len(experts) == len(text.layers)
    assert all(tensor.is_contiguous() for e in experts for tensor in (e.gate_up_proj, e.down_proj))
    assert not any(isinstance(m, torch.nn.Linear) for m in text.modules())

    with torch.device("meta"):
        plain = model.family.text_model(model.config.text)
    model.family.load_text(plain, model.config.text, Checkpoint(vl.moe_bf16), torch.bfloat16)
    ids = vl.refs(vl.moe_bf16)["text.input_ids"][:1]
    positions = torch.arange(ids.shape[1]).expand(3, 1, -1)
    with torch.inference_mode():
        swapped = text(text.embed_tokens(ids), positions)
        reference = plain(plain.embed_tokens(ids), positions)
        one_row = [text(text.embed_tokens(ids[:, :1]), positions[..., :1]),
                   plain(plain.embed_tokens(ids[:, :1]), positions[..., :1])]
    if products.bf16_matmul_is_native():
        assert torch.equal(swapped, reference)
    else:  # the swapped model's products of many rows are widened to fp32 and rounded once, torch's plain ones not
        torch.testing.assert_close(swapped, reference, atol=0.05, rtol=0.02)
    torch.testing.assert_close(*one_row, atol=0.05, rtol=0.02)  # the matrix-vector kernel sums in another order
