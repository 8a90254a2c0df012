"""`python -m a3b_core serve` on the demo model, driven by the official openai client: plain and streamed answers,
images, thinking, seeds, concurrent streams decoded as batches, cancellation, errors, the API key and the host rule;
and hostile requests (huge or many images, PostScript, megabytes of text, foreign origins, stalled connections), whose
refusals are measured by what the server process does. The answers are checked against the local engine's own for
the same request."""
from __future__ import annotations

import base64
import http.client
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from PIL import Image

from a3b_core import GenerationResult, load_model
from a3b_core.__main__ import main
from a3b_core.services.openai_requests import (MAX_IMAGES_PER_REQUEST, MAX_REQUEST_PIXELS, MAX_STOP_CHARS,
                                               MAX_STOP_STRINGS, RequestError, parse_chat_request)
from a3b_core.services.openai_server import IDLE_TIMEOUT_S, AnswerStream
from tests.hostile_inputs import EPS, blank_png, cpu_seconds, fake_ghostscript, memory_kib, reset_peak
from tests.integration.pixel_art_inputs import INPUTS, expected_captions
from tests.served import REPO, Served, start_served
from tests.synthetic_adapters import write_demo_adapter
from tests.test_bad_inputs import FIX

MODEL = "a3b-demo"
REQUEST = "Describe the image."  # what the demo model was trained to answer
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
PIXEL_IMAGES = sorted(INPUTS.glob("a3b_pixel_*.png"))
VIEW_IMAGES = sorted(INPUTS.parent.glob("a3b_view_*.png"))  # the multi-view workflow's inputs
ALLOWED_ORIGIN = "http://localhost:3000"  # the module's server is started with --allow-origin for it


@pytest.fixture(scope="module")
def ghostscript(tmp_path_factory) -> tuple[dict[str, str], Path]:
    """The environment the module's server runs in (a stand-in gs first on its PATH) and the marker gs leaves."""
    return fake_ghostscript(tmp_path_factory.mktemp("gs"))


@pytest.fixture(scope="module")
def served(tmp_path_factory, ghostscript) -> Served:
    server = start_served(tmp_path_factory.mktemp("serve"), "--allow-origin", ALLOWED_ORIGIN, env=ghostscript[0])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url, api_key="not-checked", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def demo():
    return load_model(MODEL)


def data_url(path: Path | bytes) -> str:
    data = path if isinstance(path, bytes) else path.read_bytes()
    return "data:image/png;base64," + base64.b64encode(data).decode()


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
    ("data:image/png;base64," + base64.b64encode(b"plain text, not a picture").decode(), "not an image in a format"),
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


def test_an_allow_origin_that_is_not_an_origin_refuses_to_start():
    done = _serve_command("--allow-origin", "localhost:3000/app")
    assert done.returncode == 2 and "'localhost:3000/app' is not a web origin" in done.stderr, done.stderr


def test_an_api_key_variable_that_is_not_set_refuses_to_start():
    env = {k: v for k, v in os.environ.items() if k != "A3B_UNSET_KEY"}
    done = _serve_command("--api-key-env", "A3B_UNSET_KEY", env=env)
    assert done.returncode == 2 and "A3B_UNSET_KEY is not set" in done.stderr, done.stderr


# ------------------------------------------------------------------------------------------------ hostile requests
def _images_message(urls: list[str], text: str = REQUEST) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}} for url in urls]
             + [{"type": "text", "text": text}]}]


HUGE_PNG = blank_png(11500, 11500)  # 16 KB of file, 132 million pixels
TINY_PNG = blank_png(1, 1)
HOSTILE = {  # what a hostile client sends, and what its refusal says
    "sixty-huge-images": (_images_message([data_url(HUGE_PNG)] * 60), f"at most {MAX_REQUEST_PIXELS:,} in all"),
    "ten-thousand-images": (_images_message([data_url(TINY_PNG)] * 10_000),
                            f"use at most {MAX_IMAGES_PER_REQUEST} per request"),
    "eight-megabytes-of-text": ([user_message("tell me " * 2**20)], "the prompt has at least"),
    "postscript-image": (_images_message([data_url(EPS)]), "not an image in a format the pack reads"),
}


def test_refusals_of_hostile_requests_never_wait_for_another_clients_answer(served, client, ghostscript):
    """Each hostile request is refused with an OpenAI 400 while another client's long answer is still being
    generated: the cheap bounds are checked before anything costly, off the worker. That answer's client leaves only
    afterwards, and the log shows it cancelled short of its 3000 tokens; a refusal that waited for the worker would
    have come after all 3000. No program ran for the PostScript image."""
    log_before = len(served.log_text())
    stream = ask(client, REQUEST, stream=True, max_tokens=3000, presence_penalty=-100)
    for _, _chunk in zip(range(5), stream):
        pass
    for name, (messages, words) in HOSTILE.items():
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
        assert words in info.value.body["message"] and FIX.search(info.value.body["message"]), (name, info.value.body)
    stream.close()
    served.wait_idle()
    cancelled = re.findall(r"(\d+) new tokens, cancelled, batch of 1 \(client gone\)", served.log_text()[log_before:])
    assert len(cancelled) == 1 and int(cancelled[0]) < 3000, served.log_text()[log_before:]
    assert not ghostscript[1].exists()
    _still_serving(client)


def test_sixty_huge_images_are_refused_from_their_headers(served, client):
    """60 copies of a 16 KB PNG of 11500x11500 pixels (2.4 MB of JSON): refused before any is decoded. The server's
    peak memory grows by less than one of them decoded would take (132 MB at one byte per pixel), and it spends less
    CPU time on the whole request than this process spends decoding one."""
    started = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(io.BytesIO(HUGE_PNG)) as image:
            image.load()
    one_decode = time.process_time() - started
    served.wait_idle()
    pid = served.process.pid
    rss_before, cpu_before = memory_kib(pid)["VmRSS"], cpu_seconds(pid)
    reset_peak(pid)
    messages, words = HOSTILE["sixty-huge-images"]
    with pytest.raises(openai.BadRequestError, match=words):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    grown = (memory_kib(pid)["VmHWM"] - rss_before) * 1024
    assert grown < 11500 * 11500 / 4, f"the server's peak grew by {grown / 2**20:.0f} MiB"
    assert cpu_seconds(pid) - cpu_before < one_decode, (cpu_seconds(pid) - cpu_before, one_decode)
    _still_serving(client)


def test_megabytes_of_text_are_refused_without_tokenizing_them(served, client, demo):
    """8 MiB of text cannot fit a 4096-token context whatever it says: refused by the lower bound from its length,
    with less CPU time than this process spends tokenizing it and a peak that grows by a few copies of it."""
    (message,), words = HOSTILE["eight-megabytes-of-text"]
    started = time.process_time()
    demo.tokenizer.encode(message["content"])
    tokenizing = time.process_time() - started
    served.wait_idle()
    pid = served.process.pid
    rss_before, cpu_before = memory_kib(pid)["VmRSS"], cpu_seconds(pid)
    reset_peak(pid)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[message], max_tokens=8)
    assert info.value.body["code"] == "context_length_exceeded" and words in info.value.body["message"]
    grown = (memory_kib(pid)["VmHWM"] - rss_before) * 1024
    assert grown < 8 * len(message["content"]), f"the server's peak grew by {grown / 2**20:.0f} MiB"
    assert cpu_seconds(pid) - cpu_before < tokenizing, (cpu_seconds(pid) - cpu_before, tokenizing)


def test_a_thirty_view_request_is_answered_and_its_pixels_given_back(served, client):
    """30 views (the multi-angle workflow's three, ten times) pass every bound and are answered; once idle, the
    server holds no decoded pixels."""
    views = (VIEW_IMAGES * 10)[:30]
    answer = client.chat.completions.create(model=MODEL, messages=_images_message([data_url(p) for p in views]),
                                            max_tokens=16, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.prompt_tokens > 30 * 36
    assert served.wait_idle()["held_pixels"] == 0


def test_thirty_four_megapixel_views_pass_the_image_bounds_and_meet_the_models_context(client):
    """30 views of 2048x2048 are within the image bounds; on the demo model's 4096-token context they are refused
    for the context alone (by the lower bound, before any is decoded)."""
    views = [data_url(blank_png(2048, 2048))] * 30
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=_images_message(views), max_tokens=8)
    assert info.value.body["code"] == "context_length_exceeded" and "at least" in info.value.body["message"]


def _raw(served: Served, method: str, path: str, body: bytes = b"", **headers: str) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of one request sent as given (http.client adds only Host, if not given)."""
    address = urllib.parse.urlsplit(served.root)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=120)
    try:
        connection.request(method, path, body=body, headers={k.replace("_", "-"): v for k, v in headers.items()})
        response = connection.getresponse()
        data = response.read()
        return response.status, dict(response.headers), json.loads(data) if data else {}
    finally:
        connection.close()


CHAT = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": REQUEST}], "max_tokens": 4}).encode()


@pytest.mark.parametrize("method, body, headers, status, code", [
    ("POST", CHAT, {"Content_Type": "application/json", "Origin": "http://evil.example"}, 403, "origin_not_allowed"),
    ("POST", CHAT, {"Content_Type": "text/plain"}, 415, None),
    ("POST", CHAT, {"Content_Type": "application/json", "Host": "evil.example:8000"}, 403, "host_not_allowed"),
    ("GET", b"", {"Origin": "null"}, 403, "origin_not_allowed"),
    ("OPTIONS", b"", {"Origin": "http://evil.example", "Access_Control_Request_Method": "POST"}, 403,
     "origin_not_allowed"),
    ("POST", b"[" * 200_000 + b"]" * 200_000, {"Content_Type": "application/json"}, 400, None),
], ids=["foreign-origin", "text-plain", "foreign-host", "null-origin-get", "foreign-preflight", "deep-json"])
def test_requests_a_web_page_could_forge_are_refused_as_openai_errors(served, method, body, headers, status, code):
    """What a page of another site can make a browser send (a simple POST with its Origin, text/plain, a rebound Host
    name) is refused, and so is 200,000-deep JSON: each an OpenAI error object with a 4xx status."""
    path = "/health" if method == "GET" else "/v1/chat/completions"
    got, _, answer = _raw(served, method, path, body, **headers)
    assert got == status and answer["error"]["code"] == code and FIX.search(answer["error"]["message"]), answer


def test_an_allowed_origin_may_ask_and_read_the_answer(served):
    status, headers, _ = _raw(served, "OPTIONS", "/v1/chat/completions", Origin=ALLOWED_ORIGIN,
                              Access_Control_Request_Method="POST", Access_Control_Request_Headers="content-type")
    assert status == 204 and "Content-Type" in headers["Access-Control-Allow-Headers"]
    assert headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    status, headers, answer = _raw(served, "POST", "/v1/chat/completions", CHAT, Origin=ALLOWED_ORIGIN,
                                   Content_Type="application/json")
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    assert answer["choices"][0]["message"]["content"]


def test_a_connection_that_never_finishes_its_header_is_closed(served):
    """Half a request header, then nothing: the server closes the connection after IDLE_TIMEOUT_S (it would keep it
    for an hour), so stalled connections cannot use up its file handles."""
    address = urllib.parse.urlsplit(served.root)
    with socket.create_connection((address.hostname, address.port), timeout=IDLE_TIMEOUT_S + 60) as connection:
        connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
        assert connection.recv(1024) == b""  # closed, not timed out


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


def test_stop_strings_are_bounded_in_number_and_length():
    body = {"model": MODEL, "messages": [user_message(REQUEST)]}
    assert parse_chat_request(body | {"stop": ["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS}, (MODEL,), False).stop
    for stop in (["x"] * (MAX_STOP_STRINGS + 1), ["x" * (MAX_STOP_CHARS + 1)]):
        with pytest.raises(RequestError, match=f"at most {MAX_STOP_STRINGS} stop strings") as info:
            parse_chat_request(body | {"stop": stop}, (MODEL,), False)
        assert info.value.param == "stop" and FIX.search(str(info.value))


def _stream_cpu_seconds(stops: tuple[str, ...], text: str) -> float:
    """CPU seconds AnswerStream takes for `text` arriving 8 characters at a time (best of three)."""
    best = float("inf")
    for _ in range(3):
        stream = AnswerStream(False, stops)
        started = time.process_time()
        for end in range(8, len(text) + 1, 8):
            stream.update(text[:end])
        best = min(best, time.process_time() - started)
    return best


def test_holding_back_stop_strings_costs_each_update_the_same_however_long_the_answer():
    """The most and longest stop strings allowed, none of them in the answer: streaming a 40,000-character answer
    8 characters at a time costs at most a few times what it costs without stop strings (measured: 2x). Searching
    and holding back from the start of the answer, or from each stop string's every length, at each update costs
    over 20 times as much."""
    text = "a red heart at the centre. " * 1500
    stops = tuple(chr(0x2460 + number) * MAX_STOP_CHARS for number in range(MAX_STOP_STRINGS))
    with_stops, without = _stream_cpu_seconds(stops, text), _stream_cpu_seconds((), text)
    assert with_stops < 6 * without + 0.05, (with_stops, without)


# ------------------------------------------------------------------------------------------------ named adapters
def test_a_named_lora_is_its_own_model_and_the_base_stays_the_base(tmp_path, demo):
    """serve --lora-module NAME=PATH: /v1/models lists the model and NAME; requests for NAME run with the adapter
    (the local engine's answer with it), requests for the model without it, whatever came before."""
    adapter = write_demo_adapter(tmp_path / "style")
    server = start_served(tmp_path, "--lora-module", f"style={adapter}")
    try:
        client = openai.OpenAI(base_url=server.url, api_key="not-checked", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [MODEL, "style"]
        message = [user_message(REQUEST, PIXEL_IMAGES[:1])]
        options = {"max_tokens": 200, "temperature": 0,
                   "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
        styled = client.chat.completions.create(model="style", messages=message, **options)
        base = client.chat.completions.create(model=MODEL, messages=message, **options)
        assert styled.model == "style" and base.model == MODEL
        assert base.choices[0].message.content == local_answer(demo, REQUEST, PIXEL_IMAGES[:1]).text
        demo.set_loras([(adapter, 1.0)])
        try:
            assert styled.choices[0].message.content == local_answer(demo, REQUEST, PIXEL_IMAGES[:1]).text
        finally:
            demo.set_loras([])
        assert styled.choices[0].message.content != base.choices[0].message.content
    finally:
        server.stop()


@pytest.mark.parametrize("choice", ["style", "=x", f"{MODEL}=x"])
def test_a_lora_module_without_a_name_of_its_own_is_refused(choice):
    assert main(["serve", MODEL, "--port", "0", "--lora-module", choice]) == 2
