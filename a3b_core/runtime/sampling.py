"""Choosing the next token: Qwen's recommended sampler settings, logits processors, and a seeded sampler.

Processing order per step (the order transformers uses): penalties -> temperature -> top-k -> top-p -> min-p, then
either the argmax (temperature 0) or a draw from the remaining distribution with a seeded CPU torch.Generator.
Penalties, the argmax and the top-k selection run where the logits are; one copy per step brings the chosen ids (or
the top-k candidates) to the CPU, where the rest is computed on k values. So a seed gives the same tokens on every
device (for the same logits), and no device generator is needed.

Penalties follow the OpenAI/vLLM meanings: `presence_penalty` is subtracted once from the logit of every token the
model has already generated in this answer; `repetition_penalty` (the CTRL rule) divides positive and multiplies
negative logits of every token seen so far, prompt included. 1.0 and 0.0 switch them off.

Every value has a range (see _check). Past its ends a setting changes nothing a real model's scores can show (they span
well under 100), but float32 scores overflow: inf - inf is NaN, and no token can be drawn.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from numbers import Integral, Real

import torch

from ..errors import GenerationError

TEMPERATURE_RANGE = (0.01, 100.0)  # or 0: greedy
PRESENCE_PENALTY_RANGE = (-100.0, 100.0)
REPETITION_PENALTY_RANGE = (0.01, 100.0)
NOT_FINITE = -1  # the sampler's token for a row whose logits hold NaN or inf


@dataclass(frozen=True)
class SamplingParams:
    temperature: float  # 0 = greedy
    top_p: float  # in (0, 1]; 1 keeps everything
    top_k: int  # 0 keeps everything
    min_p: float  # in [0, 1]; 0 keeps everything
    presence_penalty: float
    repetition_penalty: float  # > 0; 1 is off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# The Qwen3.5/3.6 model card's recommended "general" settings, keyed by thinking mode.
QWEN_RECOMMENDED = {
    True: SamplingParams(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=1.5,
                         repetition_penalty=1.0),
    False: SamplingParams(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, presence_penalty=1.5,
                          repetition_penalty=1.0),
}


def resolve_sampling(thinking: bool | None, *, temperature: float | None = None, top_p: float | None = None,
                     top_k: int | None = None, min_p: float | None = None, presence_penalty: float | None = None,
                     repetition_penalty: float | None = None) -> SamplingParams:
    """Fills each value left as None with Qwen's recommendation for the thinking mode and checks every value.

    Raw token-id prompts (thinking None) get the non-thinking row. With temperature 0 (greedy) unset penalties are
    off rather than Qwen's 1.5, so greedy means the model's own argmax unless a penalty is asked for explicitly.
    """
    default = QWEN_RECOMMENDED[bool(thinking)]
    if temperature is not None and _number("temperature", temperature) == 0:
        default = replace(default, presence_penalty=0.0, repetition_penalty=1.0)
    given = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, presence_penalty=presence_penalty,
                 repetition_penalty=repetition_penalty)
    params = replace(default, **{k: v for k, v in given.items() if v is not None})
    _check(params)
    return params


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise GenerationError(f"{name} is {value!r}; expected a finite number. Use None for Qwen's default.")
    return float(value)


def _check(p: SamplingParams) -> None:
    low, high = TEMPERATURE_RANGE
    if _number("temperature", p.temperature) != 0 and not low <= p.temperature <= high:
        raise GenerationError(f"temperature is {p.temperature}; it must be 0 (greedy) or between {low:g} and "
                              f"{high:g}. Qwen recommends 0.7 without thinking and 1.0 with thinking: use one of "
                              "those, or 0 for greedy.")
    if not 0 < _number("top_p", p.top_p) <= 1:
        raise GenerationError(f"top_p is {p.top_p}; it must be in (0, 1]. Use 1 to switch it off.")
    if isinstance(p.top_k, bool) or not isinstance(p.top_k, Integral) or p.top_k < 0:
        raise GenerationError(f"top_k is {p.top_k!r}; it must be a whole number, 0 (off) or more. Use 20, Qwen's "
                              "default.")
    if not 0 <= _number("min_p", p.min_p) <= 1:
        raise GenerationError(f"min_p is {p.min_p}; it must be in [0, 1]. Use 0 to switch it off.")
    low, high = PRESENCE_PENALTY_RANGE
    if not low <= _number("presence_penalty", p.presence_penalty) <= high:
        raise GenerationError(f"presence_penalty is {p.presence_penalty}; it must be between {low:g} and {high:g}. "
                              "Use 1.5, Qwen's default, or 0 to switch it off.")
    low, high = REPETITION_PENALTY_RANGE
    if not low <= _number("repetition_penalty", p.repetition_penalty) <= high:
        raise GenerationError(f"repetition_penalty is {p.repetition_penalty}; it must be between {low:g} and "
                              f"{high:g}. Use 1 to switch it off.")


# ------------------------------------------------------------------------------------------ logits processors
# Each takes float logits [B, V], changes them in place and returns them; removed tokens get -inf.

def apply_penalties(logits: torch.Tensor, generated: torch.Tensor | None, seen: torch.Tensor | None,
                    presence_penalty: float, repetition_penalty: float) -> torch.Tensor:
    """`generated` / `seen` [B, V] bool: tokens generated so far / tokens in the prompt or generated so far."""
    if repetition_penalty != 1.0 and seen is not None:
        penalized = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        logits.copy_(torch.where(seen, penalized, logits))
    if presence_penalty != 0.0 and generated is not None:
        logits.sub_(generated.to(logits.dtype) * presence_penalty)
    return logits


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose probabilities add up to at least p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop_sorted = probs.cumsum(dim=-1) - probs >= p  # the probability mass before each token reaches p
    drop_sorted[:, 0] = False  # the top token stays, even for a p that is 0 in float32
    drop = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, drop_sorted)
    return logits.masked_fill_(drop, -math.inf)


def filter_min_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Removes tokens less likely than p times the most likely token."""
    if p > 0.0:
        probs = logits.softmax(dim=-1)
        logits.masked_fill_(probs < p * probs.amax(dim=-1, keepdim=True), -math.inf)
    return logits


class Sampler:
    """Per-batch sampling state: parameters, the seeded generator and which tokens each row has seen."""

    def __init__(self, params: SamplingParams, prompts: list[list[int]], vocab_size: int, device: torch.device,
                 seed: int):
        self.params = params
        self.generator = torch.Generator().manual_seed(seed)
        batch = len(prompts)
        self.generated = self.seen = None
        if params.presence_penalty != 0.0:
            self.generated = torch.zeros(batch, vocab_size, dtype=torch.bool, device=device)
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(batch, vocab_size, dtype=torch.bool, device=device)
            for row, ids in enumerate(prompts):
                self.seen[row, torch.tensor(ids, dtype=torch.long, device=device)] = True

    def __call__(self, logits: torch.Tensor) -> list[int]:
        """Float logits [B, V] (changed in place) -> the next token id of each row, or NOT_FINITE for a row whose
        logits hold NaN or inf (checked where the logits are, and brought to the CPU in the same copy as the ids)."""
        finite = logits.isfinite().all(dim=-1)
        logits.masked_fill_(~finite[:, None], 0.0)  # keeps the draw below defined for such rows
        p = self.params
        apply_penalties(logits, self.generated, self.seen, p.presence_penalty, p.repetition_penalty)
        if p.greedy:
            return logits.argmax(dim=-1).masked_fill_(~finite, NOT_FINITE).cpu().tolist()
        k = p.top_k if 0 < p.top_k < logits.shape[-1] else logits.shape[-1]
        if k < logits.shape[-1]:
            values, ids = logits.topk(k, dim=-1)  # the candidates, most likely first; ids are exact in fp32
        else:
            values, ids = logits, None
        moved = torch.cat([values, *([] if ids is None else [ids.float()]), finite[:, None].float()], dim=-1).cpu()
        values, finite = moved[:, :k], moved[:, -1].bool()
        values.div_(p.temperature)
        filter_min_p(filter_top_p(values, p.top_p), p.min_p)
        picks = torch.multinomial(values.softmax(dim=-1), 1, generator=self.generator)
        tokens = picks if ids is None else moved[:, k:2 * k].gather(-1, picks).long()
        return tokens[:, 0].masked_fill_(~finite, NOT_FINITE).tolist()

    def observe(self, tokens: Sequence[int]) -> None:
        """Records the tokens just appended to each row (one per row): one copy to the masks' device serves both."""
        masks = [mask for mask in (self.generated, self.seen) if mask is not None]
        if masks:
            index = torch.tensor(tokens, device=masks[0].device)[:, None]
            for mask in masks:
                mask.scatter_(1, index, True)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drops finished rows: keeps `rows` (indices into the current batch), in that order."""
        if self.generated is not None:
            self.generated = self.generated[rows]
        if self.seen is not None:
            self.seen = self.seen[rows]
