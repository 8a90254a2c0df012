"""KV-cached generation: one prefill, then one token per step against a preallocated cache, through a model's
GenerationModel members only (A3BModel has them).

Prompts are ChatPrompts (from A3BModel.build_prompt, which knows the thinking mode) or raw token ids (thinking mode
unknown: no reasoning split, the text is the raw output). A batch is left-padded to its longest prompt; each row keeps
its own rope delta and rows that finish are dropped from the batch, so greedy rows give the tokens of separate runs.

Streaming: `on_text` gets the whole output so far each time it grows (never a broken multi-byte character). In
thinking mode it starts with "<think>\\n", so the reasoning shows live; the last call always carries
`result.full_text`. `should_stop` is polled before the prefill and after every token; True ends the call with
stop_reason "cancelled" and nothing left behind (the cache belongs to the call).

Shared prefix: prompts that all start with the same tokens (a system message, the chat format, an instruction before
the image) can start from one prefill of those tokens (`prefill_prefix`, made once, reused by every call given it as
`shared_prefix`). Each prompt's remaining tokens are then prefilled from a copy of the prefix's cache and state, into
the batch's cache laid out as a left-padded prefill lays it out, so decoding is unchanged. Padding never sits between
a prefix and its continuation (it would decay a recurrent state): rows with equally many remaining tokens are
prefilled together, unpadded.
"""
from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import Protocol

import torch

from ..errors import CheckpointError, GenerationError, PromptError
from ..prompting.tokenizer import Tokenizer
from . import devices
from .glibc_heap import heap_kept
from .inputs import ChatPrompt, EncodedImages, check_input_ids
from .options import SAMPLER_FIELDS, GenerationOptions
from .sampling import NOT_FINITE, Sampler, SamplingParams, resolve_sampling
from .sequence_output import THINK_CLOSE, GenerationResult, SequenceOutput

BUDGET_CLOSE = "\n</think>\n\n"  # forced when the thinking budget runs out; the model then writes its answer
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")


class GenerationModel(Protocol):
    """What generation uses of a loaded model: A3BModel is one (its ForwardPass drives the text model)."""
    folder: Path  # named in errors
    tokenizer: Tokenizer | None  # None: raw token ids give token ids only, no text
    device: torch.device  # where the cache and the logits live
    dtype: torch.dtype  # the compute dtype

    @property
    def max_context(self) -> int: ...  # the longest sequence the memory plan holds a cache for

    @property
    def max_positions(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def require_loaded(self) -> None: ...

    def require_tokenizer(self) -> Tokenizer: ...

    def cache_format(self, kv_dtype: str | None) -> str: ...  # the format a call's kv_dtype means

    def rows_per_cache(self, tokens: int, kv_format: str) -> int: ...  # sequences that fit the plan's cache

    def new_cache(self, batch: int, max_len: int, kv_dtype: str | None = None): ...

    def vision_pads(self, input_ids: torch.Tensor) -> torch.Tensor: ...  # where image and video pads are

    def positions(self, input_ids: torch.Tensor, images: EncodedImages | None,
                  attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]: ...

    def prefill(self, input_ids: torch.Tensor, images: EncodedImages | None, cache,
                attention_mask: torch.Tensor | None, position_ids: torch.Tensor) -> torch.Tensor: ...

    def decode_step(self, tokens: torch.Tensor, position_ids: torch.Tensor, cache) -> torch.Tensor: ...


def generate(model: GenerationModel, prompt, *, max_new_tokens: int = 256, temperature: float | None = None,
             top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
             presence_penalty: float | None = None, repetition_penalty: float | None = None, seed: int = 0,
             stop: str | Sequence[str] = (), thinking_budget: int | None = None, kv_dtype: str | None = None,
             max_context: int | None = None, on_text: Callable[[str], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> GenerationResult:
    """Generates one answer. Sampler values left as None take Qwen's recommendation for the prompt's thinking mode
    (see sampling.QWEN_RECOMMENDED); temperature 0 is greedy. `thinking_budget` caps the reasoning tokens, then
    forces "</think>" so the model answers. `stop` strings end the answer (they are matched in the answer only and
    left out of it). kv_dtype int8 quantizes the attention cache (see cache.py for its error bound)."""
    options = GenerationOptions(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                min_p=min_p, presence_penalty=presence_penalty,
                                repetition_penalty=repetition_penalty, seed=seed, stop=stop,
                                thinking_budget=thinking_budget, kv_dtype=kv_dtype, max_context=max_context)
    stream = (lambda _index, text: on_text(text)) if on_text is not None else None
    return _run(model, [prompt], options, stream, should_stop)[0]


def generate_batch(model: GenerationModel, prompts: Sequence, *, max_new_tokens: int = 256,
                   temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                   min_p: float | None = None, presence_penalty: float | None = None,
                   repetition_penalty: float | None = None, seed: int = 0, stop: str | Sequence[str] = (),
                   thinking_budget: int | None = None, kv_dtype: str | None = None, max_context: int | None = None,
                   on_text: Callable[[int, str], None] | None = None,
                   should_stop: Callable[[], bool] | None = None,
                   shared_prefix: SharedPrefix | None = None) -> list[GenerationResult]:
    """Generates an answer for each prompt, decoding them together; as `generate`, with on_text(index, text).
    `shared_prefix` (prefill_prefix's, with tokens every prompt starts with) spares prefilling those tokens again."""
    if isinstance(prompts, (str, ChatPrompt, torch.Tensor)) or not isinstance(prompts, Sequence) or not prompts:
        raise PromptError("prompts must be a non-empty list of prompts (ChatPrompts from model.build_prompt, or "
                          f"token-id lists); got {type(prompts).__name__}.")
    options = GenerationOptions(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                min_p=min_p, presence_penalty=presence_penalty,
                                repetition_penalty=repetition_penalty, seed=seed, stop=stop,
                                thinking_budget=thinking_budget, kv_dtype=kv_dtype, max_context=max_context)
    return _run(model, list(prompts), options, on_text, should_stop, shared_prefix)


@dataclass(eq=False)
class SharedPrefix:
    """Tokens that prompts start with, prefilled once: their cache (one row) for generate_batch to start from."""
    model: GenerationModel = field(repr=False)
    ids: tuple[int, ...]
    cache: object = field(repr=False)  # the model family's generation cache, holding exactly these tokens
    kv_format: str


def prefill_prefix(model: GenerationModel, ids: Sequence[int], kv_dtype: str | None = None) -> SharedPrefix:
    """Prefills `ids`, text that comes before any image (one row), for prompts that start with them. `kv_dtype` is
    the cache format of the calls that will use it (None: the plan's)."""
    model.require_loaded()
    tokens = check_input_ids(list(ids), model.vocab_size)
    if tokens.shape[0] != 1:
        raise PromptError("the shared prefix must be one sequence of token ids; pass a 1-D list.")
    if bool(model.vision_pads(tokens).any()):
        raise PromptError("the shared prefix holds image or video pad tokens; it must end before the prompts' first "
                          "image or clip (pass the tokens before it: model.text_before_images(prompt)).")
    kv_format = model.cache_format(kv_dtype)
    with torch.inference_mode():
        cache = model.new_cache(1, tokens.shape[1], kv_format)
        position_ids, _ = model.positions(tokens, None)
        model.prefill(tokens, None, cache, None, position_ids)
    return SharedPrefix(model, tuple(tokens[0].tolist()), cache, kv_format)


def _check_prefix(model: GenerationModel, prefix: SharedPrefix, requests: list[_Request], kv_format: str) -> None:
    if not isinstance(prefix, SharedPrefix) or prefix.model is not model:
        raise GenerationError("shared_prefix must come from prefill_prefix with this same model; build it again "
                              "with model.prefill_prefix(...) of the model that generates.")
    if prefix.kv_format != kv_format:
        raise GenerationError(f"the shared prefix was prefilled with kv_dtype {prefix.kv_format!r} but this call "
                              f"uses {kv_format!r}; pass the calls' kv_dtype to prefill_prefix too.")
    n = len(prefix.ids)
    for number, request in enumerate(requests):
        if len(request.ids) <= n or tuple(request.ids[:n]) != prefix.ids:
            raise PromptError(f"prompt {number} does not start with the shared prefix's {n} tokens and continue "
                              "after them; give shared_prefix only for prompts that all begin with its tokens.")


# -------------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class _Request:
    ids: list[int]
    images: EncodedImages | None
    thinking: bool | None  # None: raw token ids


def _request(model: GenerationModel, prompt, where: str) -> _Request:
    if isinstance(prompt, ChatPrompt):
        if not prompt.input_ids:
            raise PromptError(f"{where} has no tokens; build it with model.build_prompt and a non-empty user text.")
        check_input_ids(prompt.input_ids, model.vocab_size)  # built with another model's tokenizer?
        return _Request(list(prompt.input_ids), prompt.images if len(prompt.images) else None,
                        prompt.prompt.thinking)
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (Sequence, torch.Tensor)):
        raise PromptError(f"{where} is a {type(prompt).__name__}; pass a ChatPrompt (model.build_prompt) or a 1-D "
                          "list/tensor of token ids.")
    try:
        ids = check_input_ids(prompt, model.vocab_size)
    except PromptError as exc:
        raise PromptError(f"{where}: {exc}") from None
    if ids.shape[0] != 1:
        raise PromptError(f"{where} holds {ids.shape[0]} sequences; pass one 1-D sequence per prompt "
                          "(use generate_batch for several).")
    return _Request(ids[0].tolist(), None, None)


@dataclass(frozen=True)
class _Settings:
    """A call's options, checked and resolved for its prompts and model."""
    max_new_tokens: int
    sampling: SamplingParams
    seed: int
    stop: tuple[str, ...]
    thinking_budget: int | None
    kv_format: str  # as ForwardPass.cache_format names it: "auto" resolved
    max_context: int


def _whole(name: str, value, minimum: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise GenerationError(f"{name} is {value!r}; expected a whole number >= {minimum}. {fix}")
    return int(value)


def _settings(model: GenerationModel, requests: list[_Request], options: GenerationOptions) -> _Settings:
    """`options` checked against the model and the prompts, the sampler values resolved for their thinking mode."""
    max_new_tokens = _whole("max_new_tokens", options.max_new_tokens, 1, "Ask for at least one new token.")
    seed, stop = options.seed, options.stop
    if isinstance(seed, bool) or not isinstance(seed, Integral):
        raise GenerationError(f"seed is {seed!r}; expected a whole number. Pass an integer such as 0.")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) for s in stops):
        raise GenerationError(f"stop is {stop!r}; expected a string or a list of strings. Pass the stop texts as "
                              "strings.")
    thinking_budget = options.thinking_budget
    if thinking_budget is not None:
        thinking_budget = _whole("thinking_budget", thinking_budget, 0, "Use None for no limit.")
    positions = model.max_positions
    max_context = options.max_context if options.max_context is not None else default_context(model)
    max_context = _whole("max_context", max_context, 1, "Use None for the default.")
    if max_context > positions:
        raise GenerationError(f"max_context is {max_context} but the model supports {positions} positions "
                              "(max_position_embeddings); lower max_context.")
    if max_context > model.max_context:
        raise GenerationError(f"max_context is {max_context} but the model was loaded for at most "
                              f"{model.max_context} tokens (its memory plan holds a cache that long). Lower "
                              f"max_context, or load the model with load_model(..., max_context={max_context}).")
    for number, request in enumerate(requests):
        if len(request.ids) + max_new_tokens > max_context:
            which = "the prompt" if len(requests) == 1 else f"prompt {number}"
            raise PromptError(f"{which} has {len(request.ids)} tokens; with max_new_tokens={max_new_tokens} that "
                              f"exceeds max_context={max_context}. Shorten the prompt (fewer or smaller images), "
                              "lower max_new_tokens, or raise max_context.")
    modes = {r.thinking for r in requests}
    sampler_values = {name: getattr(options, name) for name in SAMPLER_FIELDS}
    if len(modes) > 1 and any(v is None for v in sampler_values.values()):
        raise GenerationError("the prompts mix thinking modes, whose default sampler settings differ; generate "
                              "them in separate batches or set every sampler value explicitly.")
    sampling = resolve_sampling(modes.pop(), **sampler_values)
    return _Settings(max_new_tokens, sampling, int(seed) % 2 ** 64, tuple(s for s in stops if s), thinking_budget,
                     model.cache_format(options.kv_dtype), max_context)


def default_context(model: GenerationModel) -> int:
    """The context a call gets without max_context: what the loader's plan sized memory for, within the model's
    positions."""
    return min(model.max_positions, model.max_context)


# --------------------------------------------------------------------------------------------- the loop
def _run(model: GenerationModel, prompts: list, options: GenerationOptions,
         on_text: Callable[[int, str], None] | None, should_stop: Callable[[], bool] | None,
         shared_prefix: SharedPrefix | None = None) -> list[GenerationResult]:
    model.require_loaded()
    where = (lambda i: "the prompt") if len(prompts) == 1 else (lambda i: f"prompt {i}")
    requests = [_request(model, p, where(i)) for i, p in enumerate(prompts)]
    settings = _settings(model, requests, options)
    if shared_prefix is not None:
        _check_prefix(model, shared_prefix, requests, settings.kv_format)
    # raw token ids can be generated without a tokenizer (token ids only, no text): benchmarks, bare checkpoints
    ids_only = model.tokenizer is None and not settings.stop and all(r.thinking is None for r in requests)
    tokenizer = None if ids_only else model.require_tokenizer()
    thinking = any(r.thinking for r in requests)
    think_close_id = tokenizer.token_id(THINK_CLOSE) if thinking else None
    budget_close = tokenizer.encode(BUDGET_CLOSE) if thinking else []
    eos_ids = model.eos_token_ids | {
        i for i in map(tokenizer.maybe_token_id, EOS_TOKENS) if i is not None} if tokenizer else model.eos_token_ids
    rows = [SequenceOutput(tokenizer, r.thinking, settings.stop, settings.thinking_budget, think_close_id, budget_close)
            for r in requests]
    batch_stats = {}
    with torch.inference_mode(), heap_kept():
        for batch in _batches(model, requests, settings):
            stream = None if on_text is None else (lambda i, text, batch=batch: on_text(batch[i], text))
            stats = _decode(model, [requests[i] for i in batch], [rows[i] for i in batch], settings, eos_ids, stream,
                            should_stop or (lambda: False), shared_prefix)
            batch_stats.update(dict.fromkeys(batch, stats))
    results = []
    for index, (row, request) in enumerate(zip(rows, requests)):
        result = row.result(batch_stats[index] | {"prompt_tokens": len(request.ids)})
        if on_text is not None and result.full_text != row.live_text:
            on_text(index, result.full_text)
        results.append(result)
    return results


def _batches(model: GenerationModel, requests: list[_Request], settings: _Settings) -> list[list[int]]:
    """The prompts split into consecutive batches whose generation cache fits in what the plan holds for one
    sequence at its full context, so a batch never outgrows it."""
    size = model.rows_per_cache(max(len(r.ids) for r in requests) + settings.max_new_tokens, settings.kv_format)
    return [list(range(start, min(start + size, len(requests)))) for start in range(0, len(requests), size)]


def _decode(model: GenerationModel, requests: list[_Request], rows: list[SequenceOutput], settings: _Settings,
            eos_ids: frozenset[int], on_text: Callable[[int, str], None] | None,
            should_stop: Callable[[], bool], prefix: SharedPrefix | None) -> dict:
    device = model.device
    started = time.perf_counter()
    devices.reset_peak(device)
    lengths = [len(r.ids) for r in requests]
    width = max(lengths)
    pad_id = min(eos_ids, default=0)  # any id: padding is masked out
    ids = torch.full((len(requests), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(requests), width, dtype=torch.long)
    for b, request in enumerate(requests):
        ids[b, width - lengths[b]:] = torch.tensor(request.ids)
        mask[b, width - lengths[b]:] = 1
    images = _images_of(requests)
    mask = mask if min(lengths) < width else None
    cache = model.new_cache(len(requests), width + settings.max_new_tokens, settings.kv_format)
    sampler = Sampler(settings.sampling, [r.ids for r in requests], model.vocab_size, device, settings.seed)
    stats = {"batch_size": len(requests), "kv_cache_bytes": cache.nbytes, "ttft_s": 0.0, "prefill_tok_s": 0.0,
             "decode_tok_s": 0.0}
    if should_stop():
        for row in rows:
            row.stop_reason = "cancelled"
        return stats | _peak_memory(device)

    position_ids, deltas = model.positions(ids, images, mask)
    # a generated token at unpadded index n gets position n + delta; its cache index is n + (width - length)
    offsets = torch.tensor([n - width + d for n, d in zip(lengths, deltas)], device=device)
    if prefix is None:
        logits = model.prefill(ids, images, cache, mask, position_ids)
    else:
        logits = _prefill_after_prefix(model, prefix, requests, cache, position_ids, width)
    active = list(range(len(rows)))  # rows still in the batch, in batch order
    decoded = 0
    for step in range(settings.max_new_tokens):
        sampled = sampler(logits)  # the step's one copy to the CPU: ids, or NOT_FINITE for a broken row
        if NOT_FINITE in sampled:
            raise _non_finite_scores(model)
        if step == 0:
            stats["ttft_s"] = time.perf_counter() - started
            reused = len(prefix.ids) * len(requests) if prefix is not None else 0  # tokens not prefilled here
            stats["prefill_tok_s"] = (sum(lengths) - reused) / stats["ttft_s"]
        chosen = [rows[r].choose(s) for r, s in zip(active, sampled)]
        tokens = torch.tensor(chosen)  # in RAM: the embedding lookup and the sampler take them from there
        sampler.observe(chosen)
        for r, token in zip(active, chosen):
            if rows[r].add(token, eos_ids) and on_text is not None:
                on_text(r, rows[r].live_text)
        if should_stop():
            for r in active:
                rows[r].stop_reason = rows[r].stop_reason or "cancelled"
        keep = [i for i, r in enumerate(active) if rows[r].stop_reason is None]
        if not keep or step == settings.max_new_tokens - 1:
            break
        if len(keep) < len(active):  # finished rows leave the batch
            kept = torch.tensor(keep, device=device)
            cache.keep_rows(kept)
            sampler.keep_rows(kept)
            offsets, tokens = offsets[kept], tokens[keep]
            active = [active[i] for i in keep]
        position = (cache.length + offsets).view(1, -1, 1).expand(3, -1, -1)
        logits = model.decode_step(tokens, position, cache)
        decoded += len(active)
    decode_s = time.perf_counter() - started - stats["ttft_s"]
    stats["decode_tok_s"] = decoded / decode_s if decoded and decode_s > 0 else 0.0
    return stats | _peak_memory(device)


def _images_of(requests: list[_Request]) -> EncodedImages | None:
    """The requests' images, in order, as one EncodedImages (None when none has any)."""
    images = [r.images for r in requests if r.images is not None]
    return sum(images[1:], images[0]) if images else None


def _prefill_after_prefix(model: GenerationModel, prefix: SharedPrefix, requests: list[_Request], cache,
                          position_ids: torch.Tensor, width: int) -> torch.Tensor:
    """Prefills each prompt's tokens after the shared prefix into `cache`, each row placed where a left-padded prefill
    of the whole prompts (`width` tokens, positions `position_ids`) puts it: consecutive rows with equally many such
    tokens start together from copies of the prefix's cache, unpadded. Returns the last position's logits [B, V]."""
    n = len(prefix.ids)
    logits, first = [], 0
    for length, group in itertools.groupby(len(r.ids) - n for r in requests):
        end = first + len(list(group))
        window = cache.window(slice(first, end), width - n - length)
        window.start_from(prefix.cache)
        ids = torch.tensor([r.ids[n:] for r in requests[first:end]])
        logits.append(model.prefill(ids, _images_of(requests[first:end]), window, None,
                                    position_ids[:, first:end, width - length:]))
        first = end
    cache.filled_through_windows(width)
    return torch.cat(logits)


def _non_finite_scores(model: GenerationModel) -> CheckpointError:
    overflow = (" With compute_dtype float16 it can also be an overflow: load the model with compute_dtype "
                "'bfloat16' instead." if model.dtype == torch.float16 else "")
    return CheckpointError(f"{model.folder}: the model computed NaN or infinite scores for the next token, so "
                           "generation stopped. Its weights look corrupt: download the model's files again (and "
                           f"compare them with the release's checksums).{overflow}")


def _peak_memory(device: torch.device) -> dict:
    """Peak bytes: CUDA memory allocated during this call, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return {"peak_memory_bytes": devices.peak_allocated_bytes(device), "peak_memory_kind": "cuda_allocated"}
    try:
        import resource  # POSIX only
    except ImportError:
        return {"peak_memory_bytes": None, "peak_memory_kind": "unavailable"}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_memory_bytes": peak if sys.platform == "darwin" else peak * 1024,  # Linux reports KiB
            "peak_memory_kind": "process_peak_rss"}
