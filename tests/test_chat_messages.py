"""OpenAI chat messages <-> build_prompt's conversation. The server's reading of messages gives the prompt Qwen's own
chat template renders from them; the remote client's messages, read back, give the prompt a local model builds."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from a3b_core import IMAGE_MARKER, VIDEO_MARKER, PromptError, Turn, load_model
from a3b_core.services.openai_messages import conversation_from_messages, messages_from_conversation
from tests.integration.pixel_art_inputs import INPUTS
from tests.test_bad_inputs import FIX
from tests.test_prompt import official_text

URLS = [f"data:image/png;base64,image{i}" for i in range(4)]  # stand-ins: only their order matters here


@pytest.fixture(scope="module")
def demo(one_thread):
    return load_model("a3b-demo", preset="cpu")


@pytest.fixture(scope="module")
def images(demo):
    return demo.encode_images(sorted(INPUTS.glob("a3b_pixel_*.png")), size=64)


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def served_prompt(model, images, messages: list[dict], thinking: bool):
    """What the server builds from `messages`: their conversation through build_prompt."""
    conversation = conversation_from_messages(messages)
    used = images[:len(conversation.image_urls)] if conversation.image_urls else None
    return model.build_prompt(user=conversation.user, system=conversation.system, images=used, thinking=thinking,
                              history=conversation.history)


CONVERSATIONS = {
    "text": [{"role": "user", "content": "  Describe the image.\n"}],
    "system and parts": [{"role": "system", "content": [text("You caption "), text("images.")]},
                         {"role": "user", "content": [image(URLS[0]), text("\nCaption this view.")]}],
    "images between texts": [{"role": "user", "content": [text("Compare "), image(URLS[0]), text(" with "),
                                                          image(URLS[1]), text(".")]}],
    "history": [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [image(URLS[0]), text("What is it?")]},
                {"role": "assistant", "content": "A heart."},
                {"role": "user", "content": "And its colour?"},
                {"role": "assistant", "content": "<think>\nIt is red.\n</think>\n\nRed.",},
                {"role": "user", "content": [text("Now this one: "), image(URLS[1]), image(URLS[2])]}],
    "reasoning content": [{"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello.", "reasoning_content": "A greeting."},
                          {"role": "user", "content": "Describe the image."}],
}


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_the_served_prompt_is_the_one_qwens_template_renders(demo, images, name, thinking):
    messages = CONVERSATIONS[name]
    prompt = served_prompt(demo, images, messages, thinking)
    assert prompt.prompt.text == official_text(messages, thinking=thinking)


@settings(max_examples=60, deadline=None, database=None)
@given(data=st.data())
def test_the_clients_messages_give_the_local_prompt(demo, images, data):
    words = st.sampled_from(["Describe", " the image", "\n", "  ", "in one sentence.", "é", ""])
    phrase = st.lists(words, max_size=4).map("".join)

    def user_text(count: int) -> str:
        if count and data.draw(st.booleans()):  # markers: one per image, text around them
            return IMAGE_MARKER.join(data.draw(phrase) for _ in range(count + 1))
        return data.draw(phrase)

    history = []
    for _ in range(data.draw(st.integers(0, 2))):
        count = data.draw(st.integers(0, 1))
        history.append(Turn(user=user_text(count) or "Hi", assistant=data.draw(phrase) or "Yes.", num_images=count))
    used = sum(turn.num_images for turn in history)
    current = data.draw(st.integers(0, len(images) - used))
    user = user_text(current)
    if not user.strip() and not current:
        user = "Describe the image."
    system = data.draw(st.sampled_from(["", "  ", "Be brief.", " You caption images.\n"]))
    thinking = data.draw(st.booleans())
    total = used + current
    local = demo.build_prompt(user=user, system=system, images=images[:total] if total else None, thinking=thinking,
                              history=history)
    messages = messages_from_conversation(user, system, history, URLS[:total])
    assert served_prompt(demo, images, messages, thinking).input_ids == local.input_ids
    assert official_text(messages, thinking=thinking) == local.prompt.text


def test_images_keep_their_order_and_places():
    messages = CONVERSATIONS["history"]
    conversation = conversation_from_messages(messages)
    assert conversation.image_urls == tuple(URLS[:3])
    assert conversation.image_places == ("messages[1].content[0].image_url", "messages[5].content[1].image_url",
                                         "messages[5].content[2].image_url")
    assert conversation.history[0] == Turn(user=IMAGE_MARKER + "What is it?", assistant="A heart.", num_images=1)
    assert conversation.user == f"Now this one: {IMAGE_MARKER}{IMAGE_MARKER}"
    assert messages_from_conversation("Describe the image.", "", (), URLS[:1]) == [
        {"role": "user", "content": [image(URLS[0]), text("Describe the image.")]}]


@pytest.mark.parametrize("messages, words", [
    ([], "non-empty list"),
    ([{"role": "assistant", "content": "Hi"}], "role 'assistant' where a 'user' message belongs"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "role 'user' where a 'assistant'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "is not a user message"),
    ([{"role": "system", "content": "a"}, {"role": "system", "content": "b"}], "role 'system' where a 'user'"),
    ([{"role": "system", "content": [image(URLS[0])]}, {"role": "user", "content": "a"}], "not a text part"),
    ([{"role": "user", "content": f"Look {IMAGE_MARKER}"}], "reserves for image places"),
    ([{"role": "user", "content": f"Look {VIDEO_MARKER}"}], "reserves for video places"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "only 'text' and 'image_url'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "has no url"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
      {"role": "user", "content": "b"}], "does not support tools"),
    (["Describe the image."], "write each message as an object"),
    ([{"role": "user", "content": 3}], "use a string or a list"),
])
def test_messages_the_template_cannot_take_are_refused(messages, words):
    with pytest.raises(PromptError) as info:
        conversation_from_messages(messages)
    assert words in str(info.value) and FIX.search(str(info.value)), str(info.value)


@pytest.mark.parametrize("user, urls, words", [
    (f"{IMAGE_MARKER} and {IMAGE_MARKER}", URLS[:1], "has 2 [[IMG]] markers but 1 images"),
    (f"Look at {IMAGE_MARKER}", [], "no image was given"),
])
def test_markers_that_disagree_with_the_images_are_refused(user, urls, words):
    with pytest.raises(PromptError) as info:
        messages_from_conversation(user, None, (), urls)
    assert words in str(info.value) and FIX.search(str(info.value)), str(info.value)
