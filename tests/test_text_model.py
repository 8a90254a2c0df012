"""The engine against the transformers oracle on tiny checkpoints in every supported layout."""
import time

import pytest
import torch

from a3b_core import load_model
from a3b_core.models import layers
from a3b_core.models.layers import FP16_LIMIT, rotary_cos_sin
from a3b_core.runtime.loader import resolve_compute_dtype

LAYOUTS = ["moe_hf", "moe_fused_bf16", "moe_fp8", "moe_text", "dense"]
TOL = 1e-4


@pytest.fixture(scope="module")
def models(fixtures):
    return {name: load_model(getattr(fixtures, name), preset="cpu", compute_dtype="float32") for name in LAYOUTS}


def logits_and_router_choices(model, ids: torch.Tensor, images=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The logits, and each MoE layer's top-k experts per token, read from its router's output by a forward hook
    (in fp32 the router is its own Linear, `mlp.gate`)."""
    chosen, hooks = [], []
    for layer in model.text.layers:
        if hasattr(layer.mlp, "experts"):
            k = model.config.text.num_experts_per_tok
            hooks.append(layer.mlp.gate.register_forward_hook(
                lambda _module, _inputs, out, k=k: chosen.append(out.float().topk(k, dim=-1).indices)))
    try:
        return model.logits(ids, images=images), chosen
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_text_logits_and_router_match_reference(fixtures, models, layout):
    model, refs = models[layout], fixtures.refs(getattr(fixtures, layout))
    ids = refs["text.input_ids"]
    assert ids.shape == (2, 80)  # a batch of 2, longer than one 64-token DeltaNet chunk
    logits, router_choices = logits_and_router_choices(model, ids)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, refs["text.logits"], atol=TOL, rtol=0)
    assert len(router_choices) == (4 if model.config.text.is_moe else 0)
    for i, chosen in enumerate(router_choices):
        assert torch.equal(chosen, refs[f"text.router_topk_L{i}"]), f"layer {i} router choices differ"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cached_steps_equal_one_full_forward(models, fixtures, layout):
    model = models[layout]
    ids = fixtures.refs(getattr(fixtures, layout))["text.input_ids"]
    full = model.logits(ids)
    cache = model.new_cache(batch=2, max_len=ids.shape[1])
    pieces = [model.forward(ids[:, :70], cache=cache)]
    pos = torch.arange(70, 80)
    for t in range(70, 80):
        step_pos = pos[t - 70].expand(3, 2, 1)
        pieces.append(model.forward(ids[:, t:t + 1], cache=cache, position_ids=step_pos))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=TOL, rtol=0)


@pytest.mark.parametrize("chunk", [16, 64])
def test_a_prompt_prefilled_in_chunks_equals_one_forward(models, fixtures, chunk):
    model = models["moe_fused_bf16"]
    refs = fixtures.refs(fixtures.moe_fused_bf16)
    ids = refs["text.input_ids"]
    cache = model.new_cache(batch=2, max_len=ids.shape[1])
    positions, _ = model.positions(ids, None)
    last = model.prefill(ids, None, cache, None, positions, chunk=chunk)
    torch.testing.assert_close(last, refs["text.logits"][:, -1], atol=TOL, rtol=0)


def test_attention_in_query_blocks_equals_one_call(models, fixtures, monkeypatch):
    """Masked attention goes in query blocks when their scores would pass ATTENTION_SCORES_BYTES: here one query
    per block, left padding included."""
    model = models["moe_fused_bf16"]
    ids = fixtures.refs(fixtures.moe_fused_bf16)["text.input_ids"]
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    whole = model.logits(ids, attention_mask=mask)
    monkeypatch.setattr(layers, "ATTENTION_SCORES_BYTES", 1)
    torch.testing.assert_close(model.logits(ids, attention_mask=mask), whole, atol=TOL, rtol=0)


def test_batch_rows_are_independent(models, fixtures):
    model = models["moe_fused_bf16"]
    ids = fixtures.refs(fixtures.moe_fused_bf16)["text.input_ids"]
    torch.testing.assert_close(model.logits(ids[1:]), model.logits(ids)[1:], atol=TOL, rtol=0)


def test_left_padded_row_matches_unpadded(models, fixtures):
    model = models["moe_fused_bf16"]
    ids = fixtures.refs(fixtures.moe_fused_bf16)["text.input_ids"]
    short = ids[1, :50]
    padded = torch.cat([torch.zeros(30, dtype=torch.long), short])[None]
    mask = torch.cat([torch.zeros(30), torch.ones(50)])[None].long()
    got = model.logits(padded, attention_mask=mask)[0, 30:]
    torch.testing.assert_close(got, model.logits(short[None])[0], atol=TOL, rtol=0)


def test_layouts_agree_on_the_same_weights(models, fixtures):
    ids = fixtures.refs(fixtures.moe_hf)["text.input_ids"]
    torch.testing.assert_close(models["moe_fused_bf16"].logits(ids), models["moe_hf"].logits(ids), atol=1e-5, rtol=0)
    torch.testing.assert_close(models["moe_text"].logits(ids), models["moe_hf"].logits(ids), atol=1e-5, rtol=0)


def test_bf16_compute_stays_close(fixtures):
    model = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="bfloat16")
    refs = fixtures.refs(fixtures.moe_fused_bf16)
    logits, ref = model.logits(refs["text.input_ids"]), refs["text.logits"]
    # bf16 rounding can flip a close router choice at a few tokens, so bound the typical error, not the worst, relative
    # to the logits' size: measured 0.067 of it on an AVX-512 host, with oneDNN's bf16 products and without them
    assert (logits - ref).abs().mean() < 0.08 * ref.abs().mean()


def test_load_time_and_weights_stay_mapped(fixtures):
    started = time.perf_counter()
    model = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="float32")
    assert model.load_stats.seconds <= time.perf_counter() - started
    assert model.load_stats.tensors > 0


def test_float16_compute_stays_close_and_finite(fixtures):
    """fp16, the compute dtype of GPUs without bf16: close to fp32, and a layer whose output would pass fp16's
    largest value (65504) is clamped below it instead of becoming inf."""
    model = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="float16")
    refs = fixtures.refs(fixtures.moe_fused_bf16)
    assert (model.logits(refs["text.input_ids"]) - refs["text.logits"]).abs().mean() < 0.03
    layer = model.text.layers[0]
    x = torch.full((1, 4, model.config.text.hidden_size), 65000.0, dtype=torch.float16)
    with torch.inference_mode():
        layer.linear_attn.out_proj.weight.mul_(1e4)  # its output now adds ~1,000s to the residual stream
        cos, sin = rotary_cos_sin(model.config.text, torch.zeros(3, 1, 4, dtype=torch.long))
        out = layer(x, cos, sin, None, None, None)
    assert torch.isfinite(out).all() and out.abs().max() <= FP16_LIMIT


def test_auto_compute_dtype_is_bf16_where_native_and_fp16_on_older_gpus(monkeypatch):
    assert resolve_compute_dtype("auto", torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, dtype in (((7, 5), torch.float16), ((6, 1), torch.float16), ((8, 0), torch.bfloat16),
                              ((9, 0), torch.bfloat16)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert resolve_compute_dtype("auto", torch.device("cuda", 0)) == dtype
    assert resolve_compute_dtype("float32", torch.device("cuda", 0)) == torch.float32
