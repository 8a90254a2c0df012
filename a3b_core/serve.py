"""`python -m a3b_core serve MODEL`: one loaded model behind an OpenAI-compatible HTTP server (aiohttp).

Endpoints: POST /v1/chat/completions, GET /v1/models, GET /health. Requests are OpenAI chat completions: text and
`image_url` parts (images as data URLs), `stream` as server-sent events, the reasoning in `reasoning_content` as vLLM
and SGLang return it, `chat_template_kwargs.enable_thinking` (without it, the model's own default: off for the demo
models, on for Qwen3.5/3.6 releases as their template says), max_tokens or max_completion_tokens, temperature, top_p,
top_k, min_p, presence_penalty, repetition_penalty, seed, stop, usage.
Sampler values a request leaves out take Qwen's recommendation for its thinking mode, as in A3BModel.generate.

The engine is not thread-safe, so one worker thread owns the model: it takes queued requests, encodes their images,
builds their prompts and decodes the requests that can share one sampler as one batch (same thinking mode, sampler
values, max_tokens and stop strings); the others wait for a later batch. A sampled request with its own seed runs
alone, so a seed gives the same answer however busy the server is. The event loop parses requests and streams the
text out. A client that disconnects cancels its request: a waiting request is dropped, and a batch stops within one
token once every client of it is gone (the engine stops a batch as a whole, so a batch that still has other clients
finishes, without sending the gone client's text anywhere).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import io
import ipaddress
import json
import logging
import os
import secrets
import signal
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from PIL import Image, UnidentifiedImageError

from . import (A3BError, A3BModel, ChatPrompt, ConfigError, GenerationResult, ImageError, load_image, load_model,
               split_reasoning)
from .chat_messages import Conversation, conversation_from_messages
from .options import SAMPLER_FIELDS, LoadOptions

log = logging.getLogger("a3b.serve")

MAX_BODY_BYTES = 32 * 2**20  # a request with several large PNG images fits; anything bigger is refused (413)
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
    stream = body.get("stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise RequestError("stream must be true or false, and stream_options an object; set them so.",
                           param="stream")
    return ChatRequest(conversation, thinking, stream, bool(options.get("include_usage")), max_tokens, sampling,
                       seed, tuple(s for s in stops if s))


def _not_integer(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def decode_image_url(url: str, where: str) -> Image.Image:
    """A data URL (data:image/...;base64,...) -> an 8-bit sRGB RGB image. The server fetches nothing, so other URLs
    are refused."""
    header, comma, data = url.partition(",")
    if not header.startswith("data:") or not comma:
        raise RequestError(f"{where} is not a data URL. Put the image inline as data:image/png;base64,... (this "
                           "server fetches nothing from the network, so http(s) URLs are not accepted).",
                           param="messages")
    if not header.endswith(";base64"):
        raise RequestError(f"{where}: the data URL is not base64-encoded; encode it as data:image/png;base64,<base64>.",
                           param="messages")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{where}: the data URL's payload is not valid base64. Encode the image file's bytes with "
                           "standard base64 (A-Z, a-z, 0-9, +, /, = padding).", param="messages") from None
    try:
        with warnings.catch_warnings():  # load_image applies the pack's own pixel limit
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
        return load_image(image)
    except UnidentifiedImageError:
        raise RequestError(f"{where}: the data URL does not hold an image PIL can decode; encode a PNG or JPEG "
                           "file's bytes.", param="messages") from None
    except (Image.DecompressionBombError, OSError, SyntaxError, ValueError) as exc:
        raise RequestError(f"{where}: the image cannot be read ({exc}); check the file and encode it again.",
                           param="messages") from None
    except ImageError as exc:
        raise RequestError(f"{where}: {exc}", param="messages") from None


# ------------------------------------------------------------------------------------------------ streaming
class AnswerStream:
    """The engine's growing output as OpenAI deltas: `reasoning_content` and `content` pieces that add up to the
    final reasoning and answer.

    Only text that later tokens cannot change is sent: nothing from a stop string on (the answer ends before it),
    and no trailing piece that may still become a stop string or a think tag."""

    def __init__(self, thinking: bool, stops: tuple[str, ...]):
        self.thinking = thinking
        self.stops = stops
        self.sent = {"reasoning_content": "", "content": ""}

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
        # Stop strings are matched in the answer only: after the think block in thinking mode, anywhere otherwise.
        close = text.find(THINK_TAGS[1])
        answer_from = 0 if not self.thinking else None if close == -1 else close + len(THINK_TAGS[1])
        held = list(THINK_TAGS)
        if answer_from is not None:
            hits = [hit for hit in (text.find(stop, answer_from) for stop in self.stops) if hit != -1]
            if hits:
                return text[:min(hits)]
            held += self.stops
        keep = len(text)
        for word in held:
            for size in range(min(len(word) - 1, len(text)), 0, -1):
                if text.endswith(word[:size]):
                    keep = min(keep, len(text) - size)
                    break
        return text[:keep]


# ------------------------------------------------------------------------------------------------ the worker
@dataclass(eq=False)
class Job:
    """One request on its way through the worker. The worker reports to the request's handler through `events`:
    ("text", whole text so far), then ("done", GenerationResult) or ("error", A3BError)."""
    request: ChatRequest
    images: list[Image.Image]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    key: tuple = field(init=False)
    prompt: ChatPrompt | None = None
    max_new_tokens: int = 0

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
                self._prepare(job)
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

    def _prepare(self, job: Job) -> None:
        """Encodes the job's images, builds its prompt and checks that prompt and answer fit the context."""
        conversation = job.request.conversation
        images = None
        if job.images:  # decoded and converted to sRGB when the request arrived
            images = self.model.encode_images(job.images, resize="native", srgb=False)
        job.prompt = self.model.build_prompt(user=conversation.user, system=conversation.system, images=images,
                                             thinking=job.request.thinking, history=conversation.history)
        prompt_tokens, context = len(job.prompt.input_ids), self.model.max_context
        left = context - prompt_tokens
        wanted = job.request.max_tokens
        if wanted is None and left >= 1:
            job.max_new_tokens = min(DEFAULT_MAX_TOKENS, left)
        elif wanted is not None and wanted <= left:
            job.max_new_tokens = wanted
        else:
            asked = f" and max_tokens is {wanted}" if wanted is not None else ""
            raise RequestError(f"the prompt has {prompt_tokens} tokens{asked}, but the model's context holds "
                               f"{context} tokens (prompt and answer). Shorten the messages, send fewer or smaller "
                               "images, or lower max_tokens.", param="messages", code="context_length_exceeded")


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


class ChatServer:
    """The aiohttp application around one model and its worker."""

    def __init__(self, model: A3BModel, model_name: str, api_key: str | None, max_batch_size: int):
        self.model = model
        self.model_name = model_name
        self.api_key = api_key
        self.worker = Worker(model, max_batch_size)
        self.created = int(time.time())
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._guard])
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.on_cleanup.append(lambda _app: asyncio.to_thread(self.worker.close))

    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """API key check and errors as OpenAI error objects."""
        if self.api_key is not None and request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                return error_response(RequestError("missing or wrong API key: set the header 'Authorization: "
                                                   "Bearer <key>' with the key the server was started with.",
                                                   status=401, code="invalid_api_key"))
        try:
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

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": self.model_name, "running": self.worker.running,
                                  "waiting": self.worker.waiting, "largest_batch": self.worker.largest_batch})

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "a3b-nodes",
            "max_model_len": self.model.max_context}]})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("the request body is not valid JSON; check how the client encodes it.") from None
        chat = parse_chat_request(body, self.model_name, self.model.default_thinking)
        conversation = chat.conversation
        images = await asyncio.to_thread(lambda: [decode_image_url(url, place) for url, place in
                                                  zip(conversation.image_urls, conversation.image_places)])
        job = Job(chat, images, asyncio.get_running_loop())
        self.worker.submit(job)
        try:
            return await self._answer(request, job)
        finally:
            job.cancelled.set()  # a client gone before the end (the handler is cancelled) stops its generation

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


def run(model_path: str, options: LoadOptions, host: str, port: int, api_key_env: str | None,
        max_batch_size: int) -> None:
    """Loads the model and serves it until SIGINT or SIGTERM. Everything the command line gives is checked first."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a port number; use 1 to 65535 (or 0 for a free one).")
    if max_batch_size < 1:
        raise ConfigError(f"--max-batch-size is {max_batch_size}; it must be at least 1.")
    api_key = api_key_from_env(api_key_env, host)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    log.info("loading %s (preset %s, device %s)", model_path, options.preset, options.device)
    model = load_model(model_path, **options.as_kwargs())
    server = ChatServer(model, Path(model_path).name, api_key, max_batch_size)
    asyncio.run(_serve(server, host, port))


async def _serve(server: ChatServer, host: str, port: int) -> None:
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None)
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
