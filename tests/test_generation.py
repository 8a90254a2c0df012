"""Cached generation on the tiny checkpoints: greedy equals transformers, batches equal single runs, sampling,
streaming, Stop, thinking split and budget, the int8 cache, and every input error."""
import pytest
import torch

from a3b_core import ChatPrompt, EncodedImages, GenerationError, PromptError, load_model
from a3b_core.models.qwen3_5.cache import Cache
from a3b_core.models.qwen3_5.sizes import deltanet_state_bytes, kv_bytes
from a3b_core.prompting.conversation import Prompt
from a3b_core.runtime.generation import BUDGET_CLOSE, GenerationModel, generate, generate_batch, prefill_prefix
from a3b_core.runtime.sequence_output import SequenceOutput, split_reasoning

INT8_LOGIT_TOLERANCE = 0.02  # max |logit difference| / std(logits) vs the fp32 cache

GEN_TOKENS = 32


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(fixtures):
    return {name: load_model(getattr(fixtures, name), preset="cpu", compute_dtype="float32")
            for name in ("moe_hf", "dense")}


@pytest.fixture(scope="module")
def model(models):
    return models["moe_hf"]


def image_prompt(model, refs) -> ChatPrompt:
    """The reference image prompt as a ChatPrompt, its image encoded by our vision tower from the reference pixels."""
    grid = tuple(refs["image_a.image_grid_thw"][0].tolist())
    with torch.inference_mode():
        embeds = model.vision(refs["image_a.pixel_values"], [grid])
    ids = refs["gen_image.prompt_ids"][0].tolist()
    return ChatPrompt(Prompt(tuple(ids), (embeds.shape[0],), False, ""), EncodedImages([embeds], [grid]))


# ------------------------------------------------------------------------------------------ greedy vs oracle
@pytest.mark.parametrize("name", ["moe_hf", "dense"])
def test_greedy_text_equals_transformers(models, fixtures, name):
    model, refs = models[name], fixtures.refs(getattr(fixtures, name))
    result = generate(model, refs["gen_text.prompt_ids"][0], max_new_tokens=GEN_TOKENS, temperature=0)
    assert result.token_ids == refs["gen_text.output_ids"][0].tolist()
    assert result.stop_reason == "max_new_tokens"


@pytest.mark.parametrize("name", ["moe_hf", "dense"])
def test_greedy_with_an_image_equals_transformers(models, fixtures, name):
    model, refs = models[name], fixtures.refs(getattr(fixtures, name))
    result = generate(model, image_prompt(model, refs), max_new_tokens=GEN_TOKENS, temperature=0)
    assert result.token_ids == refs["gen_image.output_ids"][0].tolist()


class GenerationMembersOnly:
    """A loaded model seen through GenerationModel's members alone: generation may reach nothing else."""
    members = frozenset(GenerationModel.__annotations__) | {n for n in vars(GenerationModel) if not n.startswith("_")}

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name: str):
        if name not in self.members:
            raise AttributeError(f"generation used {name!r}, which GenerationModel does not name")
        return getattr(self.model, name)


def test_generation_needs_only_the_generation_model_members(model, fixtures):
    refs = fixtures.refs(fixtures.moe_hf)
    prompt, narrow = image_prompt(model, refs), GenerationMembersOnly(model)
    expected = refs["gen_image.output_ids"][0].tolist()
    assert generate(narrow, prompt, max_new_tokens=GEN_TOKENS, temperature=0).token_ids == expected
    prefix = prefill_prefix(narrow, model.text_before_images(prompt))
    results = generate_batch(narrow, [prompt, prompt], max_new_tokens=GEN_TOKENS, temperature=0, shared_prefix=prefix)
    assert [r.token_ids for r in results] == [expected, expected]


def test_ragged_batch_equals_single_runs(model, fixtures):
    refs = fixtures.refs(fixtures.moe_hf)
    prompts = [model.build_prompt("Describe the image in one sentence.", thinking=False), image_prompt(model, refs),
               model.build_prompt("Hi", system="You are a helpful assistant.", thinking=False)]
    assert len({len(p.input_ids) for p in prompts}) == 3
    singles = [generate(model, p, max_new_tokens=12, temperature=0) for p in prompts]
    # a stop string met by one row only, early, so that row leaves the batch while the others go on
    stop = unique_substring(singles[1].text, [s.text for s in (singles[0], singles[2])])
    singles = [generate(model, p, max_new_tokens=12, temperature=0, stop=stop) for p in prompts]
    assert [s.stop_reason for s in singles] == ["max_new_tokens", "stop_string", "max_new_tokens"]
    assert len(singles[1].token_ids) < 12
    streamed = {}
    batch = generate_batch(model, prompts, max_new_tokens=12, temperature=0, stop=stop,
                           on_text=lambda i, text: streamed.__setitem__(i, text))
    assert [b.token_ids for b in batch] == [s.token_ids for s in singles]
    assert [b.text for b in batch] == [s.text for s in singles]
    assert streamed == {i: b.full_text for i, b in enumerate(batch)}
    assert [b.stats["prompt_tokens"] for b in batch] == [len(p.input_ids) for p in prompts]


def unique_substring(text: str, others: list[str], size: int = 3) -> str:
    for start in range(len(text) // 3, len(text) - size):
        piece = text[start:start + size]
        if piece.strip() and "\ufffd" not in piece and not any(piece in other for other in others):
            return piece
    raise AssertionError(f"no substring of {text!r} is absent from the other outputs")


# ------------------------------------------------------------------------------------------------ sampling
def test_seeded_sampling_is_reproducible_and_seeds_differ(model):
    prompt = model.build_prompt("Describe the image in one sentence.", thinking=True)
    first = generate(model, prompt, max_new_tokens=16, seed=7)
    assert generate(model, prompt, max_new_tokens=16, seed=7).token_ids == first.token_ids
    assert generate(model, prompt, max_new_tokens=16, seed=8).token_ids != first.token_ids


def test_top_k_one_equals_greedy(model):
    prompt = model.build_prompt("Describe the image in one sentence.")
    greedy = generate(model, prompt, max_new_tokens=16, temperature=0)
    sampled = generate(model, prompt, max_new_tokens=16, temperature=1.0, top_k=1, presence_penalty=0, seed=3)
    assert sampled.token_ids == greedy.token_ids


def test_presence_penalty_applies_to_greedy_when_asked(model, fixtures):
    ids = fixtures.refs(fixtures.moe_hf)["gen_text.prompt_ids"][0]
    plain = generate(model, ids, max_new_tokens=GEN_TOKENS, temperature=0)
    assert len(set(plain.token_ids)) < GEN_TOKENS  # the greedy output repeats a token...
    penalized = generate(model, ids, max_new_tokens=GEN_TOKENS, temperature=0, presence_penalty=100.0)
    assert len(set(penalized.token_ids)) == GEN_TOKENS  # ...which a huge presence penalty forbids


# ---------------------------------------------------------------------------------------------- int8 cache
def test_int8_cache_stores_each_value_within_half_a_step(model):
    cfg = model.config.text
    cache = Cache(cfg, 2, 8, torch.float32, "cpu", kv_dtype="int8")
    k, v = (torch.randn(2, cfg.num_kv_heads, 5, cfg.head_dim, generator=torch.Generator().manual_seed(s)) * 3
            for s in (0, 1))
    k[0, 0, 0] = 0.0  # an all-zero vector must stay exact
    layer = next(iter(cache.keys))
    got_k, got_v = cache.append_kv(layer, k, v)
    for exact, got in ((k, got_k), (v, got_v)):
        step = exact.abs().amax(-1, keepdim=True) / 127
        assert ((got - exact).abs() <= step / 2 * (1 + 1e-5)).all()
        assert got.dtype == torch.float32 and got.shape == exact.shape
    assert (got_k[0, 0, 0] == 0).all()


def test_int8_cache_uses_the_memory_it_claims(model):
    cfg = model.config.text
    full_layers = cfg.layer_types.count("full_attention")
    batch, length = 2, 100
    plain = Cache(cfg, batch, length, torch.float32)
    int8 = Cache(cfg, batch, length, torch.float32, kv_dtype="int8")
    vectors = full_layers * 2 * batch * length * cfg.num_kv_heads  # (layer, k/v, row, token, head)
    assert plain.kv_bytes == vectors * cfg.head_dim * 4
    assert int8.kv_bytes == vectors * (cfg.head_dim + 4)  # int8 values plus one fp32 scale per vector
    assert all(t.dtype == torch.int8 for t in (*int8.keys.values(), *int8.values.values()))
    scratch = 2 * batch * length * cfg.num_kv_heads * cfg.head_dim * 4
    assert int8.nbytes - int8.kv_bytes == plain.nbytes - plain.kv_bytes + scratch


@pytest.mark.parametrize("group", ["gen_text", "gen_image"])
def test_int8_cache_logits_within_the_stated_bound(model, fixtures, group):
    refs = fixtures.refs(fixtures.moe_hf)
    prompt = image_prompt(model, refs) if group == "gen_image" else ChatPrompt(
        Prompt(tuple(refs["gen_text.prompt_ids"][0].tolist()), (), False, ""), EncodedImages([], []))
    tokens = refs[f"{group}.output_ids"][0]
    logits = {kv: teacher_forced_logits(model, prompt, tokens, kv) for kv in (None, "int8")}
    error = (logits["int8"] - logits[None]).abs().max()
    assert 0 < error <= INT8_LOGIT_TOLERANCE * logits[None].std()  # the bound models/qwen3_5/cache.py states


def teacher_forced_logits(model, prompt: ChatPrompt, tokens: torch.Tensor, kv_dtype) -> torch.Tensor:
    ids = torch.tensor([prompt.input_ids])
    images = prompt.images if len(prompt.images) else None
    cache = Cache(model.config.text, 1, ids.shape[1] + len(tokens), model.dtype, model.device, kv_dtype)
    positions, (delta,) = model.positions(ids, images)
    steps = [model.forward(ids, images, cache, position_ids=positions, last_only=True)[0, -1]]
    for token in tokens[:-1]:
        position = torch.full((3, 1, 1), cache.length + delta)
        steps.append(model.forward(token.view(1, 1), None, cache, position_ids=position, last_only=True)[0, -1])
    return torch.stack(steps)


def test_int8_generation_runs_and_reports_its_cache(model):
    """The reported cache is the one the planner sizes: keys/values in the cache's format, plus the DeltaNet state."""
    prompt = model.build_prompt("Describe the image in one sentence.")
    plain = generate(model, prompt, max_new_tokens=8, temperature=0)
    int8 = generate(model, prompt, max_new_tokens=8, temperature=0, kv_dtype="int8")
    assert len(int8.token_ids) == 8
    tokens = len(prompt.input_ids) + 8
    for kv_dtype, result in (("fp32", plain), ("int8", int8)):
        expected = kv_bytes(model.config, tokens, kv_dtype, "fp32") + deltanet_state_bytes(model.config)
        assert result.stats["kv_cache_bytes"] == expected, kv_dtype


# ------------------------------------------------------------------------------------ streaming and Stop
def test_should_stop_ends_within_one_token_and_the_next_call_works(model, fixtures):
    ids = fixtures.refs(fixtures.moe_hf)["gen_text.prompt_ids"][0]
    expected = fixtures.refs(fixtures.moe_hf)["gen_text.output_ids"][0].tolist()
    polls = []
    stopped = generate(model, ids, max_new_tokens=GEN_TOKENS, temperature=0,
                       should_stop=lambda: polls.append(1) or len(polls) >= 4)
    assert stopped.stop_reason == "cancelled"
    assert stopped.token_ids == expected[:3]  # polled before the prefill, then after tokens 1, 2 and 3
    assert generate(model, ids, max_new_tokens=GEN_TOKENS, temperature=0).token_ids == expected
    before = generate(model, ids, max_new_tokens=GEN_TOKENS, should_stop=lambda: True)
    assert before.token_ids == [] and before.stop_reason == "cancelled"


@pytest.mark.parametrize("thinking", [False, True])
def test_streamed_text_ends_as_the_final_text(model, thinking):
    prompt = model.build_prompt("Describe the image in one sentence.", thinking=thinking)
    streamed = []
    result = generate(model, prompt, max_new_tokens=24, seed=2, thinking_budget=8, on_text=streamed.append)
    assert len(streamed) > 5
    assert streamed[-1] == result.full_text
    if thinking:
        assert all(text.startswith("<think>\n") for text in streamed)


def test_stop_string_ends_the_answer_before_it(model):
    prompt = model.build_prompt("Describe the image in one sentence.", thinking=False)
    full = generate(model, prompt, max_new_tokens=24, temperature=0)
    stop = unique_substring(full.text, [])
    cut = generate(model, prompt, max_new_tokens=24, temperature=0, stop=["never there", stop])
    assert cut.stop_reason == "stop_string"
    assert cut.text == full.text[:full.text.index(stop)].strip()
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)]
    assert generate(model, prompt, max_new_tokens=24, temperature=0, stop=None).token_ids == full.token_ids


def tiny_tokenizer(model):
    return model.require_tokenizer()


def test_multibyte_characters_never_arrive_broken(model):
    tokenizer = tiny_tokenizer(model)
    text = "Fox 🦊 and 日本 café"
    ids = tokenizer.encode(text)
    fox_tokens = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert len(fox_tokens) >= 3  # the emoji is not in the tiny vocabulary: it spans several byte tokens
    output, streamed = SequenceOutput(tokenizer, thinking=None), []
    for token in ids:
        if output.add(token, frozenset()):
            streamed.append(output.live_text)
    assert streamed[-1] == text
    assert not any("\ufffd" in piece for piece in streamed)
    assert all(b.startswith(a) for a, b in zip(streamed, streamed[1:]))


# --------------------------------------------------------------------------------------------- thinking
def scripted(model, script: str, thinking, **options) -> SequenceOutput:
    """Feeds a scripted model output through the same per-sequence logic generate() uses."""
    tokenizer = tiny_tokenizer(model)
    output = SequenceOutput(tokenizer, thinking, think_close_id=tokenizer.token_id("</think>"),
                            budget_close=tokenizer.encode(BUDGET_CLOSE), **options)
    for token in tokenizer.encode(script):
        output.add(output.choose(token), frozenset())
    return output


def test_thinking_output_splits_at_the_close_tag(model):
    result = scripted(model, "Two shapes.\n</think>\n\nA red circle.", thinking=True).result({})
    assert (result.reasoning, result.text) == ("Two shapes.", "A red circle.")
    assert result.full_text == "<think>\nTwo shapes.\n</think>\n\nA red circle."
    still_thinking = scripted(model, "Two shapes and", thinking=True).result({})
    assert (still_thinking.reasoning, still_thinking.text) == ("Two shapes and", "")


def test_stop_strings_are_matched_in_the_answer_only(model):
    output = scripted(model, "the end is near\n</think>\n\nthe answer. the end", thinking=True, stop=("the end",))
    assert output.stop_reason == "stop_string"
    assert output.result({}).text == "the answer."


def test_non_thinking_answers_never_hold_reasoning():
    assert split_reasoning("<think>\nhmm\n</think>\n\nAnswer.", False) == ("hmm", "Answer.")
    assert split_reasoning("stray reasoning</think>Answer.", False) == ("stray reasoning", "Answer.")
    assert split_reasoning("Answer. <think>more", False) == ("more", "Answer.")
    assert split_reasoning("Plain answer.", False) == ("", "Plain answer.")
    assert split_reasoning("  raw <think> kept ", None) == ("", "  raw <think> kept ")


def test_thinking_budget_forces_the_close_and_lets_the_model_answer(model):
    tokenizer = tiny_tokenizer(model)
    prompt = model.build_prompt("Describe the image in one sentence.", thinking=True)
    close = tokenizer.encode(BUDGET_CLOSE)
    result = generate(model, prompt, max_new_tokens=20, seed=3, thinking_budget=5)
    assert result.token_ids[5:5 + len(close)] == close
    assert result.reasoning == tokenizer.decode(result.token_ids[:5], skip_special_tokens=True).strip()
    answer_ids = result.token_ids[5 + len(close):]
    assert len(answer_ids) == 20 - 5 - len(close)
    assert result.text == tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
    assert generate(model, prompt, max_new_tokens=6, seed=2, thinking_budget=0).token_ids[:len(close)] == close


# ------------------------------------------------------------------------------------------- stats, limits
def test_stats_report_the_run(model):
    prompt = model.build_prompt("Describe the image in one sentence.")
    result = generate(model, prompt, max_new_tokens=6, temperature=0)
    stats = result.stats
    assert stats["prompt_tokens"] == len(prompt.input_ids)
    assert stats["new_tokens"] == len(result.token_ids) == 6
    assert stats["stop_reason"] == result.stop_reason == "max_new_tokens"
    assert stats["ttft_s"] > 0 and stats["prefill_tok_s"] > 0 and stats["decode_tok_s"] > 0
    assert stats["peak_memory_bytes"] > 0
    # the cache is preallocated for the prompt plus max_new_tokens only
    cache = Cache(model.config.text, 1, len(prompt.input_ids) + 6, model.dtype)
    assert stats["kv_cache_bytes"] == cache.nbytes


def test_end_of_turn_token_stops_generation(fixtures):
    refs = fixtures.refs(fixtures.moe_hf)
    model = load_model(fixtures.moe_hf, preset="cpu", compute_dtype="float32")  # a copy whose head we change
    expected = refs["gen_text.output_ids"][0].tolist()
    step = 5
    target = expected[step]
    assert target not in expected[:step] and refs["gen_text.step_logits"][step, target] > 0
    im_end = model.require_tokenizer().token_id("<|im_end|>")
    assert im_end in model.config.text.eos_token_ids
    with torch.no_grad():  # <|im_end|> now scores 1% above `target` wherever that is positive
        model.text.lm_head.weight[im_end] = model.text.lm_head.weight[target] * 1.01
    result = generate(model, refs["gen_text.prompt_ids"][0], max_new_tokens=GEN_TOKENS, temperature=0)
    assert result.token_ids == expected[:step] + [im_end]
    assert result.stop_reason == "eos"
    assert result.text == model.require_tokenizer().decode(expected[:step], skip_special_tokens=True)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(prompt=[]), PromptError, "non-empty"),
    (dict(prompt="Describe"), PromptError, "ChatPrompt"),
    (dict(prompt=[[1, 2], [3, 4]]), PromptError, "generate_batch"),
    (dict(prompt=[1, 99999]), PromptError, "vocabulary"),
    (dict(max_new_tokens=0), GenerationError, "max_new_tokens"),
    (dict(max_new_tokens=2.5), GenerationError, "max_new_tokens"),
    (dict(max_context=20), PromptError, "max_context=20"),
    (dict(max_new_tokens=40000), PromptError, "max_context"),  # the cpu plan's context is 32768
    (dict(max_context=10 ** 9), GenerationError, "max_position_embeddings"),
    (dict(temperature=-1), GenerationError, "temperature"),
    (dict(top_p=0), GenerationError, "top_p"),
    (dict(top_k=-1), GenerationError, "top_k"),
    (dict(min_p=2), GenerationError, "min_p"),
    (dict(repetition_penalty=0), GenerationError, "repetition_penalty"),
    (dict(kv_dtype="int4"), GenerationError, "kv_dtype"),
    (dict(thinking_budget=-1), GenerationError, "thinking_budget"),
    (dict(seed="lucky"), GenerationError, "seed"),
    (dict(stop=[1]), GenerationError, "stop"),
])
def test_bad_inputs_raise_clear_errors(model, kwargs, error, words):
    kwargs = {"prompt": list(range(30)), "max_new_tokens": 4} | kwargs
    with pytest.raises(error, match=words):
        generate(model, **kwargs)


def test_bad_batches_raise_clear_errors(model):
    with pytest.raises(PromptError, match="non-empty list"):
        generate_batch(model, [])
    with pytest.raises(PromptError, match="prompt 1"):
        generate_batch(model, [[1, 2], []])
    mixed = [model.build_prompt("a", thinking=True), model.build_prompt("b", thinking=False)]
    with pytest.raises(GenerationError, match="mix thinking"):
        generate_batch(model, mixed)
