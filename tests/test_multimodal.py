"""Images through the whole engine (file -> pixels -> vision tower -> pad replacement -> M-RoPE) vs the oracle."""
import pytest
import torch

from a3b_core import EncodedImages, PromptError, load_model

TOL = 1e-4
GROUPS = {"image_a": ["square_image"], "image_b": ["wide_image"], "image_ab": ["square_image", "wide_image"]}


@pytest.fixture(scope="module", params=["moe_fused_bf16", "moe_fp8", "dense"])
def layout(request, fixtures):
    model = load_model(getattr(fixtures, request.param), preset="cpu", compute_dtype="float32")
    return model, fixtures.refs(getattr(fixtures, request.param))


@pytest.mark.parametrize("group", GROUPS)
def test_image_prompt_matches_reference(fixtures, layout, group):
    model, refs = layout
    # "native" keeps each image's own size, as the processor does: 384x384 -> 24x24 patches, 300x200 -> 14x20
    images = model.encode_images([getattr(fixtures, name) for name in GROUPS[group]], resize="native")
    assert images.grids == [tuple(g) for g in refs[f"{group}.image_grid_thw"].tolist()]
    torch.testing.assert_close(torch.cat(images.embeds), refs[f"{group}.image_embeds"], atol=1e-5, rtol=0)

    ids = refs[f"{group}.input_ids"]
    positions, deltas = model.positions(ids, images)
    assert torch.equal(positions, refs[f"{group}.position_ids"])
    assert deltas == refs[f"{group}.rope_deltas"].flatten().tolist()
    torch.testing.assert_close(model.logits(ids, images=images), refs[f"{group}.logits"], atol=TOL, rtol=0)


def test_square_image_is_144_tokens(fixtures, layout):
    model, _ = layout
    images = model.encode_images(fixtures.wide_image, size=384, resize="stretch")
    assert images.token_counts == [144]


def test_encoded_images_index_and_concatenate(fixtures, layout):
    model, _ = layout
    both = model.encode_images([fixtures.square_image, fixtures.wide_image], resize="native")
    assert len(both) == 2 and both[1].grids == [both.grids[1]]
    assert (both[0] + both[1]).token_counts == both.token_counts


def test_pad_count_mismatch_is_a_prompt_error(fixtures, layout):
    model, refs = layout
    one = model.encode_images(fixtures.square_image, resize="native")
    with pytest.raises(PromptError, match="image pad tokens"):
        model.logits(refs["image_ab.input_ids"], images=one)
    with pytest.raises(PromptError, match="image pad tokens"):
        model.logits(refs["image_a.input_ids"], images=EncodedImages([], []))


def test_built_prompt_places_images_at_markers(fixtures, layout):
    model, _ = layout
    images = model.encode_images([fixtures.square_image, fixtures.wide_image], resize="native")
    chat = model.build_prompt(user="Compare [[IMG]] with [[IMG]].", images=images)
    ids = torch.tensor(chat.input_ids)
    assert int((ids == model.config.image_token_id).sum()) == sum(images.token_counts)
    with pytest.raises(PromptError, match=r"\[\[IMG\]\]"):
        model.build_prompt(user="Only [[IMG]] here.", images=images)
