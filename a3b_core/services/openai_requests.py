"""OpenAI chat completion requests, turned into what the server's worker runs: a checked ChatRequest, its images
decoded and its prompt built.

RequestPreparer checks the cheap bounds before anything costly (at most MAX_IMAGES_PER_REQUEST images, their sizes read
from their headers and at most MAX_REQUEST_PIXELS in all, and a lower bound of the prompt's tokens from the text's
length and the images' sizes against the context); only then are a request's images decoded, one at a time, each
straight down to the size the vision tower takes (resize "native"), and its prompt built and measured. Every refusal is
a RequestError, which the server sends back as an OpenAI error object with its HTTP status.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from .. import A3BError, A3BModel, ChatPrompt, EncodedImages, ImageError
from ..media.image import load_resized, native_size, open_image, smart_resize
from ..runtime.options import SAMPLER_FIELDS
from .openai_messages import Conversation, conversation_from_messages

MAX_IMAGES_PER_REQUEST = 64  # a 30-view multi-angle request fits twice over
MAX_REQUEST_PIXELS = 2**28  # a request's images in all, as their headers give them: 64 images of 4 MP
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # characters of one stop string
DEFAULT_MAX_TOKENS = 4096  # for requests without max_tokens, cut to what the context has left


class RequestError(A3BError):
    """A request the server refuses, sent back as an OpenAI error object with its HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind


@dataclass(frozen=True)
class ChatRequest:
    model: str  # one of the names the server serves (the model, or the model with a named LoRA adapter)
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
        return (self.model, self.thinking, self.max_tokens, self.stop, tuple(self.sampling.values()), alone)


def parse_chat_request(body: object, model_names: Sequence[str], default_thinking: bool) -> ChatRequest:
    """The body of POST /v1/chat/completions, checked field by field; `model_names` are the names the server serves
    (the model's first); `default_thinking` is the thinking mode of a request that does not set enable_thinking (the
    model's own default)."""
    if not isinstance(body, dict):
        raise RequestError("the request body is not a JSON object; pass an object with 'model' and 'messages'.")
    names = " or ".join(repr(name) for name in model_names)
    if body.get("model") not in model_names:
        if not isinstance(body.get("model"), str):
            raise RequestError(f"'model' is missing; set it to {names}, what this server serves.", param="model")
        raise RequestError(f"the model {body['model']!r} does not exist here; use {names}, what this server serves "
                           "(GET /v1/models lists it).", status=404, param="model", code="model_not_found")
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
    return ChatRequest(body["model"], conversation, thinking, stream, bool(options.get("include_usage")), max_tokens,
                       sampling, seed, tuple(s for s in stops if s))


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


class RequestPreparer:
    """Turns the requests for one model into prepared generations, on the server's preparing threads: it reads the
    model's settings and tokenizer, and never runs the model."""

    def __init__(self, model: A3BModel, model_names: Sequence[str]):
        self.model = model
        self.model_names = tuple(model_names)
        # A lower bound of a text's tokens: no token of this vocabulary spells more characters than its longest entry
        # (a byte-level entry has one character per byte, and a byte is at most one character).
        self.max_token_chars = max(map(len, model.require_tokenizer().backend.get_vocab(with_added_tokens=True)))

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
        chat = parse_chat_request(body, self.model_names, self.model.default_thinking)
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
