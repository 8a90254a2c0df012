"""Expert offload on a CUDA machine: routed experts in RAM computed by the CPU (8gb), all on the GPU (48gb) and all
on the CPU (cpu) give the same logits and greedy tokens. Skipped without CUDA (CI has none; bench/gpu_check.py is
the full-size check)."""
import pytest
import torch

from a3b_core import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_offloaded_and_resident_experts_give_the_single_device_logits(fixtures):
    ids = fixtures.refs(fixtures.moe_fused_bf16)["text.input_ids"]
    models = {preset: load_model(fixtures.moe_fused_bf16, preset=preset, compute_dtype="float32")
              for preset in ("cpu", "8gb", "48gb")}
    offloaded, resident = models["8gb"].plan, models["48gb"].plan
    assert offloaded.dense_device == "cuda" and offloaded.gpu_expert_layers == ()
    assert len(resident.gpu_expert_layers) == len(models["cpu"].text.layers)
    reference = models["cpu"].logits(ids)
    for preset in ("8gb", "48gb"):  # fp32 on both devices: equal up to the order of additions
        torch.testing.assert_close(models[preset].logits(ids).cpu(), reference, atol=1e-4, rtol=0)
    tokens = {p: m.generate(ids[0], max_new_tokens=12, temperature=0).token_ids for p, m in models.items()}
    assert tokens["8gb"] == tokens["48gb"] == tokens["cpu"]
