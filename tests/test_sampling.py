"""Sampler settings, logits processors and the seeded sampler, on hand-made distributions."""
import math

import pytest
import torch

from a3b_core.errors import GenerationError
from a3b_core.runtime.sampling import (NOT_FINITE, QWEN_RECOMMENDED, Sampler, SamplingParams, apply_penalties,
                                       filter_min_p, filter_top_p, resolve_sampling)

PROBS = [0.5, 0.3, 0.15, 0.05]


def logits_of(probs: list[float], order: list[int] | None = None) -> torch.Tensor:
    """Logits [1, V] of a known distribution, optionally laid out in a shuffled vocabulary order."""
    values = torch.tensor(probs).log()
    if order is not None:
        values = values[torch.tensor(order).argsort()]
    return values[None].clone()


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())


def test_defaults_are_qwens_recommendations_per_mode():
    assert resolve_sampling(True) == SamplingParams(1.0, 0.95, 20, 0.0, 1.5, 1.0)
    assert resolve_sampling(False) == SamplingParams(0.7, 0.8, 20, 0.0, 1.5, 1.0)
    assert resolve_sampling(None) == QWEN_RECOMMENDED[False]  # raw token ids: the non-thinking row
    assert resolve_sampling(True, top_k=5, min_p=0.1) == SamplingParams(1.0, 0.95, 5, 0.1, 1.5, 1.0)


def test_greedy_switches_unset_penalties_off_but_keeps_explicit_ones():
    assert resolve_sampling(True, temperature=0) == SamplingParams(0.0, 0.95, 20, 0.0, 0.0, 1.0)
    assert resolve_sampling(False, temperature=0, presence_penalty=1.5).presence_penalty == 1.5
    assert resolve_sampling(False, temperature=0).greedy


@pytest.mark.parametrize("values", [
    dict(temperature=-0.1), dict(temperature=math.nan), dict(temperature="hot"), dict(top_p=0), dict(top_p=1.01),
    dict(top_k=-1), dict(top_k=2.5), dict(top_k=True), dict(min_p=-0.01), dict(min_p=1.5),
    dict(repetition_penalty=0), dict(repetition_penalty=-1), dict(presence_penalty=math.inf),
    dict(temperature=1e-39), dict(temperature=0.009), dict(temperature=1e39), dict(presence_penalty=1e39),
    dict(presence_penalty=-101), dict(repetition_penalty=1e39), dict(repetition_penalty=1e-39),
    dict(repetition_penalty=0.009),
])
def test_out_of_range_values_name_themselves(values):
    name = next(iter(values))
    with pytest.raises(GenerationError, match=name):
        resolve_sampling(False, **values)


@pytest.mark.parametrize("values", [
    dict(temperature=0.01), dict(temperature=100), dict(presence_penalty=-100), dict(presence_penalty=100),
    dict(repetition_penalty=0.01), dict(repetition_penalty=100), dict(top_p=1e-45), dict(min_p=1.0),
])
def test_the_limits_themselves_are_accepted(values):
    assert resolve_sampling(False, **values)


@pytest.mark.parametrize("values", [
    dict(temperature=0.01), dict(temperature=100), dict(presence_penalty=-100), dict(presence_penalty=100),
    dict(repetition_penalty=0.01), dict(repetition_penalty=100), dict(top_p=1e-46), dict(min_p=1.0),
])
def test_extreme_accepted_values_keep_scores_finite(values):
    """Scores of a real model's range through every processor at the limits: never NaN, always a token to draw."""
    params = resolve_sampling(False, top_k=0, **({"presence_penalty": 0.0} | values))
    logits = torch.linspace(-60, 60, 64)[None].repeat(2, 1)
    logits[1, :8] = 0.0
    sampler = Sampler(params, [[0, 1, 2, 63], [5]], vocab_size=64, device=torch.device("cpu"), seed=0)
    sampler.observe([63, 8])
    assert NOT_FINITE not in sampler(logits)
    assert not logits.isnan().any() and torch.isfinite(logits).any(dim=-1).all()


def test_top_p_below_the_smallest_float_keeps_the_top_token():
    assert kept(filter_top_p(logits_of(PROBS), 1e-46)) == {0}  # 1e-46 is 0 in float32


def test_non_finite_rows_are_flagged_not_sampled():
    """A row with NaN or inf scores gets NOT_FINITE (checked with the token ids, in the same copy to the CPU); the
    other rows sample as usual."""
    logits = logits_of(PROBS).repeat(3, 1)
    logits[0, 2] = math.nan
    logits[2, 1] = math.inf
    for params in (SamplingParams(0.0, 1.0, 0, 0.0, 0.0, 1.0), SamplingParams(1.0, 0.9, 0, 0.0, 1.0, 1.2)):
        sampler = Sampler(params, [[0]] * 3, vocab_size=len(PROBS), device=torch.device("cpu"), seed=0)
        tokens = sampler(logits.clone())
        assert tokens[0] == tokens[2] == NOT_FINITE and 0 <= tokens[1] < len(PROBS)


@pytest.mark.parametrize("top_p, expected", [(0.4, {0}), (0.49, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}),
                                             (0.99, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, expected):
    order = [3, 1, 0, 2]  # vocabulary ids of the tokens with probabilities 0.5, 0.3, 0.15, 0.05
    got = kept(filter_top_p(logits_of(PROBS, order), top_p))
    assert got == {order[i] for i in expected}


def test_top_p_works_per_row():
    logits = torch.cat([logits_of(PROBS), logits_of(PROBS, [3, 2, 1, 0])])
    filter_top_p(logits, 0.75)
    assert torch.isfinite(logits).tolist() == [[True, True, False, False], [False, False, True, True]]


@pytest.mark.parametrize("min_p, expected", [(0.0, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (0.7, {0}),
                                             (1.0, {0})])
def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability(min_p, expected):
    assert kept(filter_min_p(logits_of(PROBS), min_p)) == expected


def test_penalties_change_exactly_the_seen_logits():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.5]])
    seen = torch.tensor([[True, True, False, False, True]])  # prompt or generated
    generated = torch.tensor([[False, True, False, False, True]])
    out = apply_penalties(logits.clone(), generated, seen, presence_penalty=0.0, repetition_penalty=2.0)
    assert out.tolist() == [[1.0, -4.0, 3.0, -1.0, 0.25]]
    out = apply_penalties(logits.clone(), generated, seen, presence_penalty=1.5, repetition_penalty=1.0)
    assert out.tolist() == [[2.0, -3.5, 3.0, -1.0, -1.0]]
    out = apply_penalties(logits.clone(), generated, seen, presence_penalty=1.5, repetition_penalty=2.0)
    assert out.tolist() == [[1.0, -5.5, 3.0, -1.0, -1.25]]


def test_sampler_tracks_prompt_and_generated_tokens():
    params = SamplingParams(0.0, 1.0, 0, 0.0, presence_penalty=1.0, repetition_penalty=2.0)
    sampler = Sampler(params, [[1, 2], [3]], vocab_size=6, device=torch.device("cpu"), seed=0)
    sampler.observe([4, 1])
    assert sampler.seen.tolist() == [[False, True, True, False, True, False], [False, True, False, True, False,
                                                                                False]]
    assert sampler.generated.nonzero().tolist() == [[0, 4], [1, 1]]
    sampler.keep_rows(torch.tensor([1]))
    assert sampler.generated.nonzero().tolist() == [[0, 1]]
    # row [1]: token 1 (generated, 2.0) -> 2.0 / 2 - 1 = 0.0 loses to token 5 (never seen, 0.5)
    assert sampler(torch.tensor([[0.0, 2.0, 0.0, 0.0, 0.0, 0.5]])) == [5]


def draws(params: SamplingParams, seed: int, n: int = 400) -> list[int]:
    sampler = Sampler(params, [[0]] * n, vocab_size=len(PROBS), device=torch.device("cpu"), seed=seed)
    return sampler(logits_of(PROBS).repeat(n, 1))


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    params = SamplingParams(1.0, 1.0, 0, 0.0, 0.0, 1.0)
    assert draws(params, seed=3) == draws(params, seed=3)
    assert draws(params, seed=3) != draws(params, seed=4)
    assert set(draws(params, seed=3)) == {0, 1, 2, 3}


def test_sampling_never_draws_filtered_tokens():
    assert set(draws(SamplingParams(1.0, 0.75, 0, 0.0, 0.0, 1.0), seed=1)) == {0, 1}
    assert set(draws(SamplingParams(1.0, 1.0, 3, 0.0, 0.0, 1.0), seed=1)) == {0, 1, 2}  # top_k keeps the 3 likeliest
    assert set(draws(SamplingParams(1.0, 1.0, 2, 0.0, 0.0, 1.0), seed=1)) == {0, 1}
    assert set(draws(SamplingParams(1.0, 1.0, 0, 0.5, 0.0, 1.0), seed=1)) == {0, 1}
    assert set(draws(SamplingParams(5.0, 1.0, 1, 0.0, 0.0, 1.0), seed=1)) == {0}  # top_k=1 is greedy


def test_low_temperature_sharpens_and_high_temperature_flattens():
    cold = draws(SamplingParams(0.2, 1.0, 0, 0.0, 0.0, 1.0), seed=2)
    hot = draws(SamplingParams(5.0, 1.0, 0, 0.0, 0.0, 1.0), seed=2)
    assert cold.count(0) > 0.9 * len(cold)
    assert hot.count(0) < 0.5 * len(hot)
