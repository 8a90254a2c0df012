"""Expert offload on a real CUDA GPU: routed experts in RAM computed by the CPU (8gb), all on the GPU (48gb) and all
on the CPU (cpu) give the same logits and greedy tokens, in the BF16 and FP8 layouts, with and without a LoRA adapter
on every kind of weight, and the weights sit where the plan puts them. Skipped without CUDA: CI runs the same paths on a stand-in GPU (test_gpu_path.py); this and
bench/gpu_check.py are the real-GPU checks (bench/gpu_checks.sh runs both)."""
import json

import pytest
import torch

from a3b_core import load_model
from tests.synthetic_adapters import qwen3_5_adapter
from tests.test_gpu_path import assert_placed_as_planned

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("layout", ["moe_fused_bf16", "moe_fp8"])
def test_offloaded_and_resident_experts_give_the_single_device_logits(fixtures, layout):
    folder = getattr(fixtures, layout)
    ids = fixtures.refs(folder)["text.input_ids"]
    models = {preset: load_model(folder, preset=preset, compute_dtype="float32") for preset in ("cpu", "8gb", "48gb")}
    offloaded, resident = models["8gb"].plan, models["48gb"].plan
    assert offloaded.dense_device == "cuda" and offloaded.gpu_expert_layers == ()
    assert len(resident.gpu_expert_layers) == len(models["cpu"].text.layers)
    for preset in ("8gb", "48gb"):
        assert_placed_as_planned(models[preset])
    reference = models["cpu"].logits(ids)
    for preset in ("8gb", "48gb"):  # fp32 on both devices: equal up to the order of additions
        torch.testing.assert_close(models[preset].logits(ids).cpu(), reference, atol=1e-4, rtol=0)
    tokens = {p: m.generate(ids[0], max_new_tokens=12, temperature=0).token_ids for p, m in models.items()}
    assert tokens["8gb"] == tokens["48gb"] == tokens["cpu"]


def test_a_long_prompt_prefills_in_chunks_on_the_gpu(fixtures):
    model = load_model(fixtures.moe_fused_bf16, preset="8gb", compute_dtype="float32")
    ids = torch.arange(600) % 500
    cache = model.new_cache(1, 640)
    positions, _ = model.positions(ids[None], None)
    chunked = model.prefill(ids[None], None, cache, None, positions, chunk=64)
    whole = model.logits(ids[None])[:, -1]
    torch.testing.assert_close(chunked.cpu(), whole.cpu(), atol=1e-4, rtol=0)


def test_an_adapter_gives_the_same_logits_on_every_placement(fixtures, tmp_path):
    """The side paths compute where their modules are: on the GPU for dense parts and resident experts, on the CPU
    for experts in RAM, with the CPU-only model's logits."""
    folder = fixtures.moe_fused_bf16
    lora = qwen3_5_adapter(tmp_path / "lora", json.loads((folder / "config.json").read_text()))
    ids = fixtures.refs(folder)["text.input_ids"]
    models = {preset: load_model(folder, preset=preset, compute_dtype="float32", loras=[(lora, 0.8)])
              for preset in ("cpu", "8gb", "48gb")}
    reference = models["cpu"].logits(ids)
    for preset in ("8gb", "48gb"):
        torch.testing.assert_close(models[preset].logits(ids).cpu(), reference, atol=1e-4, rtol=0)
        models[preset].set_loras([])
        models[preset].set_loras([(lora, 0.8)])
        torch.testing.assert_close(models[preset].logits(ids).cpu(), reference, atol=1e-4, rtol=0)
