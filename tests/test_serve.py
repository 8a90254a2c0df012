"""`python -m a3b_core serve` on the demo model, driven by the official openai client: plain and streamed answers,
images, thinking, seeds, concurrent streams decoded as batches, cancellation, errors, the API key and the host rule.
The answers are checked against the local engine's own for the same request."""
from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from a3b_core import GenerationResult, load_model
from a3b_core.serve import AnswerStream
from tests.integration.pixel_art_inputs import INPUTS, expected_captions
from tests.served import REPO, Served, start_served
from tests.test_bad_inputs import FIX

MODEL = "a3b-demo"
REQUEST = "Describe the image."  # what the demo model was trained to answer
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
PIXEL_IMAGES = sorted(INPUTS.glob("a3b_pixel_*.png"))
VIEW_IMAGES = sorted(INPUTS.parent.glob("a3b_view_*.png"))  # the multi-view workflow's inputs


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    server = start_served(tmp_path_factory.mktemp("serve"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url, api_key="not-checked", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def demo():
    return load_model(MODEL)


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def user_message(text: str, images: list[Path] = ()) -> dict:
    if not images:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(path)}} for path in images]
            + [{"type": "text", "text": text}]}


def local_answer(model, text: str, images: list[Path] = (), thinking: bool = False, **options):
    """The local engine's answer to the same request; images keep their own size, as the server keeps them."""
    encoded = model.encode_images(list(images), resize="native") if images else None
    prompt = model.build_prompt(user=text, images=encoded, thinking=thinking)
    return model.generate(prompt, **({"max_new_tokens": 200, "temperature": 0} | options))


EXTRA_FIELDS = ("top_k", "min_p", "repetition_penalty")  # not in OpenAI's API: the client sends them as extra_body


def ask(client: openai.OpenAI, text: str, images: list[Path] = (), thinking: bool = False, **options):
    extra = {"chat_template_kwargs": {"enable_thinking": thinking}} | {
        name: options.pop(name) for name in EXTRA_FIELDS if name in options}
    return client.chat.completions.create(model=MODEL, messages=[user_message(text, images)], extra_body=extra,
                                          **({"max_tokens": 200, "temperature": 0} | options))


def streamed(client: openai.OpenAI, text: str, images: list[Path] = (), thinking: bool = False,
             **options) -> tuple[str, str, list, dict]:
    """(content, reasoning, chunks, usage) of a streamed answer."""
    chunks = list(ask(client, text, images, thinking, stream=True, stream_options={"include_usage": True},
                      **options))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    return content, reasoning, chunks, chunks[-1].usage


# ------------------------------------------------------------------------------------------------ answers
def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_a_plain_answer_is_the_local_engines(client, demo):
    answer = ask(client, REQUEST, PIXEL_IMAGES[:1])
    local = local_answer(demo, REQUEST, PIXEL_IMAGES[:1])
    assert answer.choices[0].message.content == local.text
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.prompt_tokens == local.stats["prompt_tokens"]
    assert answer.usage.completion_tokens == len(local.token_ids)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_a_streamed_answer_adds_up_to_the_plain_one(client):
    content, reasoning, chunks, usage = streamed(client, REQUEST, PIXEL_IMAGES[1:2])
    plain = ask(client, REQUEST, PIXEL_IMAGES[1:2])
    assert content == plain.choices[0].message.content and reasoning == ""
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3  # it streamed, token by token
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert usage.completion_tokens == plain.usage.completion_tokens


def test_images_are_captioned_as_the_demo_model_was_trained(client):
    captions = expected_captions()
    for path in PIXEL_IMAGES:
        assert ask(client, REQUEST, [path]).choices[0].message.content == captions[path.name]


def test_max_tokens_ends_the_answer_with_length(client, demo):
    answer = ask(client, REQUEST, PIXEL_IMAGES[:1], max_completion_tokens=3)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 3
    assert answer.choices[0].message.content == local_answer(demo, REQUEST, PIXEL_IMAGES[:1], max_new_tokens=3).text


def test_stop_strings_end_the_answer_before_them_streamed_or_not(client, demo):
    full = local_answer(demo, REQUEST, PIXEL_IMAGES[:1]).text  # "pixel art of a large red heart at the centre ..."
    plain = ask(client, REQUEST, PIXEL_IMAGES[:1], stop=[" heart"]).choices[0].message.content
    content, *_ = streamed(client, REQUEST, PIXEL_IMAGES[:1], stop=" heart")
    assert plain == content == full[:full.index(" heart")]


def test_thinking_comes_back_as_reasoning_content(client, demo):
    answer = ask(client, REQUEST, PIXEL_IMAGES[2:3], thinking=True)
    local = local_answer(demo, REQUEST, PIXEL_IMAGES[2:3], thinking=True)
    message = answer.choices[0].message
    assert local.reasoning and message.reasoning_content == local.reasoning and message.content == local.text
    content, reasoning, _, _ = streamed(client, REQUEST, PIXEL_IMAGES[2:3], thinking=True)
    assert (reasoning, content) == (local.reasoning, local.text)
    assert ask(client, REQUEST, PIXEL_IMAGES[2:3]).choices[0].message.reasoning_content is None


def test_a_request_without_enable_thinking_takes_the_model_folders_default(client, demo):
    # the demo folders' config.json says a3b_default_thinking false: a plain OpenAI request gets the caption
    assert demo.default_thinking is False
    for image in PIXEL_IMAGES:
        default = client.chat.completions.create(model=MODEL, messages=[user_message(REQUEST, [image])],
                                                 max_tokens=200, temperature=0).choices[0].message
        assert default.reasoning_content is None
        assert default.content == local_answer(demo, REQUEST, [image]).text
    heart = client.chat.completions.create(model=MODEL, messages=[user_message(REQUEST, PIXEL_IMAGES[:1])])
    assert "heart" in heart.choices[0].message.content


def test_a_seed_gives_the_same_sampled_answer_and_other_seeds_differ(client, demo):
    wild = {"temperature": 5.0, "top_p": 1.0, "top_k": 0, "max_tokens": 24}  # far from the model's own answer
    first = ask(client, REQUEST, seed=5, **wild).choices[0].message.content
    assert ask(client, REQUEST, seed=5, **wild).choices[0].message.content == first
    assert first == local_answer(demo, REQUEST, seed=5, max_new_tokens=24, temperature=5.0, top_p=1.0, top_k=0).text
    others = {ask(client, REQUEST, seed=seed, **wild).choices[0].message.content for seed in (6, 7, 8)}
    assert others - {first}


@pytest.mark.parametrize("options, like_greedy", [
    ({"temperature": 5.0, "top_k": 0, "top_p": 1.0, "presence_penalty": 0}, False),
    ({"temperature": 5.0, "top_k": 1, "top_p": 1.0, "presence_penalty": 0}, True),
    ({"temperature": 5.0, "top_k": 0, "top_p": 0.001, "presence_penalty": 0}, True),
    ({"temperature": 5.0, "top_k": 0, "top_p": 1.0, "min_p": 1.0, "presence_penalty": 0}, True),
    ({"temperature": 0, "presence_penalty": -100.0}, False),
    ({"temperature": 0, "repetition_penalty": 100.0}, False),
], ids=["sampled", "top_k", "top_p", "min_p", "presence_penalty", "repetition_penalty"])
def test_each_sampler_value_acts_as_in_the_local_engine(client, demo, options, like_greedy):
    greedy = local_answer(demo, REQUEST, max_new_tokens=24).text
    local = local_answer(demo, REQUEST, max_new_tokens=24, seed=3, **options).text
    assert ask(client, REQUEST, max_tokens=24, seed=3, **options).choices[0].message.content == local
    assert (local == greedy) is like_greedy


def test_eight_concurrent_streams_are_batched_and_each_is_right(served, client, demo):
    requests = [(REQUEST, [path]) for path in PIXEL_IMAGES + VIEW_IMAGES] + [(REQUEST, [])]
    assert len(requests) == 8
    expected = [local_answer(demo, text, images).text for text, images in requests]
    log_before = len(served.log_text())
    start = threading.Barrier(len(requests))

    def run(request: tuple) -> str:
        start.wait()
        return streamed(client, *request)[0]

    with ThreadPoolExecutor(len(requests)) as pool:
        got = list(pool.map(run, requests))
    assert got == expected
    batches = [int(n) for n in re.findall(r"batch of (\d+)", served.log_text()[log_before:])]
    assert len(batches) == 8 and max(batches) > 1, batches


def test_a_disconnected_stream_is_cancelled_and_frees_the_slot(served, client):
    long_run = {"max_tokens": 3000, "presence_penalty": -100}  # repeats its first token: never meets its end token
    log_before = len(served.log_text())
    stream = ask(client, REQUEST, stream=True, **long_run)
    for _, _chunk in zip(range(5), stream):
        pass
    stream.close()
    served.wait_idle()
    cancelled = re.findall(r"(\d+) new tokens, cancelled, batch of 1 \(client gone\)", served.log_text()[log_before:])
    assert len(cancelled) == 1 and int(cancelled[0]) < 300, served.log_text()[log_before:]
    assert ask(client, REQUEST, PIXEL_IMAGES[:1]).choices[0].message.content  # the next request is served


# ------------------------------------------------------------------------------------------------ errors
def _still_serving(client) -> None:
    assert ask(client, REQUEST, PIXEL_IMAGES[:1]).choices[0].message.content == expected_captions()[
        PIXEL_IMAGES[0].name]


def _image_message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": REQUEST}]}]


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64,@@not*base64@@", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"plain text, not a picture").decode(), "does not hold an image"),
    ("https://example.com/cat.png", "not a data URL"),
], ids=["bad-base64", "not-an-image", "http-url"])
def test_bad_images_are_refused_and_the_server_goes_on(client, url, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=_image_message(url), max_tokens=8)
    message = info.value.body["message"]
    assert words in message and "messages[0].content[0].image_url" in message and FIX.search(message), message
    _still_serving(client)


def test_an_unknown_model_is_not_found_and_the_server_goes_on(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[user_message(REQUEST)], max_tokens=8)
    assert info.value.body["code"] == "model_not_found" and MODEL in info.value.body["message"]
    _still_serving(client)


def test_a_prompt_longer_than_the_context_is_refused_and_the_server_goes_on(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[user_message("tell me " * 3000)], max_tokens=8)
    assert info.value.body["code"] == "context_length_exceeded" and FIX.search(info.value.body["message"])
    with pytest.raises(openai.BadRequestError, match="max_tokens is 5000"):
        client.chat.completions.create(model=MODEL, messages=[user_message(REQUEST)], max_tokens=5000)
    _still_serving(client)


def test_an_oversized_body_is_refused_and_the_server_goes_on(client):
    huge = "data:image/png;base64," + "A" * (33 * 2**20)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=_image_message(huge), max_tokens=8)
    assert info.value.status_code == 413 and "larger than 32 MiB" in info.value.body["message"]
    _still_serving(client)


@pytest.mark.parametrize("options, param", [
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 2}, "n"), ({"seed": "x"}, "seed"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
])
def test_bad_sampling_values_are_refused(client, options, param):
    with pytest.raises(openai.BadRequestError, match=param):
        client.chat.completions.create(model=MODEL, messages=[user_message(REQUEST)], max_tokens=8,
                                       **options)


def test_errors_during_a_stream_are_refused_before_it_starts(client):
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        list(ask(client, REQUEST, stream=True, presence_penalty=1000.0))
    _still_serving(client)


def test_max_batch_size_caps_the_batches(tmp_path, demo):
    served = start_served(tmp_path, "--max-batch-size", "2")
    try:
        client = openai.OpenAI(base_url=served.url, api_key="not-checked", max_retries=0, timeout=120)
        start = threading.Barrier(6)

        def run(path: Path) -> str:
            start.wait()
            return ask(client, REQUEST, [path]).choices[0].message.content

        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(run, (PIXEL_IMAGES + PIXEL_IMAGES)[:6]))
        assert got == [local_answer(demo, REQUEST, [path]).text for path in (PIXEL_IMAGES + PIXEL_IMAGES)[:6]]
    finally:
        served.stop()
    batches = [int(n) for n in re.findall(r"batch of (\d+)", served.log_text())]
    assert len(batches) == 6 and max(batches) == 2, batches


def test_the_load_options_reach_the_engine(tmp_path):
    served = start_served(tmp_path, "--max-context", "1024", "--kv-cache", "int8", "--device", "cpu")
    try:
        client = openai.OpenAI(base_url=served.url, api_key="not-checked", max_retries=0, timeout=120)
        assert client.models.list().data[0].max_model_len == 1024
        with pytest.raises(openai.BadRequestError, match="context holds 1024 tokens"):
            client.chat.completions.create(model=MODEL, messages=[user_message(REQUEST)], max_tokens=1500)
    finally:
        served.stop()
    refused = _serve_command("--device", "tpu")
    assert refused.returncode == 2 and "device 'tpu'" in refused.stderr and FIX.search(refused.stderr), \
        refused.stderr


# ------------------------------------------------------------------------------------------------ security
def test_an_api_key_is_required_when_set_and_never_logged(tmp_path):
    key = "a3b-test-key-4f1c9e"
    served = start_served(tmp_path, "--api-key-env", "A3B_SERVE_TEST_KEY", env={"A3B_SERVE_TEST_KEY": key})
    try:
        with pytest.raises(openai.AuthenticationError, match="API key"):
            openai.OpenAI(base_url=served.url, api_key="wrong-key", max_retries=0).models.list()
        with pytest.raises(urllib.error.HTTPError) as info:  # no Authorization header at all
            urllib.request.urlopen(served.url + "/models", timeout=30)
        assert info.value.code == 401
        right = openai.OpenAI(base_url=served.url, api_key=key, max_retries=0)
        assert ask(right, REQUEST, PIXEL_IMAGES[:1]).choices[0].message.content
        assert served.health()["status"] == "ok"  # the health check needs no key
    finally:
        served.stop()
    assert key not in served.log_text()


def _serve_command(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "a3b_core", "serve", MODEL, "--port", "0", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=env)


def test_a_network_address_without_an_api_key_refuses_to_start():
    done = _serve_command("--host", "0.0.0.0")
    assert done.returncode == 2 and "A3B server:" not in done.stdout
    assert "needs an API key" in done.stderr and "--api-key-env" in done.stderr, done.stderr


def test_an_api_key_variable_that_is_not_set_refuses_to_start():
    env = {k: v for k, v in os.environ.items() if k != "A3B_UNSET_KEY"}
    done = _serve_command("--api-key-env", "A3B_UNSET_KEY", env=env)
    assert done.returncode == 2 and "A3B_UNSET_KEY is not set" in done.stderr, done.stderr


# ------------------------------------------------------------------------------------------------ streamed deltas
@pytest.mark.parametrize("thinking, live, stops, reasoning, answer", [
    (True, "<think>\nLet me look.\n</think>\n\nA red heart. STOP and more", ("STOP",), "Let me look.",
     "A red heart."),
    (False, "A small star at the top.\n\nEND", ("\n\nEND", "never"), "", "A small star at the top."),
    (False, "<think>\nstray</think>\n\nAn answer with <b>tags</b> in it.", (), "stray",
     "An answer with <b>tags</b> in it."),
])
def test_streamed_deltas_add_up_to_the_final_answer_whatever_the_pieces(thinking, live, stops, reasoning, answer):
    """Text arriving a character at a time (tags and stop strings split anywhere) still streams as pieces that add up
    to the engine's final reasoning and answer: nothing is sent that a later token could take back."""
    stream = AnswerStream(thinking, stops)
    sent = {"reasoning_content": "", "content": ""}
    for end in range(1, len(live) + 1):
        for name, piece in stream.update(live[:end]).items():
            sent[name] += piece
    for name, piece in stream.finish(GenerationResult(answer, reasoning, [], {}, "eos")).items():
        sent[name] += piece
    assert sent == {"reasoning_content": reasoning, "content": answer}
