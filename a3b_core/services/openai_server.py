"""`python -m a3b_core serve MODEL`: one loaded model behind an OpenAI-compatible HTTP server (aiohttp).

Endpoints: POST /v1/chat/completions, GET /v1/models, GET /health. Requests are OpenAI chat completions: text and
`image_url` parts (images as data URLs), `stream` as server-sent events, the reasoning in `reasoning_content` as vLLM
and SGLang return it, `chat_template_kwargs.enable_thinking` (without it, the model's own default: off for the demo
models, on for Qwen3.5/3.6 releases as their template says), max_tokens or max_completion_tokens, temperature, top_p,
top_k, min_p, presence_penalty, repetition_penalty, seed, stop, usage.
Sampler values a request leaves out take Qwen's recommendation for its thinking mode, as in A3BModel.generate.

A request is prepared before it is queued, on one of PREPARE_THREADS threads, so that one request's preparation never
holds up other clients' answers: its JSON is parsed, then the cheap bounds are checked before anything costly (at most
MAX_IMAGES_PER_REQUEST images, their sizes read from their headers and at most MAX_REQUEST_PIXELS in all, and a lower
bound of the prompt's tokens from the text's length and the images' sizes against the context); only then are its
images decoded, one at a time, each straight down to the size the vision tower takes (resize "native"), and its
prompt built and measured. Decoded images wait for the worker within MAX_HELD_PIXELS for all requests together (a
request that would pass it waits before decoding).

The engine is not thread-safe, so one worker thread owns the model: it runs the vision tower on queued requests'
images and decodes the requests that can share one sampler as one batch (same thinking mode, sampler values,
max_tokens and stop strings); the others wait for a later batch. A sampled request with its own seed runs alone, so a
seed gives the same answer however busy the server is. The event loop reads requests and streams the text out. A
client that disconnects cancels its request: a waiting request is dropped, and a batch stops within one token once
every client of it is gone (the engine stops a batch as a whole, so a batch that still has other clients finishes,
without sending the gone client's text anywhere).

A server without an API key (it listens on this machine only) answers only requests addressed to this machine (a
loopback Host), and refuses any request that a web page of another origin sends (its Origin header), unless that
origin was allowed with --allow-origin; every POST must be `Content-Type: application/json`, which a web page cannot
send to another origin without the server's consent.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import ipaddress
import json
import logging
import math
import os
import secrets
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from aiohttp import web
from PIL import Image

from .. import (A3BError, A3BModel, ChatPrompt, ConfigError, EncodedImages, GenerationResult, ImageError, load_model,
                split_reasoning)
from ..media.image import load_resized, native_size, open_image, smart_resize
from ..runtime.options import SAMPLER_FIELDS, LoadOptions
from .openai_messages import Conversation, conversation_from_messages

log = logging.getLogger("a3b.serve")

MAX_BODY_BYTES = 32 * 2**20  # a request with several large PNG images fits; anything bigger is refused (413)
MAX_IMAGES_PER_REQUEST = 64  # a 30-view multi-angle request fits twice over
MAX_REQUEST_PIXELS = 2**28  # a request's images in all, as their headers give them: 64 images of 4 MP
MAX_HELD_PIXELS = 2**29  # decoded images all requests hold at once (native size, ~1.5 GiB as RGB); more waits
PREPARE_THREADS = 2  # requests prepared (parsed, checked, images decoded, prompt built) at once, beside the worker
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # characters of one stop string
IDLE_TIMEOUT_S = 15  # a connection without a whole request header this long after opening or its last answer is closed
BODY_TIMEOUT_S = 120  # seconds a request body may take to arrive once its header has
DEFAULT_MAX_TOKENS = 4096  # for requests without max_tokens, cut to what the context has left
THINK_TAGS = ("<think>", "</think>")
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "cancelled": "stop"}


class RequestError(A3BError):
    """A request the server refuses, sent back as an OpenAI error object with its HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind


# ------------------------------------------------------------------------------------------------ requests
@dataclass(frozen=True)
class ChatRequest:
    conversation: Conversation
    thinking: bool
    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: DEFAULT_MAX_TOKENS within what the context has left
    sampling: dict  # SAMPLER_FIELDS given by the request (None: Qwen's recommendation)
    seed: int | None
    stop: tuple[str, ...]

    @property
    def sampled(self) -> bool:
        return self.sampling["temperature"] != 0

    def batch_key(self) -> tuple:
        """Requests with equal keys can be decoded as one batch: one sampler and one max_new_tokens serve them all.
        A sampled request with its own seed gets a key of its own."""
        alone = object() if self.sampled and self.seed is not None else None
        return (self.thinking, self.max_tokens, self.stop, tuple(self.sampling.values()), alone)


def parse_chat_request(body: object, model_name: str, default_thinking: bool) -> ChatRequest:
    """The body of POST /v1/chat/completions, checked field by field; `default_thinking` is the thinking mode of a
    request that does not set enable_thinking (the model's own default)."""
    if not isinstance(body, dict):
        raise RequestError("the request body is not a JSON object; pass an object with 'model' and 'messages'.")
    if body.get("model") != model_name:
        if not isinstance(body.get("model"), str):
            raise RequestError(f"'model' is missing; set it to {model_name!r}, the model this server serves.",
                               param="model")
        raise RequestError(f"the model {body['model']!r} does not exist here; use {model_name!r}, the model this "
                           "server serves (GET /v1/models lists it).", status=404, param="model",
                           code="model_not_found")
    unsupported = {"tools": "tools", "logprobs": "logprobs", "logit_bias": "logit_bias",
                   "frequency_penalty": "frequency_penalty (use presence_penalty or repetition_penalty)"}
    for name, what in unsupported.items():
        if body.get(name):
            raise RequestError(f"{what} is not supported by this server; remove it from the request.", param=name)
    if body.get("n", 1) != 1:
        raise RequestError("n must be 1: this server gives one answer per request. Use n=1 and make several "
                           "requests instead (they are decoded together).", param="n")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise RequestError("response_format is not supported (only plain text answers); remove it.",
                           param="response_format")
    try:
        conversation = conversation_from_messages(body.get("messages"))
    except A3BError as exc:
        raise RequestError(str(exc), param="messages") from None
    kwargs = body.get("chat_template_kwargs") or {}
    thinking = kwargs.get("enable_thinking", default_thinking) if isinstance(kwargs, dict) else None
    if not isinstance(thinking, bool):
        raise RequestError("chat_template_kwargs must be an object whose enable_thinking is true or false; use "
                           "{\"enable_thinking\": false} for answers without thinking.", param="chat_template_kwargs")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (_not_integer(max_tokens) or max_tokens < 1):
        raise RequestError(f"max_tokens is {max_tokens!r}; use a whole number of at least 1.", param="max_tokens")
    sampling = {}
    for name in SAMPLER_FIELDS:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise RequestError(f"{name} is {value!r}; use a number, or remove it for Qwen's default.", param=name)
        sampling[name] = value
    seed = body.get("seed")
    if seed is not None and _not_integer(seed):
        raise RequestError(f"seed is {seed!r}; use a whole number.", param="seed")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else () if stop is None \
        else (None,)
    if not all(isinstance(s, str) for s in stops):
        raise RequestError(f"stop is {stop!r}; use a string or a list of strings.", param="stop")
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise RequestError(f"stop holds {len(stops)} strings of up to {max(map(len, stops))} characters; use at most "
                           f"{MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters each.",
                           param="stop")
    stream = body.get("stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise RequestError("stream must be true or false, and stream_options an object; set them so.",
                           param="stream")
    return ChatRequest(conversation, thinking, stream, bool(options.get("include_usage")), max_tokens, sampling,
                       seed, tuple(s for s in stops if s))


def _not_integer(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def image_data(url: str, where: str) -> bytes:
    """The image file's bytes in a data URL (data:image/...;base64,...). The server fetches nothing, so other URLs are
    refused."""
    header, comma, data = url.partition(",")
    if not header.startswith("data:") or not comma:
        raise RequestError(f"{where} is not a data URL. Put the image inline as data:image/png;base64,... (this "
                           "server fetches nothing from the network, so http(s) URLs are not accepted).",
                           param="messages")
    if not header.endswith(";base64"):
        raise RequestError(f"{where}: the data URL is not base64-encoded; encode it as data:image/png;base64,<base64>.",
                           param="messages")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{where}: the data URL's payload is not valid base64. Encode the image file's bytes with "
                           "standard base64 (A-Z, a-z, 0-9, +, /, = padding).", param="messages") from None


@contextlib.contextmanager
def image_at(where: str) -> Iterator[None]:
    """An ImageError raised inside, as the request's error naming the image's place in the messages."""
    try:
        yield
    except ImageError as exc:
        raise RequestError(f"{where}: {exc}", param="messages") from None


def image_size(data: bytes, where: str) -> tuple[int, int]:
    """(width, height) from an image file's header, without decoding it (image.open_image's checks)."""
    with image_at(where), open_image(data, "the data URL") as image:
        return image.size


def decode_image_url(url: str, where: str) -> Image.Image:
    """A data URL's image as 8-bit sRGB RGB, already at the size resize "native" gives it (decoded no larger than
    that needs: image.load_resized)."""
    with image_at(where):
        return load_resized(image_data(url, where), mode="native")


# ------------------------------------------------------------------------------------------------ streaming
class AnswerStream:
    """The engine's growing output as OpenAI deltas: `reasoning_content` and `content` pieces that add up to the
    final reasoning and answer.

    Only text that later tokens cannot change is sent: nothing from a stop string on (the answer ends before it),
    and no trailing piece that may still become a stop string or a think tag. The output only grows, so each update
    searches only where a tag or stop string may have begun since the last one: the work an update does for them
    does not grow with the answer."""

    def __init__(self, thinking: bool, stops: tuple[str, ...]):
        self.thinking = thinking
        self.stops = stops
        self.sent = {"reasoning_content": "", "content": ""}
        self._answer_from: int | None = None if thinking else 0  # where stop strings count: after the think block
        self._searched = {"think": 0, "stop": 0}  # no think close, no stop string starts before these
        self._stop_at: int | None = None
        self._held_from = 0  # no tail of the text from before here can still become a tag or stop string

    def update(self, live_text: str) -> dict[str, str]:
        """`live_text`: the whole output so far as on_text gives it (in thinking mode it opens with <think>)."""
        return self._delta(*split_reasoning(self._settled(live_text), thinking=False))

    def finish(self, result: GenerationResult) -> dict[str, str]:
        return self._delta(result.reasoning, result.text)

    def _delta(self, reasoning: str, answer: str) -> dict[str, str]:
        delta = {}
        for name, text in (("reasoning_content", reasoning), ("content", answer)):
            sent = self.sent[name]
            if len(text) > len(sent) and text.startswith(sent):
                delta[name] = text[len(sent):]
                self.sent[name] = text
        return delta

    def _settled(self, text: str) -> str:
        if self._answer_from is None:
            close = self._find(text, (THINK_TAGS[1],), "think", 0)
            if close is not None:
                self._answer_from, self._held_from = close + len(THINK_TAGS[1]), 0  # stop strings are held from now
        held = THINK_TAGS
        if self._answer_from is not None:
            if self._stop_at is None:
                self._stop_at = self._find(text, self.stops, "stop", self._answer_from)
            if self._stop_at is not None:
                return text[:self._stop_at]
            held += self.stops
        longest = max(map(len, held))
        keep = max(self._held_from, len(text) - longest + 1)
        while keep < len(text) and not any(len(word) > len(text) - keep and word.startswith(text[keep:])
                                           for word in held):
            keep += 1
        self._held_from = keep
        return text[:keep]

    def _find(self, text: str, words: tuple[str, ...], kind: str, start: int) -> int | None:
        """Where the first of `words` starts in `text` from `start`, searching only what the last search of `kind`
        could not have seen whole."""
        if not words:
            return None
        begin = max(start, self._searched[kind])
        hits = [hit for hit in (text.find(word, begin) for word in words) if hit != -1]
        self._searched[kind] = max(begin, len(text) - max(map(len, words)) + 1)
        return min(hits) if hits else None


# ------------------------------------------------------------------------------------------------ the worker
@dataclass(eq=False)
class Job:
    """One prepared request on its way through the worker. The worker reports to the request's handler through
    `events`: ("text", whole text so far), then ("done", GenerationResult) or ("error", A3BError)."""
    request: ChatRequest
    images: list[Image.Image]  # decoded at the size the vision tower takes; dropped once it has run
    prompt: ChatPrompt  # built with stand_ins for the images, which the worker replaces with their embeddings
    max_new_tokens: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    key: tuple = field(init=False)

    def __post_init__(self):
        self.key = self.request.batch_key()

    def send(self, kind: str, value: object) -> None:
        """From the worker thread to the handler."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Worker:
    """The one thread that uses the model: batches of compatible jobs, in arrival order of their first job."""

    def __init__(self, model: A3BModel, max_batch_size: int):
        self.model = model
        self.max_batch_size = max_batch_size
        self.running = 0
        self.largest_batch = 0
        self._pending: list[Job] = []
        self._ready = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="a3b-serve-worker", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Requests waiting for a batch (a cancelled one is dropped when the worker next looks)."""
        with self._ready:
            return sum(1 for job in self._pending if not job.cancelled.is_set())

    def submit(self, job: Job) -> None:
        with self._ready:
            self._pending.append(job)
            self._ready.notify()

    def close(self) -> None:
        """Stops the running batch within one token and ends the thread."""
        with self._ready:
            self._closing = True
            self._ready.notify()
        self._thread.join()

    def _next_batch(self) -> list[Job] | None:
        with self._ready:
            while True:
                self._pending = [job for job in self._pending if not job.cancelled.is_set()]
                if self._closing:
                    return None
                if self._pending:
                    break
                self._ready.wait()
            key = self._pending[0].key
            batch = [job for job in self._pending if job.key == key][:self.max_batch_size]
            self._pending = [job for job in self._pending if job not in batch]
            self.running = len(batch)
            return batch

    def _serve(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._run(batch)
            except Exception as exc:  # an engine bug: the server goes on serving, the clients learn of it
                log.exception("generation failed")
                for job in batch:
                    job.send("error", RequestError(f"the server failed while generating ({type(exc).__name__}); check "
                                                   "its log.", status=500, kind="server_error"))
            finally:
                self.running = 0

    def _run(self, batch: list[Job]) -> None:
        ready = []
        for job in batch:
            try:
                self._encode(job)
                ready.append(job)
            except A3BError as exc:
                job.send("error", exc)
        if not ready:
            return
        self.largest_batch = max(self.largest_batch, len(ready))
        request = ready[0].request
        seed = request.seed if request.seed is not None else secrets.randbits(63) if request.sampled else 0
        try:
            results = self.model.generate_batch(
                [job.prompt for job in ready], max_new_tokens=min(job.max_new_tokens for job in ready), seed=seed,
                stop=request.stop, on_text=lambda index, text: ready[index].send("text", text),
                should_stop=lambda: self._closing or all(job.cancelled.is_set() for job in ready),
                **request.sampling)
        except A3BError as exc:  # the settings all these requests share
            for job in ready:
                job.send("error", exc)
            return
        for job, result in zip(ready, results):
            log.info("%d prompt + %d new tokens, %s, batch of %d%s", len(job.prompt.input_ids),
                     len(result.token_ids), result.stop_reason, len(ready),
                     " (client gone)" if job.cancelled.is_set() else "")
            job.send("done", result)

    def _encode(self, job: Job) -> None:
        """The vision tower on the job's images; their embeddings take the stand-ins' place in its prompt."""
        if not job.images:
            return
        encoded = self.model.encode_images(job.images, resize="native", srgb=False)  # already sRGB, at that size
        job.images = []
        job.prompt = ChatPrompt(job.prompt.prompt, encoded)  # generation checks that their token counts agree


# ------------------------------------------------------------------------------------------------ HTTP
def error_body(exc: A3BError) -> tuple[int, dict]:
    if isinstance(exc, RequestError):
        status, kind, param, code = exc.status, exc.kind, exc.param, exc.code
    else:  # the engine refusing a prompt, an image or a sampler value
        status, kind, param, code = 400, "invalid_request_error", None, None
    return status, {"error": {"message": str(exc), "type": kind, "param": param, "code": code}}


def error_response(exc: A3BError) -> web.Response:
    status, body = error_body(exc)
    return web.json_response(body, status=status)


class PixelBudget:
    """Decoded image pixels that all requests hold at once, at most `limit`: a request waits for room before it decodes
    its images, and gives its share back when it ends. Used from the event loop only."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self._waiting: set[asyncio.Future] = set()

    @contextlib.asynccontextmanager
    async def holding(self, pixels: int) -> AsyncIterator[None]:
        while self.held + pixels > self.limit:
            room = asyncio.get_running_loop().create_future()
            self._waiting.add(room)
            try:
                await room
            finally:
                self._waiting.discard(room)
        self.held += pixels
        try:
            yield
        finally:
            self.held -= pixels
            for room in self._waiting:
                if not room.done():
                    room.set_result(None)


class ChatServer:
    """The aiohttp application around one model, its worker and the threads that prepare requests."""

    def __init__(self, model: A3BModel, model_name: str, api_key: str | None, max_batch_size: int,
                 allowed_origins: tuple[str, ...] = ()):
        self.model = model
        self.model_name = model_name
        self.api_key = api_key
        self.allowed_origins = allowed_origins
        # A lower bound of a text's tokens: no token of this vocabulary spells more characters than its longest entry
        # (a byte-level entry has one character per byte, and a byte is at most one character).
        self.max_token_chars = max(map(len, model.require_tokenizer().backend.get_vocab(with_added_tokens=True)))
        self.worker = Worker(model, max_batch_size)
        self.preparer = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="a3b-serve-prepare")
        self.budget = PixelBudget(MAX_HELD_PIXELS)
        self.created = int(time.time())
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._guard])
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.on_response_prepare.append(self._allow_origin)
        self.app.on_cleanup.append(lambda _app: asyncio.to_thread(self.close))

    def close(self) -> None:
        self.preparer.shutdown(cancel_futures=True)
        self.worker.close()

    # -------------------------------------------------------------------------------------------- who may ask
    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """Who may ask (Origin, Host, API key, Content-Type), and every error as an OpenAI error object."""
        try:
            refusal = self._refusal(request)
            if refusal is not None:
                return error_response(refusal)
            if request.method == "OPTIONS":  # a browser asking whether an allowed origin may send its request
                return web.Response(status=204, headers={"Access-Control-Allow-Methods": "GET, POST",
                                                         "Access-Control-Allow-Headers": "Authorization, Content-Type",
                                                         "Access-Control-Max-Age": "600"})
            return await handler(request)
        except A3BError as exc:
            return error_response(exc)
        except web.HTTPRequestEntityTooLarge:
            return error_response(RequestError(f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB. Use "
                                               "fewer or smaller images (PNG or JPEG, resized first).", status=413))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(RequestError(f"{request.method} {request.path}: {exc.reason}. Use POST "
                                               "/v1/chat/completions, GET /v1/models or GET /health.",
                                               status=exc.status))
        except Exception as exc:  # a bug: the client still gets an error object, the log the traceback
            log.exception("%s %s failed", request.method, request.path)
            return error_response(RequestError(f"the server failed ({type(exc).__name__}); check its log.",
                                               status=500, kind="server_error"))

    def _refusal(self, request: web.Request) -> RequestError | None:
        """Why the server will not answer `request`, or None."""
        origin = request.headers.get("Origin")
        if origin is not None and origin not in self.allowed_origins and origin != f"http://{request.host}":
            return RequestError(f"requests from the web page origin {origin!r} are refused, so that no web page can "
                                f"drive this server. To allow that origin, pass --allow-origin {origin} when starting "
                                "the server.", status=403, code="origin_not_allowed")
        if self.api_key is None and not is_loopback(host_name(request.host)):
            return RequestError(f"the request is addressed to {request.host!r}, not to this machine: a server without "
                                "an API key answers only requests to localhost or a loopback address. Use "
                                "http://127.0.0.1:<port>/v1.", status=403, code="host_not_allowed")
        if request.method == "OPTIONS":
            return None if origin in self.allowed_origins else RequestError(
                f"OPTIONS {request.path}: only web pages of origins allowed with --allow-origin may ask this server "
                "for permission; pass --allow-origin ORIGIN when starting the server to allow one.", status=403,
                code="origin_not_allowed")
        if self.api_key is not None and request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                return RequestError("missing or wrong API key: set the header 'Authorization: Bearer <key>' with the "
                                    "key the server was started with.", status=401, code="invalid_api_key")
        if request.method == "POST" and request.content_type != "application/json":
            return RequestError(f"the request body is sent as {request.content_type!r}; send JSON, and set the header "
                                "'Content-Type: application/json'.", status=415)
        return None

    async def _allow_origin(self, request: web.Request, response: web.StreamResponse) -> None:
        """Lets the web page of an allowed origin read the answer."""
        origin = request.headers.get("Origin")
        if origin in self.allowed_origins:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"

    # -------------------------------------------------------------------------------------------- endpoints
    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": self.model_name, "running": self.worker.running,
                                  "waiting": self.worker.waiting, "largest_batch": self.worker.largest_batch,
                                  "held_pixels": self.budget.held})

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "a3b-nodes",
            "max_model_len": self.model.max_context}]})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            raw = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RequestError(f"the request body did not arrive within {BODY_TIMEOUT_S} s of its header; check the "
                               "connection, or use fewer or smaller images.", status=408) from None
        loop = asyncio.get_running_loop()
        chat, pixels = await loop.run_in_executor(self.preparer, self.checked, raw)
        async with self.budget.holding(pixels):
            images, prompt, max_new_tokens = await loop.run_in_executor(self.preparer, self.prepared, chat)
            job = Job(chat, images, prompt, max_new_tokens, loop)
            self.worker.submit(job)
            try:
                return await self._answer(request, job)
            finally:
                job.cancelled.set()  # a client gone before the end (the handler is cancelled) stops its generation

    # -------------------------------------------------------------------------------------------- preparing
    def checked(self, raw: bytes) -> tuple[ChatRequest, int]:
        """The request in a body, and the pixels its images will hold once decoded; refused when a bound that costs
        no decoding fails: image count and pixels (from the images' headers), or prompt tokens that, by a lower
        bound from the text's length and the images' sizes, leave no room for the answer."""
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("the request body is not valid JSON; check how the client encodes it.") from None
        except RecursionError:
            raise RequestError("the request body nests JSON arrays or objects too deeply to read; write the "
                               "messages as the OpenAI API describes them.") from None
        chat = parse_chat_request(body, self.model_name, self.model.default_thinking)
        conversation = chat.conversation
        if len(conversation.image_urls) > MAX_IMAGES_PER_REQUEST:
            raise RequestError(f"the messages hold {len(conversation.image_urls)} images; use at most "
                               f"{MAX_IMAGES_PER_REQUEST} per request.", param="messages")
        if conversation.image_urls:
            self.model.require_vision()
        pixels = held = image_tokens = 0
        for url, where in zip(conversation.image_urls, conversation.image_places):
            width, height = image_size(image_data(url, where), where)
            pixels += width * height
            if pixels > MAX_REQUEST_PIXELS:
                raise RequestError(f"{where}: the images up to this one have {pixels:,} pixels; a request's images "
                                   f"may have at most {MAX_REQUEST_PIXELS:,} in all. Use fewer images, or "
                                   "downscale them first.",
                                   param="messages")
            with image_at(where):
                kept_width, kept_height = native_size(width, height)
            held += kept_width * kept_height
            image_tokens += self.image_tokens(kept_width, kept_height)
        texts = [conversation.system, conversation.user] + [text for turn in conversation.history
                                                            for text in (turn.user, turn.assistant)]
        text_tokens = math.ceil(sum(map(len, texts)) / self.max_token_chars)
        self.answer_room(text_tokens + image_tokens, chat.max_tokens, at_least=True)
        return chat, held

    def prepared(self, chat: ChatRequest) -> tuple[list[Image.Image], ChatPrompt, int]:
        """A checked request's images, decoded one at a time at the size the vision tower takes, its prompt (with
        stand-ins for the images' embeddings) and the tokens its answer may have."""
        conversation = chat.conversation
        images = [decode_image_url(url, where) for url, where in zip(conversation.image_urls,
                                                                     conversation.image_places)]
        prompt = self.model.build_prompt(user=conversation.user, system=conversation.system,
                                         images=self.stand_ins(images), thinking=chat.thinking,
                                         history=conversation.history)
        return images, prompt, self.answer_room(len(prompt.input_ids), chat.max_tokens)

    def image_tokens(self, width: int, height: int) -> int:
        """LM tokens of a native-size image of width x height (image.native_size's)."""
        _, grid_height, grid_width = self._grid(width, height)
        return grid_height * grid_width // self.model.config.vision.spatial_merge_size ** 2

    def _grid(self, width: int, height: int) -> tuple[int, int, int]:
        """The vision tower's patch grid of a native-size image of width x height (image.to_patches' grid)."""
        vision = self.model.config.vision
        grid_height, grid_width = smart_resize(height, width, vision.patch_size * vision.spatial_merge_size)
        return 1, grid_height // vision.patch_size, grid_width // vision.patch_size

    def stand_ins(self, images: list[Image.Image]) -> EncodedImages:
        """What build_prompt needs of images before the vision tower has run: their token counts (empty rows)."""
        return EncodedImages([torch.empty(self.image_tokens(*image.size), 0) for image in images],
                             [self._grid(*image.size) for image in images])

    def answer_room(self, prompt_tokens: int, wanted: int | None, at_least: bool = False) -> int:
        """The tokens an answer may have after a prompt of `prompt_tokens` (`at_least`: a lower bound) when the
        request asks for `wanted` (None: DEFAULT_MAX_TOKENS, within what the context has left)."""
        context = self.model.max_context
        left = context - prompt_tokens
        if wanted is None and left >= 1:
            return min(DEFAULT_MAX_TOKENS, left)
        if wanted is not None and wanted <= left:
            return wanted
        asked = f" and max_tokens is {wanted}" if wanted is not None else ""
        raise RequestError(f"the prompt has {'at least ' if at_least else ''}{prompt_tokens} tokens{asked}, but the "
                           f"model's context holds {context} tokens (prompt and answer). Shorten the messages, send "
                           "fewer or smaller images, or lower max_tokens.", param="messages",
                           code="context_length_exceeded")

    async def _answer(self, request: web.Request, job: Job) -> web.StreamResponse:
        completion_id, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        kind, value = await _next_event(job)
        if kind == "error":
            return error_response(value)
        if not job.request.stream:
            while kind == "text":
                kind, value = await _next_event(job)
            if kind == "error":
                return error_response(value)
            result: GenerationResult = value
            message = {"role": "assistant", "content": result.text, "reasoning_content": result.reasoning or None}
            return web.json_response({
                "id": completion_id, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": FINISH_REASONS[result.stop_reason]}],
                "usage": _usage(result)})

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(data: dict | str) -> None:
            await response.write(f"data: {json.dumps(data) if isinstance(data, dict) else data}\n\n".encode())

        def chunk(delta: dict, finish_reason: str | None = None) -> dict:
            return {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

        stream = AnswerStream(job.request.thinking, job.request.stop)
        try:
            await send(chunk({"role": "assistant", "content": ""}))
            while kind == "text":
                delta = stream.update(value)
                if delta:
                    await send(chunk(delta))
                kind, value = await _next_event(job)
            if kind == "error":
                await send(error_body(value)[1])
            else:
                delta = stream.finish(value)
                if delta:
                    await send(chunk(delta))
                await send(chunk({}, FINISH_REASONS[value.stop_reason]))
                if job.request.include_usage:
                    await send({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                                "model": self.model_name, "choices": [], "usage": _usage(value)})
            await send("[DONE]")
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client left; the handler's caller cancels the job
        return response


async def _next_event(job: Job) -> tuple[str, object]:
    """The job's next event; of texts waiting together, only the newest (each holds the whole text so far)."""
    kind, value = await job.events.get()
    while kind == "text" and not job.events.empty():
        kind, value = job.events.get_nowait()
    return kind, value


def _usage(result: GenerationResult) -> dict:
    prompt, completion = result.stats["prompt_tokens"], len(result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ------------------------------------------------------------------------------------------------ command line
def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(host: str) -> str:
    """The name or address in a Host header (host, host:port, [IPv6]:port), without its port."""
    name = host.rpartition("]")[0][1:] if host.startswith("[") else host.partition(":")[0]
    return name.lower()


def api_key_from_env(variable: str | None, host: str) -> str | None:
    """The key clients must send, read from the environment variable named `variable`. A server reachable from
    other machines (any host but a loopback address) refuses to start without one."""
    if variable is not None:
        key = os.environ.get(variable, "")
        if not key.strip():
            raise ConfigError(f"--api-key-env {variable}: the environment variable {variable} is not set or empty. "
                              f"Set it to the key clients must send (for example `export {variable}=$(openssl rand "
                              "-hex 24)`), or leave out --api-key-env.")
        return key.strip()
    if not is_loopback(host):
        raise ConfigError(f"--host {host} makes the server reachable from other machines, so it needs an API key: put "
                          "a key in an environment variable and pass its name with --api-key-env VAR (clients send it "
                          "as 'Authorization: Bearer <key>'), or keep the default --host 127.0.0.1.")
    return None


def checked_origins(origins: list[str]) -> tuple[str, ...]:
    """--allow-origin values: each a web origin, scheme://host[:port] as a browser sends it in Origin."""
    for origin in origins:
        scheme, _, address = origin.partition("://")
        if scheme not in ("http", "https") or not host_name(address) or any(mark in address for mark in "/?#@"):
            raise ConfigError(f"--allow-origin {origin!r} is not a web origin; give it as a browser writes it, "
                              "scheme://host[:port] with nothing after, e.g. http://localhost:3000.")
    return tuple(origins)


def run(model_path: str, options: LoadOptions, host: str, port: int, api_key_env: str | None,
        max_batch_size: int, allow_origins: list[str] = ()) -> None:
    """Loads the model and serves it until SIGINT or SIGTERM. Everything the command line gives is checked first."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a port number; use 1 to 65535 (or 0 for a free one).")
    if max_batch_size < 1:
        raise ConfigError(f"--max-batch-size is {max_batch_size}; it must be at least 1.")
    api_key = api_key_from_env(api_key_env, host)
    origins = checked_origins(list(allow_origins))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    log.info("loading %s (preset %s, device %s)", model_path, options.preset, options.device)
    model = load_model(model_path, **options.as_kwargs())
    server = ChatServer(model, Path(model_path).name, api_key, max_batch_size, origins)
    asyncio.run(_serve(server, host, port))


async def _serve(server: ChatServer, host: str, port: int) -> None:
    # keepalive_timeout closes a connection that has sent no whole request header within it, from its opening or
    # from its last answer (aiohttp starts that timer when the connection opens).
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None, keepalive_timeout=IDLE_TIMEOUT_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}). Pick another --port, or stop "
                              "the program using it.") from None
        stopped = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(signum, stopped.set)
        bound_port = runner.addresses[0][1]
        shown_host = f"[{host}]" if ":" in host else host
        print(f"A3B server: {server.model_name} at http://{shown_host}:{bound_port}/v1 (Ctrl+C stops it)",
              flush=True)
        await stopped.wait()
    finally:
        await runner.cleanup()
