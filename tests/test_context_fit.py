"""Many views in one prompt: images that would not fit the context with the answer are encoded again at the largest
size, the same for all, at which they fit (context_fit, through A3B Generate's prompt building); a prompt that fits is
untouched; one that cannot fit even at the smallest size is refused with the numbers."""
from __future__ import annotations

import pytest

from a3b_core import PromptError, load_model
from a3b_core.media.image import PROCESSOR_MIN_PIXELS
from nodes.prompt_spec import PER_IMAGE, SINGLE, PromptSpec, build_prompts, fitted_prompts
from tests.test_bad_inputs import FIX
from tests.tiny_models import synthetic_image

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXT = 3072
NEW_TOKENS = 16
VIEWS = 30
USER = "These are views of one object from every side. Describe the object."


@pytest.fixture(scope="module")
def model(fixtures):
    return load_model(fixtures.moe_hf, preset="cpu", compute_dtype="float32", max_context=CONTEXT)


@pytest.fixture(scope="module")
def views():
    return [synthetic_image(160, 120, seed) for seed in range(VIEWS)]


def tokens_at(side: int, factor: int = 32) -> int:
    """LM tokens of one image resized to side x side (the processor's minimum pixel count applies)."""
    side = max(side, int(PROCESSOR_MIN_PIXELS ** 0.5))
    return (side // factor) ** 2


def test_views_that_do_not_fit_are_shrunk_to_the_largest_size_that_fits(model, views):
    images = model.encode_images(views, size=384)
    spec = PromptSpec(user=USER, images=images)
    [whole] = build_prompts(model, spec, SINGLE)
    assert len(whole.input_ids) + NEW_TOKENS > CONTEXT  # 30 views of 144 tokens
    with pytest.raises(PromptError):
        model.generate(whole, max_new_tokens=NEW_TOKENS, temperature=0)
    text = len(whole.input_ids) - VIEWS * tokens_at(384)
    side = max(s for s in range(32, 385, 32) if text + VIEWS * tokens_at(s) + NEW_TOKENS <= CONTEXT)
    assert side < 384

    [prompt], note = fitted_prompts(model, spec, SINGLE, NEW_TOKENS)
    assert note == f"{VIEWS} images at {side}x{side} pixels to fit max_context={CONTEXT}"
    assert prompt.images.grids == [(1, side // 16, side // 16)] * VIEWS
    assert len(prompt.input_ids) == text + VIEWS * tokens_at(side) <= CONTEXT - NEW_TOKENS
    assert text + VIEWS * tokens_at(side + 32) + NEW_TOKENS > CONTEXT  # the next size up would not fit
    # the same pixels as encoding the views at that size in the first place
    direct = model.encode_images(views, size=side)
    assert all((a == b).all() for a, b in zip(prompt.images.embeds, direct.embeds))
    result = model.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=0)
    assert len(result.token_ids) >= 1


def test_native_views_keep_their_shape_within_the_chosen_size(model):
    views = [synthetic_image(640, 480, seed) for seed in range(VIEWS)]
    spec = PromptSpec(user=USER, images=model.encode_images(views, resize="native"))
    [prompt], note = fitted_prompts(model, spec, SINGLE, NEW_TOKENS)
    side = int(note.split(" at ")[1].split("x")[0])
    assert note == f"{VIEWS} images at {side}x{side} pixels to fit max_context={CONTEXT}"
    assert len(prompt.input_ids) + NEW_TOKENS <= CONTEXT
    for _, rows, cols in prompt.images.grids:
        assert cols > rows and rows * cols * 16 * 16 <= side * side  # landscape, within side x side pixels


def test_a_prompt_that_fits_is_untouched(model, views):
    images = model.encode_images(views[:3], size=384)
    spec = PromptSpec(user=USER, images=images)
    for mode in (SINGLE, PER_IMAGE):
        prompts, note = fitted_prompts(model, spec, mode, NEW_TOKENS)
        assert note == ""
        assert [p.input_ids for p in prompts] == [p.input_ids for p in build_prompts(model, spec, mode)]
        used = [embeds for p in prompts for embeds in p.images.embeds]
        assert len(used) == 3 and all(a is b for a, b in zip(used, images.embeds))  # the same encodings


def test_views_that_cannot_fit_even_at_the_smallest_size_are_refused(fixtures, views):
    small = load_model(fixtures.moe_hf, preset="cpu", compute_dtype="float32", max_context=1024)
    spec = PromptSpec(user=USER, images=small.encode_images(views, size=384))
    with pytest.raises(PromptError) as caught:
        fitted_prompts(small, spec, SINGLE, NEW_TOKENS)
    message = str(caught.value)
    assert f"at least {VIEWS * tokens_at(32)} tokens" in message and "max_context=1024" in message
    assert FIX.search(message)
