"""What A3B Generate does with the engine, free of ComfyUI so it is unit-tested: the generation call (one prompt, or
a batch in per-image mode) and the speed line shown under the answer afterwards."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from a3b_core.runtime.sequence_output import GenerationResult


def generate_answers(engine: Any, prompts: list[Any], *, thinking_budget: int, on_text: Callable[[int, str], None],
                     **sampling: Any) -> list[GenerationResult]:
    """One result per prompt; on_text(index, text_so_far) streams each. `thinking_budget` is the node's widget value,
    where 0 means no cap (to the engine, 0 would mean no reasoning at all)."""
    budget = thinking_budget or None
    if len(prompts) == 1:
        return [engine.generate(prompts[0], on_text=lambda text: on_text(0, text), thinking_budget=budget,
                                **sampling)]
    return engine.generate_batch(prompts, on_text=on_text, thinking_budget=budget, **sampling)


def speed_line(stats: list[dict]) -> str:
    """What a run cost, from each result's `stats`, e.g.
    "TTFT 0.03 s · prefill 812 tok/s · decode 41.2 tok/s · 32 tokens · stopped: eos".
    A batch shares its timings, so they are read once; its tokens are summed and its stop reasons counted."""
    timings = stats[0]
    parts = [f"TTFT {timings['ttft_s']:.2f} s", f"prefill {timings['prefill_tok_s']:.0f} tok/s"]
    if timings["decode_tok_s"] > 0:  # 0 when nothing was decoded after the first token
        parts.append(f"decode {timings['decode_tok_s']:.1f} tok/s")
    tokens = sum(entry["new_tokens"] for entry in stats)
    counted = f"{tokens} token" + ("" if tokens == 1 else "s")
    parts.append(counted if len(stats) == 1 else f"{len(stats)} answers, {counted}")
    reasons = Counter(entry["stop_reason"] for entry in stats)
    if len(reasons) == 1:
        parts.append(f"stopped: {next(iter(reasons))}")
    else:
        parts.append("stopped: " + ", ".join(f"{count} {reason}" for reason, count in reasons.items()))
    return " · ".join(parts)
