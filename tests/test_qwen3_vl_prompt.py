"""The Qwen3-VL chat templates against the oracle (the Instruct and Thinking releases' chat templates, rendered with
jinja2 as transformers does), which variant a folder holds, and prompts, streaming and Stop through the engine."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a3b_core import load_model
from a3b_core.prompting.built_in_templates import qwen3_vl_always_thinks as always_thinks
from a3b_core.prompting.built_in_templates import qwen3_vl_prompt as build_prompt
from a3b_core.prompting.conversation import IMAGE_MARKER, Turn, count_image_markers
from a3b_core.prompting.tokenizer import Tokenizer
from tests.test_prompt import IMAGE, assert_matches_official, official_content, official_template
from tests.tiny_qwen3_vl import build_qwen3_vl_fixtures
from tests.tiny_tokenizer import build_tiny_tokenizer

DATA = Path(__file__).parent / "data"
TEMPLATES = {False: official_template(DATA / "qwen3_vl_instruct_chat_template.jinja"),  # by thinking
             True: official_template(DATA / "qwen3_vl_thinking_chat_template.jinja")}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(build_tiny_tokenizer())


def check(tok, prompt, messages, counts, thinking, add_vision_id=False):
    assert_matches_official(tok, prompt, messages, counts, thinking=thinking, add_vision_id=add_vision_id,
                            template=TEMPLATES[thinking])


@pytest.mark.parametrize("thinking", [False, True])
def test_system_and_user_are_written_as_given(tok, thinking):
    prompt = build_prompt(tok, "\n  Describe the image.  ", system="  You are a helpful assistant.\n",
                          thinking=thinking)
    messages = [{"role": "system", "content": "  You are a helpful assistant.\n"},
                {"role": "user", "content": "\n  Describe the image.  "}]
    check(tok, prompt, messages, [], thinking)
    assert prompt.text.endswith("<|im_start|>assistant\n" + ("<think>\n" if thinking else ""))


@pytest.mark.parametrize("thinking", [False, True])
def test_images_at_markers_first_and_numbered(tok, thinking):
    prompt = build_prompt(tok, "Compare [[IMG]] with [[IMG]].", image_token_counts=[3, 5], thinking=thinking,
                          add_vision_id=True)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare "}, IMAGE,
                                             {"type": "text", "text": " with "}, IMAGE, {"type": "text", "text": "."}]}]
    check(tok, prompt, messages, [3, 5], thinking, add_vision_id=True)
    prompt = build_prompt(tok, "What colour is it?", image_token_counts=[2], thinking=thinking)
    check(tok, prompt, [{"role": "user", "content": [IMAGE, {"type": "text", "text": "What colour is it?"}]}], [2],
          thinking)


@pytest.mark.parametrize("thinking", [False, True])
def test_history(tok, thinking):
    history = [Turn("Hi there.", "  Hello!\n", reasoning="A greeting."),
               Turn("What is in [[IMG]]?", "<think>\nLook.\n</think>\n\nA red circle.", num_images=1)]
    prompt = build_prompt(tok, "And now?", image_token_counts=[2, 4], history=history, thinking=thinking)
    messages = [{"role": "user", "content": "Hi there."},
                {"role": "assistant", "content": "  Hello!\n", "reasoning_content": "A greeting."},
                {"role": "user", "content": [{"type": "text", "text": "What is in "}, IMAGE,
                                             {"type": "text", "text": "?"}]},
                {"role": "assistant", "content": "<think>\nLook.\n</think>\n\nA red circle."},
                {"role": "user", "content": [IMAGE, {"type": "text", "text": "And now?"}]}]
    check(tok, prompt, messages, [2, 4], thinking)
    assert ("Look." in prompt.text) is not thinking  # Instruct re-renders answers as given, Thinking drops reasoning


_PIECES = st.sampled_from(["Describe", " the image", "\n", "  ", "café 🙂", "</think>", "<think>", IMAGE_MARKER])
_TEXTS = st.lists(_PIECES, max_size=6).map("".join)


@settings(max_examples=60, deadline=None)
@given(user=_TEXTS, system=_TEXTS, turns=st.lists(st.tuples(_TEXTS, _TEXTS, st.booleans()), max_size=2),
       extra_images=st.integers(0, 2), thinking=st.booleans(), add_vision_id=st.booleans())
def test_matches_official_on_generated_conversations(tok, user, system, turns, extra_images, thinking, add_vision_id):
    system = system.replace(IMAGE_MARKER, "")
    history = [Turn(u, a, reasoning="why" if r else "", num_images=count_image_markers(u)) for u, a, r in turns]
    user_images = count_image_markers(user) or extra_images
    if not user.strip() and user_images == 0:
        user, user_images = "Hi", 0
    counts = [index + 1 for index in range(sum(t.num_images for t in history) + user_images)]
    messages = [{"role": "system", "content": system}] if system.strip() else []
    for turn in history:
        messages.append({"role": "user", "content": official_content(turn.user, turn.num_images)})
        messages.append({"role": "assistant", "content": turn.assistant,
                         **({"reasoning_content": turn.reasoning} if turn.reasoning else {})})
    messages.append({"role": "user", "content": official_content(user, user_images)})
    prompt = build_prompt(tok, user, system=system, image_token_counts=counts, history=history, thinking=thinking,
                          add_vision_id=add_vision_id)
    check(tok, prompt, messages, counts, thinking, add_vision_id)


# ----------------------------------------------------------------------------------------------- the variant
def test_the_variant_is_read_from_the_folders_chat_template(tmp_path):
    thinking = (DATA / "qwen3_vl_thinking_chat_template.jinja").read_text(encoding="utf-8")
    instruct = (DATA / "qwen3_vl_instruct_chat_template.jinja").read_text(encoding="utf-8")
    cases = {"a/chat_template.jinja": (thinking, True),
             "b/chat_template.json": (json.dumps({"chat_template": instruct}), False),
             "c/tokenizer_config.json": (json.dumps({"added_tokens_decoder": {"1": {"content": "<think>"}},
                                                     "chat_template": instruct}), False),
             "d/tokenizer_config.json": (json.dumps({"chat_template": thinking}), True)}
    for name, (text, expected) in cases.items():
        (tmp_path / name).parent.mkdir()
        (tmp_path / name).write_text(text, encoding="utf-8")
        assert always_thinks((tmp_path / name).parent) is expected, name
    for name, expected in (("Qwen3-VL-30B-A3B-Thinking", True), ("Qwen3-VL-8B-Instruct", False)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "chat_template.json").write_text("{not json")  # unreadable: the name decides
        assert always_thinks(tmp_path / name) is expected


def test_a_gguf_files_variant_is_read_from_the_template_it_carries(tmp_path):
    """A GGUF file carries its chat template in its metadata (tokenizer.chat_template): that decides, whatever the
    file is named; without one, the name does."""
    thinking = (DATA / "qwen3_vl_thinking_chat_template.jinja").read_text(encoding="utf-8")
    instruct = (DATA / "qwen3_vl_instruct_chat_template.jinja").read_text(encoding="utf-8")
    for name, carried, expected in (("model-Q4_K_M.gguf", thinking, True),
                                    ("Qwen3-VL-30B-A3B-Thinking-Q4_K_M.gguf", instruct, False),
                                    ("Qwen3-VL-30B-A3B-Thinking-Q4_K_M.gguf", None, True),
                                    ("model-Q4_K_M.gguf", None, False)):
        (tmp_path / name).write_bytes(b"GGUF")
        assert always_thinks(tmp_path / name, carried) is expected, name


@pytest.fixture(scope="module")
def thinking_folder(tmp_path_factory):
    """The tiny MoE checkpoint as a Thinking release: the same weights with the Thinking chat template."""
    folder = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(build_qwen3_vl_fixtures().moe_bf16, folder)
    template = (DATA / "qwen3_vl_thinking_chat_template.jinja").read_text(encoding="utf-8")
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    return folder


def test_an_instruct_model_never_thinks_and_a_thinking_model_always_does(thinking_folder):
    instruct = load_model(build_qwen3_vl_fixtures().moe_bf16, preset="cpu", compute_dtype="float32")
    thinking = load_model(thinking_folder, preset="cpu", compute_dtype="float32")
    for asked in (False, True):
        plain, thought = (m.build_prompt("Describe [[IMG]].", system="Be brief.", thinking=asked,
                                         images=m.encode_images(build_qwen3_vl_fixtures().square_image))
                          for m in (instruct, thinking))
        assert plain.prompt.thinking is False and plain.prompt.text.endswith("<|im_start|>assistant\n")
        assert thought.prompt.thinking is True and thought.prompt.text.endswith("<|im_start|>assistant\n<think>\n")
    result = thinking.generate(thought, max_new_tokens=6, temperature=0)
    assert result.reasoning + result.text != "" and len(result.token_ids) == 6


def test_live_text_and_stop(thinking_folder):
    model = load_model(build_qwen3_vl_fixtures().moe_bf16, preset="cpu", compute_dtype="float32")
    prompt = model.build_prompt("Describe the image in one sentence.")
    streamed = []
    full = model.generate(prompt, max_new_tokens=8, temperature=0, on_text=streamed.append)
    assert streamed and streamed[-1] == full.full_text
    steps = iter(range(100))
    stopped = model.generate(prompt, max_new_tokens=8, temperature=0, should_stop=lambda: next(steps) >= 3)
    assert stopped.stop_reason == "cancelled" and 0 < len(stopped.token_ids) < 8
    assert stopped.token_ids == full.token_ids[:len(stopped.token_ids)]


def test_the_nodes_per_image_pipeline_runs_a_qwen3_vl_model():
    """Image Encode's batch -> a per-image prompt with a system message and [[IMG]] -> Generate, as the example
    workflows wire them: one answer per image, each the engine's own for that image alone."""
    import numpy as np
    from PIL import Image

    from nodes.generation import generate_answers
    from nodes.image_batch import encode_image_batch
    from nodes.prompt_spec import PER_IMAGE, PromptSpec, build_prompts

    fixtures = build_qwen3_vl_fixtures()
    model = load_model(fixtures.moe_bf16, preset="cpu", compute_dtype="float32")
    square = np.asarray(Image.open(fixtures.square_image).convert("RGB").resize((128, 128)), dtype=np.float32) / 255
    batch = torch.from_numpy(np.stack([square, square[::-1].copy()]))
    images = encode_image_batch(model, batch, 128, "stretch", True)
    spec = PromptSpec(user="Describe [[IMG]] briefly.", system="You caption images.", images=images)
    prompts = build_prompts(model, spec, PER_IMAGE)
    streamed = {}
    answers = generate_answers(model, prompts, thinking_budget=0, on_text=streamed.__setitem__, max_new_tokens=6,
                               temperature=0)
    alone = [model.generate(model.build_prompt("Describe [[IMG]] briefly.", system="You caption images.",
                                               images=images[i]), max_new_tokens=6, temperature=0) for i in (0, 1)]
    assert [a.token_ids for a in answers] == [a.token_ids for a in alone]
    assert [streamed.get(i, "") for i in (0, 1)] == [a.full_text for a in answers]  # nothing streams an empty text
