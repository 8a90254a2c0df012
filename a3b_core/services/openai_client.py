"""A model behind an OpenAI-compatible server (`python -m a3b_core serve`, vLLM, SGLang, llama.cpp's llama-server),
used through the same calls as a local A3BModel: encode_images, build_prompt, generate, generate_batch.

Images are resized here exactly as the local engine resizes them, then sent as PNG data URLs; a server that keeps an
image's own size (ours, vLLM and SGLang do for Qwen3.5, within their pixel limits) then sees the pixels a local model
would. A prompt is the conversation as chat messages (openai_messages.py); the server renders the chat template, and
thinking travels as chat_template_kwargs.enable_thinking (left out when the prompt leaves it to the server). Answers stream over server-sent events; generate_batch sends
its prompts as parallel requests. `should_stop` is polled while waiting, and True closes the connections, which
cancels the generations on servers that notice a client leaving (ours, vLLM and SGLang do).

The API key is read from an environment variable at each request: it is never stored, logged or shown. Only
variables whose names start with A3B_ may be named, so a shared workflow cannot send other secrets of the
environment to a server of its choosing.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import re
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import aiohttp

from .. import GenerationError, GenerationResult, ImageError, PromptError, RemoteError, Turn, split_batch
from ..media.image import load_resized
from ..runtime.options import SAMPLER_FIELDS, GenerationOptions
from .openai_messages import messages_from_conversation

API_KEY_ENV = re.compile(r"A3B_[A-Za-z0-9_]*")
STOP_POLL_S = 0.05
STOP_REASONS = {"stop": "eos", "length": "max_new_tokens"}


@dataclass(frozen=True)
class RemoteImages:
    """Images ready to send: one PNG data URL each, resized as the local engine would resize them."""
    urls: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, index: int | slice) -> "RemoteImages":
        return RemoteImages(self.urls[index] if isinstance(index, slice) else (self.urls[index],))

    def __add__(self, other: "RemoteImages") -> "RemoteImages":
        return RemoteImages(self.urls + other.urls)


@dataclass(frozen=True)
class RemoteChat:
    """A prompt for a remote model: the chat messages and the thinking mode (None: the server's default)."""
    messages: tuple[dict, ...]
    thinking: bool | None


class RemoteModel:
    def __init__(self, base_url: str, model: str, api_key_env: str = "", timeout_s: float = 600.0):
        self.base_url = checked_base_url(base_url)
        self.model = model.strip()
        if api_key_env and not API_KEY_ENV.fullmatch(api_key_env):
            raise RemoteError(f"api_key_env {api_key_env!r} is not allowed: use an environment variable whose name "
                              "starts with A3B_ (for example A3B_API_KEY) to hold the key, so that a workflow cannot "
                              "send other secrets of your environment. Leave it empty for a server without a key.")
        self.api_key_env = api_key_env
        if not timeout_s > 0:
            raise RemoteError(f"timeout is {timeout_s}; give the seconds to wait for the server, more than 0.")
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"RemoteModel({self.base_url!r}, {self.model!r})"

    @property
    def caption_prompt(self) -> None:
        """A server does not say its model folder's captioning request: callers fall back to their own."""
        return None

    # ------------------------------------------------------------------------------------------- the server
    def _headers(self) -> dict[str, str]:
        if not self.api_key_env:
            return {}
        key = os.environ.get(self.api_key_env, "").strip()
        if not key:
            raise RemoteError(f"the environment variable {self.api_key_env} (api_key_env) is not set or empty. Set "
                              "it to the server's API key in the environment ComfyUI runs in, or clear api_key_env "
                              "for a server without a key.")
        return {"Authorization": f"Bearer {key}"}

    def _timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s, sock_read=self.timeout_s)

    def served_models(self) -> list[str]:
        """The model ids GET /models lists."""
        async def fetch() -> dict:
            async with aiohttp.ClientSession(timeout=self._timeout()) as session:
                with self._reporting("/models"):
                    async with self._request(session, "GET", "/models") as response:
                        return await _json_answer(response, self._url("/models"))
        answer = _run(fetch())
        try:
            return [entry["id"] for entry in answer["data"]]
        except (KeyError, TypeError):
            raise RemoteError(f"{self._url('/models')} did not answer with an OpenAI model list; check that base_url "
                              "points at an OpenAI-compatible API (it usually ends in /v1).") from None

    def resolve_model(self) -> str:
        """The model name to send: the one given, checked against the server's list, or the server's only model."""
        served = self.served_models()
        if self.model and self.model in served:
            return self.model
        listed = ", ".join(map(repr, served)) or "none"
        if self.model:
            raise RemoteError(f"the server at {self.base_url} does not serve {self.model!r}; it serves {listed}. Set "
                              "model to one of those, or leave it empty to use the server's only model.")
        if len(served) != 1:
            raise RemoteError(f"the server at {self.base_url} serves {listed}; set model to the one to use.")
        return served[0]

    def _url(self, path: str) -> str:
        return self.base_url + path

    def _request(self, session: aiohttp.ClientSession, method: str, path: str, body: dict | None = None):
        return session.request(method, self._url(path), json=body, headers=self._headers())

    @contextlib.contextmanager
    def _reporting(self, path: str):
        """Connection failures and timeouts of a request to `path` as RemoteErrors that say what to check."""
        url = self._url(path)
        try:
            yield
        except asyncio.TimeoutError:
            raise RemoteError(f"{url} sent nothing for {self.timeout_s:g} s; the server is busy or stuck. Raise "
                              "timeout, or check the server.") from None
        except aiohttp.ClientError as exc:
            raise RemoteError(f"cannot reach {url} ({exc}). Check that the server is running and that base_url is "
                              "right (e.g. http://127.0.0.1:8000/v1).") from None

    # ------------------------------------------------------------------------------------------- images
    def encode_images(self, images, size: int = 384, resize: str = "stretch", srgb: bool = True,
                      background: tuple[int, int, int] = (255, 255, 255),
                      progress: Callable[[int, int], None] | None = None) -> RemoteImages:
        """Any images (paths, PIL, arrays, a ComfyUI IMAGE batch) -> PNG data URLs of the pixels the local engine
        would encode (sRGB, alpha over `background`, resized by `resize` to `size`)."""
        items = split_batch(images)
        urls = []
        for number, item in enumerate(items, start=1):
            try:
                urls.append(self.preprocess_image(item, size, resize, srgb, background))
            except ImageError as exc:  # named by its place in the batch, as the local engine names it
                raise ImageError(f"Image {number} of {len(items)}: {exc}") from exc
            if progress is not None:
                progress(number, len(items))
        return RemoteImages(tuple(urls))

    @staticmethod
    def preprocess_image(image, size: int = 384, resize: str = "stretch", srgb: bool = True,
                         background: tuple[int, int, int] = (255, 255, 255)) -> str:
        """One image -> the PNG data URL of the pixels the local engine would encode (a large file decoded shrunk,
        as load_resized decodes it for a local model)."""
        png = io.BytesIO()
        load_resized(image, size, resize, background=background, srgb=srgb).save(png, format="PNG")
        return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode("ascii")

    def encode_video(self, video, **options) -> RemoteImages:
        """Videos are read by the local engine only: sampling and timestamps would have to match the server's."""
        raise RemoteError(f"{self.base_url}: a remote model does not take videos here. Connect an A3B Model Loader "
                          "(a local model) to A3B Video Encode instead.")

    # ------------------------------------------------------------------------------------------- prompts
    def build_prompt(self, user: str = "", system: str | None = None, images: RemoteImages | None = None,
                     thinking: bool | None = None, history: Sequence[Turn] = ()) -> RemoteChat:
        images = images if images is not None else RemoteImages(())
        if not isinstance(images, RemoteImages):
            raise PromptError(f"images is a {type(images).__name__}: they were encoded by a local model. Connect the "
                              "A3B Remote Model to the A3B Image Encode node as well, so the images are prepared "
                              "for the remote server.")
        user_images = len(images) - sum(turn.num_images for turn in history)
        if not user.strip() and user_images <= 0:
            raise PromptError("the prompt is empty: the user text is blank and no image was given. Write a request in "
                              "the user text or connect an image.")
        messages = messages_from_conversation(user, system, history, images.urls)
        return RemoteChat(tuple(messages), None if thinking is None else bool(thinking))

    # ------------------------------------------------------------------------------------------- generation
    def generate(self, prompt: RemoteChat, *, on_text: Callable[[str], None] | None = None,
                 **options) -> GenerationResult:
        """One answer; the options are those of A3BModel.generate. on_text gets the whole text so far."""
        stream = (lambda _index, text: on_text(text)) if on_text is not None else None
        return self.generate_batch([prompt], on_text=stream, **options)[0]

    def generate_batch(self, prompts: Sequence[RemoteChat], *, on_text: Callable[[int, str], None] | None = None,
                       should_stop: Callable[[], bool] | None = None, **options) -> list[GenerationResult]:
        """One answer per prompt, requested in parallel; on_text(index, text so far); the options are
        GenerationOptions' fields, less the local engine's own (thinking_budget, kv_dtype, max_context). Stopped
        (should_stop), the results hold what had arrived, with stop_reason "cancelled"."""
        settings = GenerationOptions(**options)
        if settings.thinking_budget is not None:
            raise GenerationError("thinking_budget is not available for remote models (OpenAI-compatible servers have "
                                  "no such setting). Set it to 0, and limit the whole answer with max_new_tokens.")
        if settings.kv_dtype is not None or settings.max_context is not None:
            raise GenerationError("kv_dtype and max_context are the server's settings, not a request's; leave them "
                                  "out and set them where the server is started.")
        if not prompts or not all(isinstance(p, RemoteChat) for p in prompts):
            raise PromptError("prompts must be a non-empty list of prompts built by the remote model's build_prompt.")
        model = self.model or self.resolve_model()
        sampling = {name: getattr(settings, name) for name in SAMPLER_FIELDS}
        stops = [settings.stop] if isinstance(settings.stop, str) else list(settings.stop)
        body = {"model": model, "max_tokens": settings.max_new_tokens, "seed": settings.seed, "stream": True,
                "stream_options": {"include_usage": True}} | {k: v for k, v in sampling.items() if v is not None}
        if stops:
            body["stop"] = stops
        bodies = [body | {"messages": list(p.messages)} | _thinking_switch(p.thinking) for p in prompts]
        return _run(self._stream_all(bodies, stops, on_text, should_stop or (lambda: False)))

    async def _stream_all(self, bodies: list[dict], stops: list[str], on_text: Callable[[int, str], None] | None,
                          should_stop: Callable[[], bool]) -> list[GenerationResult]:
        answers = [_Answer(bool(stops)) for _ in bodies]
        async with aiohttp.ClientSession(timeout=self._timeout()) as session:
            tasks = {asyncio.create_task(self._stream(session, body, answer, index, on_text)): answer
                     for index, (body, answer) in enumerate(zip(bodies, answers))}
            pending = set(tasks)
            try:
                while pending:
                    done, pending = await asyncio.wait(pending, timeout=STOP_POLL_S,
                                                       return_when=asyncio.FIRST_EXCEPTION)
                    for task in done:
                        if task.exception() is not None:
                            raise task.exception()
                    if pending and should_stop():
                        for task in pending:
                            tasks[task].stop_reason = "cancelled"
                        break
            finally:
                for task in pending:
                    task.cancel()  # closes its connection, which cancels its generation on the server
                await asyncio.gather(*pending, return_exceptions=True)
        results = [answer.result() for answer in answers]
        for index, (answer, result) in enumerate(zip(answers, results)):
            if on_text is not None and result.full_text != answer.live_text:
                on_text(index, result.full_text)  # as the local engine: the last call carries the whole output
        return results

    async def _stream(self, session: aiohttp.ClientSession, body: dict, answer: "_Answer", index: int,
                      on_text: Callable[[int, str], None] | None) -> None:
        url = self._url("/chat/completions")
        with self._reporting("/chat/completions"):
            async with self._request(session, "POST", "/chat/completions", body) as response:
                if response.status != 200:
                    await _json_answer(response, url)
                async for data in _server_sent_data(response):
                    if data == "[DONE]":
                        break
                    try:
                        event = json.loads(data)
                    except json.JSONDecodeError:
                        raise RemoteError(f"{url} sent an event that is not JSON: {data[:200]!r}") from None
                    if "error" in event:
                        raise RemoteError(f"{url} failed while answering: {_error_text(event)}")
                    if answer.add(event) and on_text is not None:
                        on_text(index, answer.live_text)


def _thinking_switch(thinking: bool | None) -> dict:
    """The request fields that ask for thinking on or off; none when the prompt leaves it to the served model."""
    return {} if thinking is None else {"chat_template_kwargs": {"enable_thinking": thinking}}


class _Answer:
    """One streamed answer as it arrives."""

    def __init__(self, has_stops: bool):
        self.has_stops = has_stops
        self.reasoning = ""
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self.usage: dict = {}
        self.started = time.perf_counter()
        self.first_token_at: float | None = None

    def add(self, event: dict) -> bool:
        """Takes one chunk; returns whether the text grew."""
        self.usage = event.get("usage") or self.usage
        grew = False
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
            content = delta.get("content") or ""
            if reasoning or content:
                self.first_token_at = self.first_token_at or time.perf_counter()
                self.reasoning += reasoning
                self.text += content
                grew = True
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return grew

    @property
    def live_text(self) -> str:
        """As the local engine streams it: the reasoning in an open think block, then the answer."""
        if not self.reasoning:
            return self.text
        return f"<think>\n{self.reasoning}" + (f"\n</think>\n\n{self.text}" if self.text else "")

    def result(self) -> GenerationResult:
        reason = self.stop_reason or STOP_REASONS.get(self.finish_reason, self.finish_reason or "eos")
        if reason == "eos" and self.has_stops:
            reason = "stop"  # the end token or a stop string: OpenAI's finish_reason does not tell which
        ended = time.perf_counter()
        prompt_tokens = int(self.usage.get("prompt_tokens") or 0)
        new_tokens = int(self.usage.get("completion_tokens") or 0)
        ttft = (self.first_token_at or ended) - self.started
        decode_s = ended - (self.first_token_at or ended)
        stats = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "stop_reason": reason, "batch_size": 1,
                 "ttft_s": ttft, "prefill_tok_s": prompt_tokens / ttft if ttft > 0 else 0.0,
                 "decode_tok_s": (new_tokens - 1) / decode_s if new_tokens > 1 and decode_s > 0 else 0.0}
        return GenerationResult(self.text.strip(), self.reasoning.strip(), [], stats, reason)


async def _server_sent_data(response: aiohttp.ClientResponse):
    """The `data:` fields of a server-sent event stream, one per event line."""
    pending = b""
    async for piece in response.content.iter_any():
        pending += piece
        *lines, pending = pending.split(b"\n")
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip().decode("utf-8", errors="replace")


async def _json_answer(response: aiohttp.ClientResponse, url: str) -> dict:
    """The JSON body of a successful answer; a RemoteError with the server's own message otherwise."""
    raw = await response.read()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if response.status == 200 and isinstance(body, dict):
        return body
    message = _error_text(body) if isinstance(body, dict) else raw[:300].decode("utf-8", errors="replace")
    hint = {401: " The server wants an API key: set api_key_env to the name of an environment variable (A3B_...) "
                 "that holds it.",
            404: " Check base_url (it usually ends in /v1) and the model name."}.get(response.status, "")
    raise RemoteError(f"{url} answered HTTP {response.status}: {message}.{hint}")


def _error_text(body: dict) -> str:
    error = body.get("error", body)
    return str(error.get("message", error) if isinstance(error, dict) else error).rstrip(".")


def checked_base_url(base_url: str) -> str:
    """An http(s) URL without a trailing slash; a bare server address gets the usual /v1."""
    url = base_url.strip().rstrip("/")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RemoteError(f"base_url {base_url!r} is not an http(s) URL; write the server's address, e.g. "
                          "http://127.0.0.1:8000/v1.")
    if parts.username or parts.password:
        raise RemoteError(f"base_url {base_url!r} holds a user name or password, which would be saved in the "
                          "workflow. Remove it and put the API key in an environment variable (api_key_env).")
    return url if parts.path else url + "/v1"


def _run(coroutine):
    """Runs a coroutine to its end on an event loop of its own, in a thread of its own: callers (ComfyUI's node
    execution among them) may already be inside a running loop."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="a3b-remote") as pool:
        return pool.submit(asyncio.run, coroutine).result()
