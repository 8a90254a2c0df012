"""One sequence's output as its tokens arrive (SequenceOutput: text so far, the thinking budget, stop strings) and
what it ends as (GenerationResult: the answer with the reasoning split off)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..prompting.tokenizer import StreamDecoder, Tokenizer

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class GenerationResult:
    """One prompt's answer, the reasoning split from it, its tokens and the call's numbers."""
    text: str  # the answer (thinking mode: after </think>; non-thinking: any stray think block removed)
    reasoning: str  # what the model wrote inside its think block ("" when there was none)
    token_ids: list[int]  # generated tokens only, forced ones and a final end token included
    # prompt_tokens, new_tokens, stop_reason, batch_size, ttft_s, prefill_tok_s (the tokens this call prefilled, a
    # shared prefix's not counted), decode_tok_s (all rows of a batch), kv_cache_bytes (the call's whole cache),
    # peak_memory_bytes with peak_memory_kind: "cuda_allocated" (this call) or "process_peak_rss" (the process so
    # far; CPU)
    stats: dict = field(default_factory=dict)
    stop_reason: str = ""  # "eos" | "stop_string" | "max_new_tokens" | "cancelled"

    @property
    def full_text(self) -> str:
        """The reasoning in a think block, then the answer; just the answer when there is no reasoning."""
        return f"{THINK_OPEN}\n{self.reasoning}\n{THINK_CLOSE}\n\n{self.text}" if self.reasoning else self.text


def split_reasoning(raw: str, thinking: bool | None) -> tuple[str, str]:
    """(reasoning, answer) of a raw output. In thinking mode the template already opened the think block. Every
    think block, and in either mode anything before an unopened "</think>", is reasoning; the rest is the answer."""
    if thinking is None:
        return "", raw
    text = (THINK_OPEN if thinking else "") + raw
    reasoning, answer, pos = [], [], 0
    while True:
        open_at, close_at = text.find(THINK_OPEN, pos), text.find(THINK_CLOSE, pos)
        if close_at != -1 and (open_at == -1 or close_at < open_at):  # a close with no open
            reasoning.append(text[pos:close_at])
            pos = close_at + len(THINK_CLOSE)
        elif open_at == -1:
            answer.append(text[pos:])
            break
        else:
            answer.append(text[pos:open_at])
            start = open_at + len(THINK_OPEN)
            close_at = text.find(THINK_CLOSE, start)
            if close_at == -1:  # still thinking when generation ended
                reasoning.append(text[start:])
                break
            reasoning.append(text[start:close_at])
            pos = close_at + len(THINK_CLOSE)
    return "\n\n".join(p.strip() for p in reasoning if p.strip()), "".join(answer).strip()


class _NoText:
    """The stream decoder of a model folder without a tokenizer: token ids are kept, no text is made."""
    text = ""

    def push(self, token_id: int) -> str:
        return ""


class SequenceOutput:
    """One sequence's output as tokens arrive: its text so far (UTF-8 safe), thinking state, forced tokens, stop."""

    def __init__(self, tokenizer: Tokenizer | None, thinking: bool | None, stop: tuple[str, ...] = (),
                 thinking_budget: int | None = None, think_close_id: int | None = None,
                 budget_close: Sequence[int] = ()):
        self.thinking = thinking
        self.decoder = StreamDecoder(tokenizer, skip_special_tokens=True) if tokenizer else _NoText()
        self.prefix = THINK_OPEN + "\n" if thinking else ""
        self.tokens: list[int] = []
        self.stops = stop
        self.budget = thinking_budget if thinking else None
        self.think_close_id = think_close_id
        self.budget_close = list(budget_close)
        self.forced: list[int] = []
        self.reasoning_open = bool(thinking)
        self.reasoning_tokens = 0
        self.answer_from = None if self.reasoning_open else 0  # where stop strings are searched from
        self.searched = 0
        self.stop_at: int | None = None
        self.stop_reason: str | None = None

    def choose(self, sampled: int) -> int:
        """The token to append: the sampled one, or the next of a forced think-block close."""
        if self.reasoning_open and self.budget is not None and self.reasoning_tokens >= self.budget \
                and not self.forced:
            self.forced = list(self.budget_close)
            self.budget = None
        if self.forced:
            return self.forced.pop(0)
        if self.reasoning_open:
            self.reasoning_tokens += 1
        return sampled

    def add(self, token: int, eos_ids: frozenset[int]) -> bool:
        """Appends a token; returns whether the visible text grew."""
        self.tokens.append(token)
        if token in eos_ids:
            self.stop_reason = "eos"
            return False
        grew = bool(self.decoder.push(token))
        text = self.decoder.text
        if self.reasoning_open and token == self.think_close_id:
            self.reasoning_open = False
            self.answer_from = text.rfind(THINK_CLOSE) + len(THINK_CLOSE)
        if self.stops and self.answer_from is not None and grew:
            start = max(self.answer_from, self.searched - max(map(len, self.stops)) + 1)
            hits = [i for i in (text.find(s, start) for s in self.stops) if i != -1]
            self.searched = len(text)
            if hits:
                self.stop_at, self.stop_reason = min(hits), "stop_string"
        return grew

    @property
    def live_text(self) -> str:
        return self.prefix + self.decoder.text

    def result(self, stats: dict) -> GenerationResult:
        raw = self.decoder.text if self.stop_at is None else self.decoder.text[:self.stop_at]
        reasoning, text = split_reasoning(raw, self.thinking)
        reason = self.stop_reason or "max_new_tokens"
        return GenerationResult(text, reasoning, self.tokens, stats | {"new_tokens": len(self.tokens),
                                                                        "stop_reason": reason}, reason)
