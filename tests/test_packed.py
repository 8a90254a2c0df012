"""oneDNN-packed bf16 weights: the same products as torch's plain bf16 path, to the bit, and used by bf16 loads."""
import pytest
import torch
import torch.nn.functional as F

from a3b_core import load_model
from a3b_core.experts import FloatExperts
from a3b_core.packed import FusedPackedLinear, PackedExperts, PackedLinear, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build cannot pack bf16 for oneDNN")


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 256), (7, 256), (2, 5, 256)])
def test_packed_linear_equals_plain_bf16(shape, with_bias):
    torch.manual_seed(0)
    w = (torch.randn(384, 256) * 0.05).bfloat16()
    bias = torch.randn(384) if with_bias else None  # kept fp32 like a loaded vector; added in bf16
    x = torch.randn(shape).bfloat16()
    assert torch.equal(PackedLinear(w, bias)(x), F.linear(x, w, None if bias is None else bias.bfloat16()))


@pytest.mark.parametrize("tokens", [1, 6])
def test_fused_projections_equal_each_plain_product(tokens):
    torch.manual_seed(0)
    weights = [(torch.randn(rows, 256) * 0.05).bfloat16() for rows in (384, 128, 4, 1)]
    x = torch.randn(1, tokens, 256).bfloat16()
    parts = FusedPackedLinear(weights)(x)
    assert all(torch.equal(part, F.linear(x, w)) for part, w in zip(parts, weights, strict=True))


@pytest.mark.parametrize("tokens", [1, 9])
def test_packed_experts_equal_plain_bf16(tokens):
    torch.manual_seed(0)
    experts = FloatExperts(4, 256, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.05)
        experts.down_proj.normal_(0, 0.05)
    packed = PackedExperts(experts)
    x, act = torch.randn(tokens, 256).bfloat16(), torch.randn(tokens, 128).bfloat16()
    for e in range(4):
        assert torch.equal(packed.gate_up(e, x), experts.gate_up(e, x))
        assert torch.equal(packed.down(e, act), experts.down(e, act))


def test_bf16_cpu_load_packs_every_matrix_and_fp32_none(fixtures):
    model = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="bfloat16", weight_format="bf16")
    bf16 = model.text
    assert not any(isinstance(m, (torch.nn.Linear, FloatExperts)) for m in [*bf16.modules(), *model.vision.modules()])
    assert sum(isinstance(m, PackedExperts) for m in bf16.modules()) == len(bf16.layers)
    owners = [m for m in bf16.modules() if hasattr(m, "input_projections")]
    assert len(owners) == 2 * len(bf16.layers)  # each layer's mixer and MoE
    assert all(isinstance(m.fused_projection, FusedPackedLinear) for m in owners)
    fp32 = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="float32").text
    assert not any(isinstance(m, (PackedLinear, PackedExperts)) for m in fp32.modules())
