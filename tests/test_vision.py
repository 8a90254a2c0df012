"""VisionTower and mrope_position_ids against the transformers 5.24 oracle (Qwen3_5MoeVisionModel, get_rope_index)."""
from __future__ import annotations

import copy
import numpy as np
import pytest
import torch
from PIL import Image

from a3b_core.models.vision import VisionConfig
from a3b_core.errors import ImageError, PromptError
from a3b_core.models.mrope import mrope_position_ids
from a3b_core.models.vision import VisionTower

pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf  # noqa: E402
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import (  # noqa: E402
    Qwen3_5MoeConfig, Qwen3_5MoeVisionConfig)

VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=96, patch_size=16, temporal_patch_size=2,
              spatial_merge_size=2, in_channels=3, num_position_embeddings=64, out_hidden_size=128)
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 502, 503, 500, 501


@pytest.fixture(scope="module")
def reference_tower() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3_5MoeVisionConfig(**VISION, hidden_act="gelu_pytorch_tanh")
    config._attn_implementation = "eager"
    model = hf.Qwen3_5MoeVisionModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # biases and norm weights: make them non-trivial
                param.add_(torch.randn_like(param) * 0.1)
            if name == "pos_embed.weight":  # a smooth-ish, large table so interpolation errors would show
                param.normal_(0, 1.0)
    return model


@pytest.fixture(scope="module")
def tower(reference_tower: torch.nn.Module) -> VisionTower:
    ours = VisionTower(VisionConfig(**VISION)).eval()
    ours.load_state_dict(reference_tower.state_dict(), strict=True)
    return ours


@pytest.fixture(scope="module")
def processor() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(size={"shortest_edge": 65536, "longest_edge": 16777216}, patch_size=16,
                                    temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def random_image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def preprocess(processor: Qwen2VLImageProcessorPil, images: list[Image.Image]) -> tuple[torch.Tensor, list]:
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"].float(), [tuple(g) for g in out["image_grid_thw"].tolist()]


def reference_embeddings(model: torch.nn.Module, pixel_values: torch.Tensor, grids: list) -> torch.Tensor:
    with torch.no_grad():
        return model(pixel_values, grid_thw=torch.tensor(grids)).pooler_output


def test_state_dict_keys_match_checkpoint_names(reference_tower, tower):
    assert set(tower.state_dict()) == set(reference_tower.state_dict())
    assert tower.state_dict()["patch_embed.proj.weight"].shape == (32, 3, 2, 16, 16)


@pytest.mark.parametrize("size, grid", [((384, 384), (1, 24, 24)), ((300, 200), (1, 14, 20))])
def test_one_image_matches_reference(reference_tower, tower, processor, size, grid):
    pixel_values, grids = preprocess(processor, [random_image(*size, seed=1)])
    assert grids == [grid]
    expected = reference_embeddings(reference_tower, pixel_values, grids)
    with torch.no_grad():
        got = tower(pixel_values, grids)
    assert got.shape == (grid[1] * grid[2] // 4, 128)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("second, second_grid", [((300, 200), (1, 14, 20)), ((384, 384), (1, 24, 24))],
                         ids=["sizes differ", "same size: one batched call"])
def test_two_images_in_one_call_match_reference_and_stay_separate(reference_tower, tower, processor, second,
                                                                  second_grid):
    pixel_values, grids = preprocess(processor, [random_image(384, 384, seed=2), random_image(*second, seed=3)])
    assert grids == [(1, 24, 24), second_grid]
    expected = reference_embeddings(reference_tower, pixel_values, grids)
    with torch.no_grad():
        got = tower(pixel_values, grids)
        first_alone = tower(pixel_values[:576], grids[:1])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(got[:144], first_alone, atol=1e-6, rtol=0)  # no attention across images


def test_float64_parameters_run_in_the_input_dtype(tower, processor):
    pixel_values, grids = preprocess(processor, [random_image(300, 200, seed=4)])
    with torch.no_grad():
        reference = tower(pixel_values, grids)
        got = tower(pixel_values.double(), grids)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.float(), reference, atol=1e-5, rtol=0)


def test_bfloat16_parameters_are_cast_to_the_input_dtype(tower, processor):
    pixel_values, grids = preprocess(processor, [random_image(300, 200, seed=5)])
    bf16_tower = copy.deepcopy(tower).to(torch.bfloat16)
    rounded_fp32_tower = copy.deepcopy(bf16_tower).float()
    with torch.no_grad():
        got = bf16_tower(pixel_values, grids)
        expected = rounded_fp32_tower(pixel_values, grids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_mismatched_pixel_rows_raise_image_error(tower):
    with pytest.raises(ImageError, match=r"\(576, 1536\)"):
        tower(torch.zeros(500, 1536), [(1, 24, 24)])
    with pytest.raises(ImageError, match="multiples of 2"):
        tower(torch.zeros(15 * 20, 1536), [(1, 15, 20)])


# --- M-RoPE position ids ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_model() -> torch.nn.Module:
    """A tiny Qwen3_5MoeModel: get_rope_index only reads vision_config.spatial_merge_size."""
    text = dict(vocab_size=512, hidden_size=32, num_hidden_layers=1, layer_types=["full_attention"],
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
                linear_num_value_heads=1, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2,
                num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    config = Qwen3_5MoeConfig(text_config=text, vision_config=VISION, image_token_id=IMAGE_TOKEN,
                              video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                              vision_end_token_id=VISION_END)
    return hf.Qwen3_5MoeModel(config).eval()


def prompt(*parts: list[int] | tuple[int, int, int]) -> tuple[torch.Tensor, list]:
    """Lists are text ids; a tuple is an image grid, expanded to vision_start + pads + vision_end."""
    ids, grids = [], []
    for part in parts:
        if isinstance(part, tuple):
            grids.append(part)
            ids += [VISION_START] + [IMAGE_TOKEN] * (part[0] * part[1] * part[2] // 4) + [VISION_END]
        else:
            ids += part
    return torch.tensor(ids), grids


def reference_positions(model: torch.nn.Module, input_ids: torch.Tensor, grids: list) -> tuple[torch.Tensor, int]:
    ids = input_ids[None]
    position_ids, deltas = model.get_rope_index(
        ids, mm_token_type_ids=(ids == IMAGE_TOKEN).int(), image_grid_thw=torch.tensor(grids) if grids else None)
    return position_ids[:, 0], int(deltas[0, 0])


CASES = {
    "text only": ([1, 2, 3, 4, 5, 6, 7],),
    "image in the middle": ([10, 11, 12], (1, 14, 20), [13, 14, 15, 16]),
    "two images": ([10, 11], (1, 24, 24), [12, 13], (1, 14, 20), [14]),
    "image at the start": ((1, 20, 14),),
}


@pytest.mark.parametrize("name", CASES)
def test_mrope_positions_match_get_rope_index(reference_model, name):
    input_ids, grids = prompt(*CASES[name])
    if name == "image at the start":  # the pads themselves open the sequence
        input_ids = input_ids[1:]
    expected, expected_delta = reference_positions(reference_model, input_ids, grids)
    got, delta = mrope_position_ids(input_ids, grids, IMAGE_TOKEN, spatial_merge_size=2)
    assert got.dtype == torch.long and got.shape == (3, len(input_ids))
    assert torch.equal(got, expected)
    assert delta == expected_delta


def test_mrope_text_only_is_arange_with_zero_delta():
    got, delta = mrope_position_ids(torch.tensor([5, 6, 7]), [], IMAGE_TOKEN, spatial_merge_size=2)
    assert torch.equal(got, torch.arange(3).expand(3, -1)) and delta == 0


def test_mrope_worked_example_from_the_spec():
    # 10 text tokens + vision_start fill 0..10; a 7x10 merged image starts at 11; vision_end gets 21.
    input_ids, grids = prompt(list(range(10)), (1, 14, 20))
    got, delta = mrope_position_ids(input_ids, grids, IMAGE_TOKEN, spatial_merge_size=2)
    image = got[:, 11:81]
    assert image[1].min() == 11 and image[1].max() == 17 and image[2].max() == 20 and (image[0] == 11).all()
    assert got[:, 81].tolist() == [21, 21, 21] and delta == 22 - 82


def test_mrope_pad_count_mismatch_raises_prompt_error():
    input_ids, grids = prompt([1, 2], (1, 14, 20), [3])
    one_pad_short = torch.cat([input_ids[:5], input_ids[6:]])
    with pytest.raises(PromptError, match=r"69 image pad tokens.*need 70"):
        mrope_position_ids(one_pad_short, grids, IMAGE_TOKEN, spatial_merge_size=2)
    with pytest.raises(PromptError, match=r"70 image pad tokens.*need 140"):
        mrope_position_ids(input_ids, grids * 2, IMAGE_TOKEN, spatial_merge_size=2)
