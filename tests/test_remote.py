"""The remote model (a3b_core.services.openai_client) against `python -m a3b_core serve` on the demo model, through the same calls the
Image Encode and Generate nodes make: the same pixels, prompts and greedy answers as the local engine, live text,
Stop, parallel per-image requests, the API key rules and the errors a user can meet."""
from __future__ import annotations

import ast
import re
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from a3b_core import GenerationError, PromptError, RemoteError, load_model
from a3b_core.services.openai_client import RemoteImages, RemoteModel, checked_base_url
from a3b_core.services.openai_requests import decode_image_url
from nodes.generation import generate_answers
from nodes.prompt_spec import PER_IMAGE, SINGLE, PromptSpec, build_prompts
from nodes.remote_handle import RemoteModelHandle
from tests.integration.pixel_art_inputs import INPUTS, expected_captions
from tests.served import Served, start_served
from tests.test_bad_inputs import FIX

KEY_ENV = "A3B_REMOTE_TEST_KEY"
KEY = "remote-test-key-93ad"
REQUEST = "Describe the image."
GREEDY = {"max_new_tokens": 160, "temperature": 0.0, "top_p": 0.8, "top_k": 20, "min_p": 0.0, "presence_penalty": 0.0,
          "repetition_penalty": 1.0, "seed": 7}
PIXEL_IMAGES = sorted(INPUTS.glob("a3b_pixel_*.png"))
VIEW_IMAGES = sorted(INPUTS.parent.glob("a3b_view_*.png"))  # the multi-view workflow's inputs


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    server = start_served(tmp_path_factory.mktemp("serve"), "--api-key-env", KEY_ENV, env={KEY_ENV: KEY})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def key_in_env():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KEY_ENV, KEY)
        yield


@pytest.fixture(scope="module")
def remote(served, key_in_env) -> RemoteModel:
    return RemoteModel(served.url, "", KEY_ENV)


@pytest.fixture(scope="module")
def demo():
    return load_model("a3b-demo")


def image_batch(paths) -> torch.Tensor:
    """A ComfyUI IMAGE batch [B, H, W, C] in 0..1, as Load Image and Image Batch make it."""
    from PIL import Image
    return torch.stack([torch.from_numpy(np.asarray(Image.open(p).convert("RGB"), dtype=np.float32) / 255.0)
                        for p in paths])


# ------------------------------------------------------------------------------------------------ images
@pytest.mark.parametrize("resize, size", [("stretch", 384), ("stretch", 64), ("letterbox", 96), ("crop", 128),
                                          ("native", 384)])
def test_a_remote_image_carries_the_pixels_the_local_engine_encodes(demo, resize, size):
    rng = np.random.default_rng(0)
    odd = rng.integers(0, 256, (90, 150, 4), dtype=np.uint8)  # RGBA, neither square nor a multiple of 32
    for image in (odd, VIEW_IMAGES[0], image_batch(PIXEL_IMAGES[:1])):
        remote = RemoteModel("http://127.0.0.1:9/v1", "m").encode_images(image, size=size, resize=resize)
        (url,) = remote.urls
        assert url.startswith("data:image/png;base64,")
        served = demo.encode_images(decode_image_url(url, "test"), resize="native", srgb=False)  # as the server does
        local = demo.encode_images(image, size=size, resize=resize)
        assert served.grids == local.grids and torch.equal(served.embeds[0], local.embeds[0])


def test_remote_images_split_and_join_as_encoded_images_do():
    images = RemoteImages(("a", "b", "c"))
    assert len(images) == 3 and images[1] == RemoteImages(("b",)) and images[-1] == RemoteImages(("c",))
    assert images[:2] + images[2] == images


# ------------------------------------------------------------------------------------------------ answers
def test_the_node_path_gives_the_local_answers_greedy(remote, demo):
    """What A3B Generate does with each model: build_prompts, then generate_answers (per image: a batch locally,
    parallel requests remotely)."""
    handle = RemoteModelHandle(remote)
    cases = [
        (PromptSpec(user=REQUEST, images=image_batch(PIXEL_IMAGES)), PER_IMAGE),
        (PromptSpec(user="[[IMG]]\nCaption this view.", system="You caption views.",
                    images=image_batch(VIEW_IMAGES)), PER_IMAGE),
        (PromptSpec(user="Write a 4-panel comic storyboard.", system="You are a storyboard artist."), SINGLE),
        (PromptSpec(user=REQUEST, images=image_batch(PIXEL_IMAGES[:2]), thinking=True), SINGLE),
    ]
    for spec, mode in cases:
        answers = {}
        for name, model in (("local", demo), ("remote", handle.acquire())):
            images = spec.images if spec.images is None else model.encode_images(spec.images)
            built = build_prompts(model, PromptSpec(spec.user, spec.system, images, spec.thinking), mode)
            results = generate_answers(model, built, thinking_budget=0, on_text=lambda i, t: None, **GREEDY)
            answers[name] = [(r.text, r.reasoning) for r in results]
        assert answers["remote"] == answers["local"], (spec.user, mode)
    handle.finished_run()


def test_a_follow_up_question_gives_the_local_answer(remote, demo):
    answers = []
    for model in (demo, remote):
        first = PromptSpec(user=REQUEST, images=model.encode_images(image_batch(PIXEL_IMAGES[:1])))
        answer = model.generate(build_prompts(model, first, SINGLE)[0], **GREEDY).text
        follow_up = first.followed_by("And this one?", "", model.encode_images(image_batch(PIXEL_IMAGES[1:2])),
                                      False, answer)
        answers.append(model.generate(build_prompts(model, follow_up, SINGLE)[0], **GREEDY).text)
    assert answers[0] == answers[1]


def test_live_text_streams_and_ends_as_the_local_full_text(remote, demo):
    for thinking in (False, True):
        texts = {}
        for name, model in (("local", demo), ("remote", remote)):
            prompt = model.build_prompt(user=REQUEST, images=model.encode_images(PIXEL_IMAGES[2]), thinking=thinking)
            seen = []
            result = model.generate(prompt, on_text=seen.append, **GREEDY)
            assert len(seen) > 3 and seen[-1] == result.full_text
            texts[name] = seen[-1]
        assert texts["remote"] == texts["local"]


def test_the_remote_stats_count_what_the_local_engine_counts(remote, demo):
    results = [model.generate(model.build_prompt(user=REQUEST, images=model.encode_images(PIXEL_IMAGES[0])),
                              **GREEDY) for model in (demo, remote)]
    for name in ("prompt_tokens", "new_tokens", "stop_reason"):
        assert results[1].stats[name] == results[0].stats[name], name
    result = results[1]
    assert result.stop_reason == "eos" and result.stats["ttft_s"] > 0 and result.stats["decode_tok_s"] > 0
    assert result.text == expected_captions()[PIXEL_IMAGES[0].name]


def test_stop_cancels_the_request_on_the_server(served, remote):
    log_before = len(served.log_text())
    seen = []
    result = remote.generate(remote.build_prompt(user=REQUEST), max_new_tokens=3000, temperature=0,
                             presence_penalty=-100, on_text=seen.append, should_stop=lambda: len(seen) >= 3)
    assert result.stop_reason == "cancelled" and result.text.startswith(seen[2])
    served.wait_idle()
    cancelled = re.findall(r"(\d+) new tokens, cancelled, batch of 1 \(client gone\)", served.log_text()[log_before:])
    assert len(cancelled) == 1 and int(cancelled[0]) < 300, served.log_text()[log_before:]


def test_per_image_prompts_are_sent_in_parallel_and_batched(served, remote):
    log_before = len(served.log_text())
    prompts = [remote.build_prompt(user=REQUEST, images=remote.encode_images(path)) for path in PIXEL_IMAGES]
    results = remote.generate_batch(prompts, **GREEDY)
    assert [r.text for r in results] == [expected_captions()[p.name] for p in PIXEL_IMAGES]
    batches = [int(n) for n in re.findall(r"batch of (\d+)", served.log_text()[log_before:])]
    assert len(batches) == 4 and max(batches) > 1, batches


# ------------------------------------------------------------------------------------------------ the API key
def test_only_a3b_variables_may_hold_the_key():
    for name in ("AWS_SECRET_ACCESS_KEY", "OPENAI_API_KEY", "A3B", "A3B-KEY", "a3b_key"):
        with pytest.raises(RemoteError, match="starts with A3B_") as info:
            RemoteModel("http://127.0.0.1:8000/v1", "", name)
        assert FIX.search(str(info.value))
    assert RemoteModel("http://127.0.0.1:8000/v1", "", "A3B_VLLM_KEY").api_key_env == "A3B_VLLM_KEY"


def test_a_missing_or_wrong_key_is_a_clear_error_that_never_shows_the_key(served, monkeypatch):
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(RemoteError, match=f"{KEY_ENV} .*is not set") as info:
        RemoteModel(served.url, "", KEY_ENV).served_models()
    assert FIX.search(str(info.value))
    monkeypatch.setenv(KEY_ENV, "not-the-key")
    with pytest.raises(RemoteError, match="HTTP 401.*API key") as info:
        RemoteModel(served.url, "a3b-demo", KEY_ENV).generate(RemoteModel(served.url, "").build_prompt(REQUEST))
    assert "not-the-key" not in str(info.value) and KEY not in str(info.value)
    with pytest.raises(RemoteError, match="HTTP 401"):
        RemoteModel(served.url, "a3b-demo").served_models()  # no key at all
    assert KEY not in repr(RemoteModel(served.url, "a3b-demo", KEY_ENV))


# ------------------------------------------------------------------------------------------------ errors
def test_a_model_name_the_server_does_not_serve_lists_the_served_ones(served, remote):
    with pytest.raises(RemoteError, match="does not serve 'gpt-4o'; it serves 'a3b-demo'") as info:
        RemoteModel(served.url, "gpt-4o", KEY_ENV).resolve_model()
    assert FIX.search(str(info.value))
    assert remote.resolve_model() == "a3b-demo"


def test_the_servers_refusal_comes_back_in_its_words(remote):
    too_long = remote.build_prompt(user="tell me " * 3000)
    with pytest.raises(RemoteError, match="HTTP 400: the prompt has .* tokens"):
        remote.generate(too_long, max_new_tokens=8)


def test_an_unreachable_server_is_named(key_in_env):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens here once the probe closes
    with pytest.raises(RemoteError, match=f"cannot reach http://127.0.0.1:{port}/v1/models") as info:
        RemoteModel(f"http://127.0.0.1:{port}", "").served_models()
    assert FIX.search(str(info.value))


def test_a_server_that_never_answers_times_out():
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        with pytest.raises(RemoteError, match="sent nothing for 0.5 s") as info:
            RemoteModel(url, "m", timeout_s=0.5).generate(RemoteModel(url, "m").build_prompt(REQUEST))
    assert FIX.search(str(info.value))


@pytest.mark.parametrize("given, url", [("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1"),
                                        ("  https://gpu-box:30000/v1/ ", "https://gpu-box:30000/v1"),
                                        ("http://[::1]:8080/api/v1", "http://[::1]:8080/api/v1")])
def test_base_urls_are_normalized(given, url):
    assert checked_base_url(given) == url


@pytest.mark.parametrize("given, words", [("127.0.0.1:8000", "not an http(s) URL"), ("ftp://host/v1", "not an http"),
                                          ("http://user:secret@host/v1", "user name or password")])
def test_bad_base_urls_are_refused(given, words):
    with pytest.raises(RemoteError, match=re.escape(words)) as info:
        RemoteModel(given, "")
    assert FIX.search(str(info.value))


def test_what_a_remote_model_cannot_do_is_refused(remote, demo):
    prompt = remote.build_prompt(user=REQUEST)
    with pytest.raises(GenerationError, match="thinking_budget is not available") as info:
        remote.generate(prompt, thinking_budget=16)
    assert FIX.search(str(info.value))
    for setting in ({"kv_dtype": "int8"}, {"max_context": 1024}):
        with pytest.raises(GenerationError, match="the server's settings") as info:
            remote.generate(prompt, **setting)
        assert FIX.search(str(info.value))
    with pytest.raises(PromptError, match="encoded by a local model") as info:
        remote.build_prompt(user=REQUEST, images=demo.encode_images(PIXEL_IMAGES[0]))
    assert FIX.search(str(info.value))
    with pytest.raises(PromptError, match="the prompt is empty"):
        remote.build_prompt(user="  ")
    with pytest.raises(PromptError, match="has 2 \\[\\[IMG\\]\\] markers but 1 images"):
        remote.build_prompt(user="[[IMG]] [[IMG]]", images=remote.encode_images(PIXEL_IMAGES[0]))


def test_generation_can_run_inside_a_running_event_loop(remote):
    """ComfyUI runs nodes inside its own event loop; the remote calls must work there too."""
    import asyncio

    async def inside() -> str:
        return remote.generate(remote.build_prompt(user=REQUEST, images=remote.encode_images(PIXEL_IMAGES[3])),
                               **GREEDY).text

    assert asyncio.run(inside()) == expected_captions()[PIXEL_IMAGES[3].name]


def test_only_the_client_and_the_server_import_a_networking_module():
    networking = {"aiohttp", "urllib", "http", "socket", "ssl", "requests", "httpx", "huggingface_hub", "transformers"}
    allowed = {"a3b_core/services/openai_client.py": {"aiohttp", "urllib"}, "a3b_core/services/openai_server.py": {"aiohttp"}}
    root = Path(__file__).resolve().parents[1]
    found = {}
    for path in sorted([*root.glob("a3b_core/**/*.py"), *root.glob("nodes/*.py")]):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
        used = names & networking
        if used:
            found[path.relative_to(root).as_posix()] = used
    assert found == allowed
