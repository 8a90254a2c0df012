"""The Qwen3-VL family against the transformers oracle, on tiny checkpoints of every released layout (fused BF16
experts stored transposed, the same in FP8 with block scales, dense) and transformers' own: text, one image, two images
of different sizes (DeepStack included), cached decoding and greedy generation."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from a3b_core import load_model
from a3b_core.errors import CheckpointError, ConfigError
from a3b_core.models import family_for, parse_config
from a3b_core.models.kv_cache import KVCache
from a3b_core.prompting.conversation import Prompt
from a3b_core.release.safetensors import Checkpoint
from a3b_core.runtime.generation import generate
from a3b_core.runtime.inputs import ChatPrompt, EncodedImages
from tests.test_bad_inputs import FIX
from tests.test_text_model import logits_and_router_choices
from tests.tiny_qwen3_vl import MOE_DIMS, build_qwen3_vl_fixtures

LAYOUTS = ["moe_hf", "moe_bf16", "moe_fp8", "dense"]
TOL = 1e-4
GROUPS = {"image_a": ["square_image"], "image_ab": ["square_image", "wide_image"]}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def vl():
    return build_qwen3_vl_fixtures()


@pytest.fixture(scope="module")
def models(vl):
    return {name: load_model(getattr(vl, name), preset="cpu", compute_dtype="float32") for name in LAYOUTS}


def test_the_layouts_are_the_releases(vl, models):
    assert {m.family.name for m in models.values()} == {"Qwen3-VL"}
    assert models["dense"].config.model_type == "qwen3_vl" and not models["dense"].config.text.is_moe
    assert models["moe_bf16"].config.text.num_experts == models["moe_hf"].config.text.num_experts == 8
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    infos = {layout: Checkpoint(getattr(vl, layout)).infos for layout in ("moe_hf", "moe_bf16", "moe_fp8")}
    e, i, h = MOE_DIMS["num_experts"], MOE_DIMS["moe_intermediate_size"], 128
    shapes = {layout: infos[layout][name].shape for layout in infos}
    assert shapes == {"moe_hf": (e, 2 * i, h), "moe_bf16": (e, h, 2 * i), "moe_fp8": (e, h, 2 * i)}
    fp8 = infos["moe_fp8"]
    assert fp8[name].dtype == torch.float8_e4m3fn and fp8[name + "_scale_inv"].dtype == torch.float32
    assert fp8[name + "_scale_inv"].shape == (e, 1, 2)  # 128x128 blocks over the stored [H, 2I] of each expert


@pytest.mark.parametrize("layout", LAYOUTS)
def test_text_logits_and_router_match_reference(vl, models, layout):
    model, refs = models[layout], vl.refs(getattr(vl, layout))
    logits, chosen = logits_and_router_choices(model, refs["text.input_ids"])
    diff = (logits - refs["text.logits"]).abs().max().item()
    assert diff <= TOL, f"max |logit diff| {diff:.2e}"
    assert len(chosen) == (4 if model.config.text.is_moe else 0)
    for i, experts in enumerate(chosen):
        assert torch.equal(experts, refs[f"text.router_topk_L{i}"]), f"layer {i} router choices differ"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cached_steps_equal_one_full_forward(vl, models, layout):
    model = models[layout]
    ids = vl.refs(getattr(vl, layout))["text.input_ids"]
    full = model.logits(ids)
    cache = model.new_cache(batch=2, max_len=ids.shape[1])
    assert type(cache) is KVCache and len(cache.keys) == model.config.text.num_layers
    pieces = [model.forward(ids[:, :70], cache=cache)]
    for t in range(70, 80):
        pieces.append(model.forward(ids[:, t:t + 1], cache=cache, position_ids=torch.tensor(t).expand(3, 2, 1)))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=TOL, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("group", GROUPS)
def test_image_prompt_matches_reference(vl, models, layout, group):
    model, refs = models[layout], vl.refs(getattr(vl, layout))
    images = model.encode_images([getattr(vl, name) for name in GROUPS[group]], resize="native")
    assert images.grids == [tuple(g) for g in refs[f"{group}.image_grid_thw"].tolist()]
    torch.testing.assert_close(torch.cat(images.embeds), refs[f"{group}.image_embeds"], atol=1e-5, rtol=0)
    ids = refs[f"{group}.input_ids"]
    positions, deltas = model.positions(ids, images)
    assert torch.equal(positions, refs[f"{group}.position_ids"])
    assert deltas == refs[f"{group}.rope_deltas"].flatten().tolist()
    logits, chosen = logits_and_router_choices(model, ids, images)
    diff = (logits - refs[f"{group}.logits"]).abs().max().item()
    assert diff <= TOL, f"max |logit diff| {diff:.2e}"
    for i, experts in enumerate(chosen):
        assert torch.equal(experts, refs[f"{group}.router_topk_L{i}"]), f"layer {i} router choices differ"


def test_deepstack_levels_are_added_after_the_first_layers(vl, models):
    """Without its DeepStack levels an image gives other logits: the levels are used, at the image positions."""
    model, refs = models["moe_bf16"], vl.refs(vl.moe_bf16)
    images = model.encode_images(vl.square_image, resize="native")
    ids = refs["image_a.input_ids"]
    rows = model.image_rows(ids, images)
    assert rows.shape == (144, 4, 128)  # the merger's output, then 3 levels
    positions, _ = model.positions(ids, images)
    with torch.inference_mode():
        with_levels = model.run_text(ids, rows, positions, None, None, last_only=False)
        without = model.text(model.embed_rows(ids, rows), positions)
    torch.testing.assert_close(with_levels, refs["image_a.logits"], atol=TOL, rtol=0)
    assert (without - refs["image_a.logits"]).abs().max() > 1e-2


@pytest.mark.parametrize("chunk", [16, 100])
def test_a_prompt_with_images_prefilled_in_chunks_equals_one_forward(vl, models, chunk):
    """Chunks that cut through an image take its rows and DeepStack levels in order."""
    model, refs = models["moe_bf16"], vl.refs(vl.moe_bf16)
    images = model.encode_images([vl.square_image, vl.wide_image], resize="native")
    ids = refs["image_ab.input_ids"]
    cache = model.new_cache(batch=1, max_len=ids.shape[1])
    positions, _ = model.positions(ids, images)
    last = model.prefill(ids, images, cache, None, positions, chunk=chunk)
    torch.testing.assert_close(last, refs["image_ab.logits"][:, -1], atol=TOL, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("group", ["gen_text", "gen_image"])
def test_greedy_generation_matches_reference(vl, models, layout, group):
    model, refs = models[layout], vl.refs(getattr(vl, layout))
    images = model.encode_images(vl.square_image, resize="native") if group == "gen_image" else EncodedImages([], [])
    prompt = ChatPrompt(Prompt(tuple(refs[f"{group}.prompt_ids"][0].tolist()), tuple(images.token_counts), False, ""),
                        images)
    result = generate(model, prompt, max_new_tokens=32, temperature=0)
    assert result.token_ids == refs[f"{group}.output_ids"][0].tolist()


# ----------------------------------------------------------------------------------------------- config.json
REAL_CONFIG = Path(__file__).parent / "data" / "qwen3_vl_30b_a3b.config.json"


def real_raw() -> dict:
    return json.loads(REAL_CONFIG.read_text())


def test_the_released_config_parses():
    config = parse_config(real_raw())
    t, v = config.text, config.vision
    assert (t.num_layers, t.num_heads, t.num_kv_heads, t.head_dim, t.rotary_dim) == (48, 32, 4, 128, 128)
    assert t.mrope_section == (24, 20, 20) and t.mrope_interleaved and t.rope_theta == 5e6
    assert (t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size) == (128, 8, 768) and all(t.moe_layers)
    assert v.deepstack_indexes == (8, 16, 24) and v.depth == 27 and v.out_hidden_size == 2048
    assert (config.image_token_id, config.vision_start_token_id, t.eos_token_ids) == (151655, 151652, (151645,))


def test_mlp_only_layers_get_the_dense_mlp():
    raw = real_raw()
    raw["text_config"] |= {"mlp_only_layers": [1], "num_hidden_layers": 4, "decoder_sparse_step": 1}
    config = parse_config(raw)
    assert config.text.moe_layers == (True, False, True, True)
    with torch.device("meta"):
        text = family_for("qwen3_vl_moe").text_model(config.text)
    assert [hasattr(layer.mlp, "experts") for layer in text.layers] == [True, False, True, True]
    assert text.layers[1].mlp.up_proj.weight.shape == (6144, 2048)


@pytest.mark.parametrize("change, message", [
    (lambda raw: raw["text_config"].update(attention_bias=True), "attention_bias is true"),
    (lambda raw: raw["text_config"].update(mlp_only_layers=[48]), r"mlp_only_layers is \[48\]"),
    (lambda raw: raw["vision_config"].update(deepstack_visual_indexes=[8, 27]), "deepstack_visual_indexes is"),
    (lambda raw: raw["text_config"]["rope_scaling"].update(mrope_section=[24, 20, 19]), "sums to 63"),
    (lambda raw: raw["text_config"].pop("num_experts"), "'num_experts' is missing"),
])
def test_bad_configs_are_named(change, message):
    raw = real_raw()
    change(raw)
    with pytest.raises(ConfigError, match=message) as error:
        parse_config(raw, "Qwen3-VL/config.json")
    assert str(error.value).startswith("Qwen3-VL/config.json: ") and FIX.search(str(error.value))


def test_a_qwen3_5_config_with_deepstack_points_at_qwen3_vl():
    raw = json.loads((Path(__file__).parent / "data" / "qwen3_5_35b_a3b.config.json").read_text())
    raw["vision_config"]["deepstack_visual_indexes"] = [8, 16, 24]
    with pytest.raises(ConfigError, match="model_type qwen3_vl_moe or qwen3_vl"):
        parse_config(raw)


def test_the_fp8_releases_fused_experts_are_kept_as_released(vl, tmp_path):
    """weight_format "fp8" keeps each expert's e4m3 matrix and block scales as stored (transposed into the store's
    [out, in]), and computes what the dequantized checkpoint does. The stored e4m3 values are halved first: then no
    block reaches e4m3's largest value, so a requantization would pick other scales (and give itself away)."""
    folder = tmp_path / "moe_fp8"
    shutil.copytree(vl.moe_fp8, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    names = [f"model.language_model.layers.1.mlp.experts.{which}" for which in ("gate_up_proj", "down_proj")]
    for shard in {folder / index["weight_map"][name] for name in names}:
        tensors = load_file(shard)
        for name in names:
            if name in tensors:
                tensors[name] = (tensors[name].float() / 2).to(torch.float8_e4m3fn)
        save_file(tensors, shard)
    model = load_model(folder, preset="cpu", compute_dtype="float32", weight_format="fp8")
    ckpt = Checkpoint(folder)
    for name in names:
        stack = getattr(model.text.layers[1].mlp.experts, name.rsplit(".", 1)[1])
        for e in range(MOE_DIMS["num_experts"]):
            assert torch.equal(stack.q[e].view(torch.uint8), ckpt.raw(name)[e].t().view(torch.uint8))
            assert torch.equal(stack.scale[e], ckpt.raw(name + "_scale_inv")[e].t())
    as_float = load_model(folder, preset="cpu", compute_dtype="float32")
    ids = vl.refs(vl.moe_fp8)["text.input_ids"]
    torch.testing.assert_close(model.logits(ids), as_float.logits(ids), atol=1e-5, rtol=0)


def test_fused_fp8_experts_without_their_scales_are_refused_not_misread(vl, tmp_path):
    """FP8 fused experts without their block scales must not be read as if their e4m3 values were weights."""
    folder = tmp_path / "fused_fp8"
    shutil.copytree(vl.moe_bf16, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    shard = folder / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, shard)
    with pytest.raises(CheckpointError, match=f"'{name}' is stored as FP8 but has no '{name}_scale_inv'") as error:
        load_model(folder, preset="cpu", compute_dtype="float32")
    assert FIX.search(str(error.value))
