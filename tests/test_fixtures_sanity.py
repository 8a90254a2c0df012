"""Checks of the fixture builder itself: the release layouts, the FP8 quantization and the reference outputs."""
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.tiny_models import (FP8_BLOCK, IMAGE_PAD, MOE_DIMS, TEXT_DIMS, VISION_DIMS, Fixtures, dequantise_fp8)

ATOL = 2e-5  # the oracle against itself: only thread-count-dependent summation order differs
EXPERT_NAME = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.(?P<index>\d+)\.(?P<part>gate|up|down)_proj\.weight$")


def _folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(file)
    return tensors


def _release_shapes() -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of the official BF16 release, for the tiny dimensions."""
    hidden, vocab = TEXT_DIMS["hidden_size"], TEXT_DIMS["vocab_size"]
    heads, kv_heads, head_dim = TEXT_DIMS["num_attention_heads"], TEXT_DIMS["num_key_value_heads"], TEXT_DIMS["head_dim"]
    key_dim = TEXT_DIMS["linear_num_key_heads"] * TEXT_DIMS["linear_key_head_dim"]
    value_heads = TEXT_DIMS["linear_num_value_heads"]
    value_dim = value_heads * TEXT_DIMS["linear_value_head_dim"]
    experts, inter, shared = MOE_DIMS["num_experts"], MOE_DIMS["moe_intermediate_size"], \
        MOE_DIMS["shared_expert_intermediate_size"]
    lm = "model.language_model"
    shapes = {"lm_head.weight": (vocab, hidden), f"{lm}.embed_tokens.weight": (vocab, hidden),
              f"{lm}.norm.weight": (hidden,)}
    for i, kind in enumerate(TEXT_DIMS["layer_types"]):
        layer = f"{lm}.layers.{i}"
        shapes |= {f"{layer}.input_layernorm.weight": (hidden,), f"{layer}.post_attention_layernorm.weight": (hidden,),
                   f"{layer}.mlp.gate.weight": (experts, hidden),
                   f"{layer}.mlp.experts.gate_up_proj": (experts, 2 * inter, hidden),
                   f"{layer}.mlp.experts.down_proj": (experts, hidden, inter),
                   f"{layer}.mlp.shared_expert.gate_proj.weight": (shared, hidden),
                   f"{layer}.mlp.shared_expert.up_proj.weight": (shared, hidden),
                   f"{layer}.mlp.shared_expert.down_proj.weight": (hidden, shared),
                   f"{layer}.mlp.shared_expert_gate.weight": (1, hidden)}
        if kind == "linear_attention":
            attn = f"{layer}.linear_attn"
            shapes |= {f"{attn}.in_proj_qkv.weight": (2 * key_dim + value_dim, hidden),
                       f"{attn}.in_proj_z.weight": (value_dim, hidden), f"{attn}.in_proj_b.weight": (value_heads, hidden),
                       f"{attn}.in_proj_a.weight": (value_heads, hidden),
                       f"{attn}.conv1d.weight": (2 * key_dim + value_dim, 1, TEXT_DIMS["linear_conv_kernel_dim"]),
                       f"{attn}.dt_bias": (value_heads,), f"{attn}.A_log": (value_heads,),
                       f"{attn}.norm.weight": (TEXT_DIMS["linear_value_head_dim"],),
                       f"{attn}.out_proj.weight": (hidden, value_dim)}
        else:
            attn = f"{layer}.self_attn"
            shapes |= {f"{attn}.q_proj.weight": (2 * heads * head_dim, hidden),
                       f"{attn}.k_proj.weight": (kv_heads * head_dim, hidden),
                       f"{attn}.v_proj.weight": (kv_heads * head_dim, hidden),
                       f"{attn}.o_proj.weight": (hidden, heads * head_dim),
                       f"{attn}.q_norm.weight": (head_dim,), f"{attn}.k_norm.weight": (head_dim,)}
    width, mlp, patch = VISION_DIMS["hidden_size"], VISION_DIMS["intermediate_size"], VISION_DIMS["patch_size"]
    merged = width * VISION_DIMS["spatial_merge_size"] ** 2
    vis = "model.visual"
    shapes |= {f"{vis}.patch_embed.proj.weight": (width, 3, VISION_DIMS["temporal_patch_size"], patch, patch),
               f"{vis}.patch_embed.proj.bias": (width,),
               f"{vis}.pos_embed.weight": (VISION_DIMS["num_position_embeddings"], width),
               f"{vis}.merger.norm.weight": (width,), f"{vis}.merger.norm.bias": (width,),
               f"{vis}.merger.linear_fc1.weight": (merged, merged), f"{vis}.merger.linear_fc1.bias": (merged,),
               f"{vis}.merger.linear_fc2.weight": (VISION_DIMS["out_hidden_size"], merged),
               f"{vis}.merger.linear_fc2.bias": (VISION_DIMS["out_hidden_size"],)}
    for b in range(VISION_DIMS["depth"]):
        block = f"{vis}.blocks.{b}"
        for norm in ("norm1", "norm2"):
            shapes |= {f"{block}.{norm}.weight": (width,), f"{block}.{norm}.bias": (width,)}
        for name, (out, inp) in {"attn.qkv": (3 * width, width), "attn.proj": (width, width),
                                 "mlp.linear_fc1": (mlp, width), "mlp.linear_fc2": (width, mlp)}.items():
            shapes |= {f"{block}.{name}.weight": (out, inp), f"{block}.{name}.bias": (out,)}
    return shapes


def _vl_model(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText
    return AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()


def _moe_model_loaded_by_name(folder: Path) -> torch.nn.Module:
    """A fresh transformers model with the folder's tensors copied in by name (its in-memory names are the release's)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    config = Qwen3_5MoeConfig.from_dict(json.loads((folder / "config.json").read_text()))
    config._attn_implementation = "eager"
    model = Qwen3_5MoeForConditionalGeneration(config).float().eval()
    model.load_state_dict({name: value.float() for name, value in _folder_tensors(folder).items()}, strict=True)
    return model


def _logits(model: torch.nn.Module, refs: dict[str, torch.Tensor], group: str) -> torch.Tensor:
    inputs = {k.split(".", 1)[1]: v for k, v in refs.items()
              if k.startswith(group + ".") and k.split(".", 1)[1] in ("input_ids", "pixel_values", "image_grid_thw")}
    if "pixel_values" in inputs:
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == IMAGE_PAD).int()
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


@pytest.fixture(scope="module")
def moe_hf_model(fixtures: Fixtures) -> torch.nn.Module:
    return _vl_model(fixtures.moe_hf)


def test_fused_bf16_folder_has_the_release_names_shapes_dtypes_and_shards(fixtures: Fixtures):
    folder = fixtures.moe_fused_bf16
    shard_names = [f"model.safetensors-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(p.name for p in folder.glob("*.safetensors")) == shard_names
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == shard_names
    for shard in shard_names:
        with safe_open(folder / shard, "pt") as f:
            assert sorted(f.keys()) == sorted(k for k, v in weight_map.items() if v == shard)
    tensors = _folder_tensors(folder)
    assert {name: tuple(t.shape) for name, t in tensors.items()} == _release_shapes()
    fp32 = {name for name, t in tensors.items() if t.dtype == torch.float32}
    assert fp32 == {name for name in tensors if name.endswith(("linear_attn.A_log", "linear_attn.norm.weight"))}
    assert all(t.dtype == torch.bfloat16 for name, t in tensors.items() if name not in fp32)


def test_bf16_folder_is_a_lossless_copy_of_the_transformers_save(fixtures: Fixtures, moe_hf_model):
    fused = _folder_tensors(fixtures.moe_fused_bf16)
    for name, param in moe_hf_model.state_dict().items():
        assert torch.equal(fused[name].float(), param), name
    norm = fused["model.language_model.layers.0.input_layernorm.weight"].float()
    assert norm.abs().mean() > 0.02  # the N(0, 0.1) noise on 1-D parameters is there


def test_fp8_folder_quantises_exactly_the_release_matrices(fixtures: Fixtures):
    tensors = _folder_tensors(fixtures.moe_fp8)
    bf16 = _folder_tensors(fixtures.moe_fused_bf16)
    scales = {name.removesuffix("_scale_inv"): t for name, t in tensors.items() if name.endswith(".weight_scale_inv")}
    experts = MOE_DIMS["num_experts"]
    layers = TEXT_DIMS["layer_types"]
    expected_other = 3 * layers.count("linear_attention") + 4 * layers.count("full_attention") + 3 * len(layers)
    assert len(scales) == 3 * experts * len(layers) + expected_other
    for name, scale in scales.items():
        weight = tensors[name]
        assert weight.dtype == torch.float8_e4m3fn, name
        assert scale.shape == tuple(math.ceil(n / FP8_BLOCK) for n in weight.shape), name
        assert scale.dtype == (torch.bfloat16 if ".experts." in name else torch.float32), name
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in tensors)
    for name, value in tensors.items():
        if name in bf16 and name not in scales:
            assert torch.equal(value, bf16[name]), name  # everything unquantized is the bf16 release, bit for bit
    quant = json.loads((fixtures.moe_fp8 / "config.json").read_text())["quantization_config"]
    assert (quant["quant_method"], quant["fmt"], quant["activation_scheme"], quant["weight_block_size"]) == \
        ("fp8", "e4m3", "dynamic", [128, 128])


def test_fp8_dequantisation_stays_within_e4m3_rounding_of_the_bf16_weights(fixtures: Fixtures):
    tensors = _folder_tensors(fixtures.moe_fp8)
    bf16 = _folder_tensors(fixtures.moe_fused_bf16)
    inter = MOE_DIMS["moe_intermediate_size"]
    for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
        weight_name = name.removesuffix("_scale_inv")
        restored = dequantise_fp8(tensors[weight_name], tensors[name])
        expert = EXPERT_NAME.match(weight_name)
        if expert is None:
            original = bf16[weight_name].float()
        elif expert["part"] == "down":
            original = bf16[f"{expert['prefix']}.down_proj"][int(expert["index"])].float()
        else:
            gate_up = bf16[f"{expert['prefix']}.gate_up_proj"][int(expert["index"])].float()
            original = gate_up[:inter] if expert["part"] == "gate" else gate_up[inter:]
        step = dequantise_fp8(torch.ones_like(tensors[weight_name], dtype=torch.float32), tensors[name])
        # e4m3 keeps 3 mantissa bits (relative error <= 1/16); subnormals have a fixed step of 2^-9 (half: 2^-10).
        bound = original.abs() / 16 + step * 2.0 ** -10
        assert ((restored - original).abs() <= bound * 1.0001).all(), weight_name
        assert (restored - original).abs().max() > 0, weight_name  # the quantization really changed something


def test_bf16_folder_loaded_by_name_reproduces_the_references(fixtures: Fixtures):
    model = _moe_model_loaded_by_name(fixtures.moe_fused_bf16)
    refs = fixtures.refs(fixtures.moe_fused_bf16)
    torch.testing.assert_close(_logits(model, refs, "text"), refs["text.logits"], atol=ATOL, rtol=0)


def test_moe_hf_reload_reproduces_text_and_image_logits(fixtures: Fixtures, moe_hf_model):
    refs = fixtures.refs(fixtures.moe_hf)
    for group in ("text", "image_b"):
        torch.testing.assert_close(_logits(moe_hf_model, refs, group), refs[f"{group}.logits"], atol=ATOL, rtol=0)
    assert refs["text.router_topk_L0"].shape == (160, 2)
    assert not torch.equal(refs["text.input_ids"][0], refs["text.input_ids"][1])
    assert int(refs["text.input_ids"].max()) < 503


def test_image_groups_have_the_spec_grids_and_token_counts(fixtures: Fixtures):
    refs = fixtures.refs(fixtures.moe_hf)
    expected = {"image_a": ([[1, 24, 24]], 144), "image_b": ([[1, 14, 20]], 70),
                "image_ab": ([[1, 24, 24], [1, 14, 20]], 214)}
    for group, (grids, tokens) in expected.items():
        ids = refs[f"{group}.input_ids"]
        assert refs[f"{group}.image_grid_thw"].tolist() == grids
        assert int((ids == IMAGE_PAD).sum()) == tokens == refs[f"{group}.image_embeds"].shape[0]
        assert refs[f"{group}.pixel_values"].shape == (sum(h * w for _, h, w in grids), 1536)
        positions = refs[f"{group}.position_ids"]
        assert positions.shape == (3, 1, ids.shape[1])
        assert int(refs[f"{group}.rope_deltas"]) == int(positions.max()) + 1 - ids.shape[1]


@pytest.mark.parametrize("group", ["gen_text", "gen_image"])
def test_greedy_generation_agrees_with_a_full_forward_pass(fixtures: Fixtures, moe_hf_model, group: str):
    refs = fixtures.refs(fixtures.moe_hf)
    prompt, generated = refs[f"{group}.prompt_ids"], refs[f"{group}.output_ids"]
    assert generated.shape == (1, 32)
    inputs = {"input_ids": torch.cat([prompt, generated[:, :-1]], dim=1)}
    if group == "gen_image":
        assert torch.equal(prompt, refs["image_a.input_ids"])
        inputs |= {"pixel_values": refs["image_a.pixel_values"], "image_grid_thw": refs["image_a.image_grid_thw"],
                   "mm_token_type_ids": (inputs["input_ids"] == IMAGE_PAD).int()}
    with torch.no_grad():
        logits = moe_hf_model(**inputs, use_cache=False).logits[0, prompt.shape[1] - 1:]
    torch.testing.assert_close(logits, refs[f"{group}.step_logits"], atol=1e-4, rtol=0)
    assert torch.equal(logits.argmax(-1), generated[0])


def test_text_only_checkpoint_is_the_same_language_model(fixtures: Fixtures):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(fixtures.moe_text, attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    refs, vl_refs = fixtures.refs(fixtures.moe_text), fixtures.refs(fixtures.moe_hf)
    torch.testing.assert_close(_logits(model, refs, "text"), refs["text.logits"], atol=ATOL, rtol=0)
    torch.testing.assert_close(refs["text.logits"], vl_refs["text.logits"], atol=ATOL, rtol=0)
    assert torch.equal(refs["gen_text.output_ids"], vl_refs["gen_text.output_ids"])


def test_dense_reload_reproduces_text_and_image_logits(fixtures: Fixtures):
    model = _vl_model(fixtures.dense)
    assert json.loads((fixtures.dense / "config.json").read_text())["model_type"] == "qwen3_5"
    refs = fixtures.refs(fixtures.dense)
    for group in ("text", "image_a"):
        torch.testing.assert_close(_logits(model, refs, group), refs[f"{group}.logits"], atol=ATOL, rtol=0)
    assert not any("router" in name for name in refs)


def test_router_and_greedy_choices_are_decisive(fixtures: Fixtures):
    """Exact comparisons of router ids and greedy tokens need margins well above an fp32 engine's error."""
    for folder in (fixtures.moe_hf, fixtures.moe_fp8, fixtures.dense):
        refs = fixtures.refs(folder)
        for name in [n for n in refs if n.endswith("router_min_gap")]:
            assert float(refs[name]) > 1e-4, (folder.name, name)
        for group in ("gen_text", "gen_image"):
            top2 = refs[f"{group}.step_logits"].topk(2, dim=-1).values
            assert (top2[:, 0] - top2[:, 1]).min() > 1e-4, (folder.name, group)


def test_transformers_own_fp8_loader_reproduces_the_fp8_references(fixtures: Fixtures):
    """A second oracle: transformers reads the FP8 folder as an official FP8 release and dequantizes it itself."""
    from transformers import AutoModelForImageTextToText, FineGrainedFP8Config
    model = AutoModelForImageTextToText.from_pretrained(
        fixtures.moe_fp8, attn_implementation="eager", dtype=torch.float32,
        quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    refs, bf16_refs = fixtures.refs(fixtures.moe_fp8), fixtures.refs(fixtures.moe_hf)
    torch.testing.assert_close(_logits(model, refs, "text"), refs["text.logits"], atol=ATOL, rtol=0)
    assert (refs["text.logits"] - bf16_refs["text.logits"]).abs().max() > 1e-3  # FP8 really is a different model
