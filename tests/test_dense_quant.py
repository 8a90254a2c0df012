"""dense_format int8 / int4: the text model's dense matrices on the CPU held weight-only quantized (formats/dense.py):
which modules are swapped, their bytes, their error against the fp32 model, the plan, and the GPU refusal."""
import pytest
import torch
from torch import nn

from a3b_core import load_model
from a3b_core.errors import PlacementError
from a3b_core.formats.dense import QuantizedLinear
from a3b_core.kernels.cpu_linear import FusedLinear
from a3b_core.runtime.placement import plan_for_folder
from tests.fake_cuda import FakeCuda
from tests.test_bad_inputs import FIX

QUANTISED_LEAVES = {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj",
                    "up_proj", "down_proj", "lm_head"}
FLOAT_LEAVES = {"gate", "shared_expert_gate", "in_proj_a", "in_proj_b"}  # routers, gates: kept in the compute dtype

# Stated bounds against the fp32 model (tiny random checkpoints, logits' spread max - min ~3.4 per token): the mean
# |logit error| and the worst logit. Measured on the MoE (bf16 release / FP8 release) and the dense model:
# int8 mean 0.053 / 0.036 / 0.019, max 1.49 / 1.13 / 0.16; int4 mean 0.37 / 0.37 / 0.25, max 2.49 / 2.67 / 1.92.
# The MoE's worst logit is a flipped router choice moving a whole row (as with quantized experts, test_experts.py);
# the dense model has no router, so its worst logit is bounded tighter.
LOGIT_BOUNDS = {"int8": (0.1, 2.5), "int4": (0.6, 4.0)}
DENSE_MODEL_MAX = {"int8": 0.4, "int4": 3.0}
BYTES_VS_BF16 = {"int8": (0.49, 0.52), "int4": (0.25, 0.29)}


def swapped(model) -> dict[str, QuantizedLinear]:
    return {name: m for name, m in model.text.named_modules() if isinstance(m, QuantizedLinear)}


@pytest.mark.parametrize("folder", ["moe_fused_bf16", "moe_fp8", "dense"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_dense_quantised_logits_stay_within_bounds(fixtures, one_thread, folder, fmt):
    folder = getattr(fixtures, folder)
    ids = fixtures.refs(folder)["text.input_ids"]
    reference = load_model(folder, preset="cpu", compute_dtype="float32").logits(ids)
    err = (load_model(folder, preset="cpu", compute_dtype="float32", dense_format=fmt).logits(ids) - reference).abs()
    mean_bound, max_bound = LOGIT_BOUNDS[fmt]
    max_bound = DENSE_MODEL_MAX[fmt] if folder == fixtures.dense else max_bound
    assert err.mean() < mean_bound and err.max() < max_bound
    assert err.max() > 0  # the option changes the numbers: the matrices really are quantized


def test_dense_int8_greedy_tokens_are_the_references_or_near_ties(fixtures, one_thread):
    """On the MoE, each greedy token with dense int8 is the fp32 model's choice at that point, or within 0.2 of its
    logit (measured: the 8th of 12 tokens is a near tie, 0.15 apart under fp32, that int8 flips)."""
    folder = fixtures.moe_fused_bf16
    ids = fixtures.refs(folder)["text.input_ids"][0]
    reference = load_model(folder, preset="cpu", compute_dtype="float32")
    int8 = load_model(folder, preset="cpu", compute_dtype="bfloat16", weight_format="bf16", dense_format="int8")
    tokens = int8.generate(ids, max_new_tokens=12, temperature=0).token_ids
    logits = reference.logits(torch.cat([ids, torch.tensor(tokens)])[None])[0, len(ids) - 1:-1]
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (logits.max(dim=1).values - chosen).max() < 0.2


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_exactly_the_dense_matrices_are_swapped(fixtures, one_thread, fmt):
    model = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="bfloat16", dense_format=fmt)
    layers = model.config.text.layer_types
    want = {"lm_head"}
    for i, kind in enumerate(layers):
        mixer = [f"layers.{i}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")] \
            if kind == "full_attention" else [f"layers.{i}.linear_attn.{p}" for p in ("in_proj_qkv", "in_proj_z",
                                                                                      "out_proj")]
        want |= {*mixer, *(f"layers.{i}.mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj"))}
    quantized = swapped(model)
    assert set(quantized) == want
    assert all(m.fmt == fmt for m in quantized.values())
    for name, module in model.text.named_modules():
        if name.rpartition(".")[2] in FLOAT_LEAVES:  # routers and gates: plain Linears in the compute dtype
            assert not isinstance(module, QuantizedLinear) and module.weight.dtype == torch.bfloat16, name
    assert isinstance(model.text.embed_tokens, nn.Embedding) and model.text.embed_tokens.weight.dtype == torch.bfloat16
    assert not any(isinstance(m, QuantizedLinear) for m in model.vision.modules())


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantised_dense_bytes_relative_to_bf16(fixtures, one_thread, fmt):
    model = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="bfloat16", dense_format=fmt)
    for name, module in swapped(model).items():
        held = sum(b.numel() * b.element_size() for b in module.buffers())
        out, inp = module.matrix.shape[1:]
        low, high = BYTES_VS_BF16[fmt]
        assert low <= held / (out * inp * 2) <= high, name


def test_auto_keeps_the_dense_parts_as_loaded(fixtures, one_thread):
    default = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="bfloat16")
    auto = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="bfloat16", dense_format="auto")
    assert not swapped(auto)
    assert {n: type(m) for n, m in auto.text.named_modules()} == {n: type(m) for n, m in default.text.named_modules()}
    assert any(isinstance(m, FusedLinear) for m in auto.text.modules())  # bf16 input projections are fused as before
    assert auto.plan.dense_format == "bf16" and auto.plan.parts == default.plan.parts


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_plan_counts_dense_parts_at_their_quantised_size(fixtures, fmt):
    auto = plan_for_folder(fixtures.moe_fused_bf16, "cpu", compute_format="bf16")
    quantized = plan_for_folder(fixtures.moe_fused_bf16, "cpu", compute_format="bf16", dense_format=fmt)
    assert f"dense {fmt} on cpu" in quantized.summary()
    sizes = {p.name: p for p in auto.parts}
    low, high = BYTES_VS_BF16[fmt]
    for name in ("lm_head", "mixers", "shared_experts"):
        part = next(p for p in quantized.parts if p.name == name)
        assert part.format == fmt and low <= part.bytes / sizes[name].bytes <= high + 0.03, name  # + fp32 vectors
    for name in ("routers", "embed_tokens", "norms", "vision"):  # not quantized: as in the auto plan
        assert next(p for p in quantized.parts if p.name == name) == sizes[name]


def test_loaded_quantised_bytes_match_the_plan(fixtures, one_thread):
    """The plan's lm_head part is the bytes the loaded int8 lm_head holds (within its scale estimate)."""
    model = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="bfloat16", dense_format="int8")
    held = sum(b.numel() * b.element_size() for b in model.text.lm_head.buffers())
    planned = next(p for p in model.plan.parts if p.name == "lm_head").bytes
    assert abs(held - planned) <= 0.01 * planned


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_dense_format_on_a_gpu_is_refused(fixtures, fmt):
    with FakeCuda(), pytest.raises(PlacementError) as info:
        load_model(fixtures.moe_fused_bf16, preset="8gb", device="cuda", dense_format=fmt)
    message = str(info.value)
    assert f"dense_format '{fmt}'" in message and "dense parts computed by the CPU" in message
    assert "dense_format auto" in message and "preset cpu" in message and FIX.search(message)


def test_dense_format_on_a_cpu_device_with_a_gpu_preset_is_planned_for_the_cpu(fixtures, one_thread):
    model = load_model(fixtures.dense, preset="8gb", device="cpu", dense_format="int8")
    assert model.plan.dense_device == "cpu" and model.plan.dense_format == "int8" and swapped(model)
