"""A shared prompt prefix prefilled once (generation.prefill_prefix) and reused by generate_batch: the logits and
greedy tokens equal prefilling the whole prompts, on Qwen3.5 (DeltaNet state + KV) and Qwen3-VL (KV only), for images
of different sizes and a row that stops early; a folder run prefills its prefix once; misuse is refused."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from a3b_core import GenerationError, PromptError, load_model
from a3b_core.runtime.generation import generate_batch, prefill_prefix
from a3b_core.runtime.options import GenerationOptions
from a3b_core.services.caption_folder import FolderJob, run_to_end
from tests.test_bad_inputs import FIX
from tests.tiny_models import synthetic_image
from tests.tiny_qwen3_vl import build_qwen3_vl_fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = (256, 256, 320, 256)  # the first two rows have as many tokens after the prefix; the third has more
NEW_TOKENS = 12
LOGIT_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def folders(fixtures) -> dict[str, Path]:
    return {"qwen3_5_moe": fixtures.moe_hf, "qwen3_5_dense": fixtures.dense,
            "qwen3_vl_moe": build_qwen3_vl_fixtures().moe_hf}


@pytest.fixture(scope="module")
def models(folders):
    return {name: load_model(folder, preset="cpu", compute_dtype="float32") for name, folder in folders.items()}


def image_prompts(model) -> list:
    """A system message and an instruction before the image (the shared prefix), then images of SIZES."""
    prompts = []
    for seed, size in enumerate(SIZES):
        images = model.encode_images([synthetic_image(120, 90, seed)], size=size)
        prompts.append(model.build_prompt("Describe this picture: [[IMG]] Answer in one sentence.",
                                          system="You write short captions.", images=images))
    return prompts


class ForwardLog:
    """Every pass of the text model: its input shape [B, T] and its logits, via a forward hook."""

    def __init__(self, model):
        self.calls: list[tuple[tuple[int, int], torch.Tensor]] = []
        self.handle = model.text.register_forward_hook(
            lambda _module, args, output: self.calls.append((tuple(args[0].shape[:2]), output.clone())))

    def __enter__(self) -> "ForwardLog":
        return self

    def __exit__(self, *_exc) -> None:
        self.handle.remove()

    @property
    def prefills(self) -> list[tuple[tuple[int, int], torch.Tensor]]:
        return [(shape, logits) for shape, logits in self.calls if shape[1] > 1]

    @property
    def steps(self) -> list[torch.Tensor]:
        return [logits for shape, logits in self.calls if shape[1] == 1]


def early_end_token(outputs: list[list[int]]) -> int:
    """A token some rows write after their first token and the others never write: as an end token, it ends those
    rows early while the others go on."""
    for token in dict.fromkeys(t for row in outputs for t in row[1:-1]):
        if not any(token in row for row in outputs) or all(token in row for row in outputs):
            continue
        if all(row.index(token) >= 1 for row in outputs if token in row):
            return token
    raise AssertionError(f"no token ends some rows only: {outputs}")


def with_end_token(folder: Path, token: int):
    """The model of `folder`, loaded, with `token` as one more end token (set after loading: the loader accepts only
    control tokens as end tokens, and the tiny models' answers are ordinary tokens)."""
    model = load_model(folder, preset="cpu", compute_dtype="float32")
    text = dataclasses.replace(model.config.text, eos_token_ids=(*model.config.text.eos_token_ids, token))
    model.config = dataclasses.replace(model.config, text=text)
    return model


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_5_dense", "qwen3_vl_moe"])
def test_reused_prefix_gives_the_logits_and_tokens_of_whole_prompts(models, folders, name):
    plain = generate_batch(models[name], image_prompts(models[name]), max_new_tokens=NEW_TOKENS, temperature=0)
    end = early_end_token([r.token_ids for r in plain])
    model = with_end_token(folders[name], end)
    prompts = image_prompts(model)
    lengths = [len(p.input_ids) for p in prompts]
    prefix = prefill_prefix(model, model.text_before_images(prompts[0]))
    n = len(prefix.ids)
    assert n >= 10 and lengths[0] == lengths[1] < lengths[2] and lengths[3] == lengths[0]

    with ForwardLog(model) as whole:
        expected = generate_batch(model, prompts, max_new_tokens=NEW_TOKENS, temperature=0)
    with ForwardLog(model) as reused:
        got = generate_batch(model, prompts, max_new_tokens=NEW_TOKENS, temperature=0, shared_prefix=prefix)

    reasons = [r.stop_reason for r in expected]
    assert "eos" in reasons and "max_new_tokens" in reasons, reasons  # some rows leave the batch early
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert [r.stop_reason for r in got] == [r.stop_reason for r in expected]
    # whole prompts: one left-padded prefill; reused: the rows after the prefix, equal lengths together, unpadded
    assert [shape for shape, _ in whole.prefills] == [(4, max(lengths))]
    suffix = [length - n for length in lengths]
    assert [shape for shape, _ in reused.prefills] == [(2, suffix[0]), (1, suffix[2]), (1, suffix[3])]
    first_whole = whole.prefills[0][1]
    first_reused = torch.cat([logits for _, logits in reused.prefills])
    torch.testing.assert_close(first_reused, first_whole, rtol=0, atol=LOGIT_TOLERANCE)
    assert len(reused.steps) == len(whole.steps) > 1
    for step_reused, step_whole in zip(reused.steps, whole.steps):  # the early row leaves the batch in both
        torch.testing.assert_close(step_reused, step_whole, rtol=0, atol=LOGIT_TOLERANCE)
    # the same prefix serves another call, in another order, unchanged by the first
    again = generate_batch(model, prompts[::-1], max_new_tokens=NEW_TOKENS, temperature=0, shared_prefix=prefix)
    assert [r.token_ids for r in again] == [r.token_ids for r in expected][::-1]


def test_int8_cache_with_a_prefix_equals_int8_without(models):
    model = models["qwen3_5_moe"]
    prompts = image_prompts(model)
    prefix = prefill_prefix(model, model.text_before_images(prompts[0]), kv_dtype="int8")
    expected = generate_batch(model, prompts, max_new_tokens=NEW_TOKENS, temperature=0, kv_dtype="int8")
    got = generate_batch(model, prompts, max_new_tokens=NEW_TOKENS, temperature=0, kv_dtype="int8",
                         shared_prefix=prefix)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]


def test_prefill_speed_counts_only_the_tokens_prefilled_after_the_prefix(models):
    model = models["qwen3_5_moe"]
    prompts = image_prompts(model)
    prefix = prefill_prefix(model, model.text_before_images(prompts[0]))
    stats = generate_batch(model, prompts, max_new_tokens=2, temperature=0, shared_prefix=prefix)[0].stats
    prefilled = sum(len(p.input_ids) - len(prefix.ids) for p in prompts)
    assert stats["prefill_tok_s"] * stats["ttft_s"] == pytest.approx(prefilled)
    whole = generate_batch(model, prompts, max_new_tokens=2, temperature=0)[0].stats
    assert whole["prefill_tok_s"] * whole["ttft_s"] == pytest.approx(sum(len(p.input_ids) for p in prompts))


def test_a_folder_run_prefills_its_prefix_once(tmp_path: Path):
    model = load_model("a3b-demo")
    folder = tmp_path / "images"
    folder.mkdir()
    for seed in range(5):
        synthetic_image(200, 150, seed).save(folder / f"{seed}.png")
    images = model.encode_images([folder / f"{seed}.png" for seed in range(5)], size=256)
    prompts = [model.build_prompt(user=model.caption_prompt, images=images[i]) for i in range(5)]
    prefix = model.text_before_images(prompts[0])
    assert len(prefix) > 1 and all(list(p.input_ids[:len(prefix)]) == prefix for p in prompts)
    whole = sum(len(p.input_ids) for p in prompts)
    captions = {}
    for reuse, prefilled in ((True, len(prefix) + whole - 5 * len(prefix)), (False, whole)):
        job = FolderJob(folder, output_dir=tmp_path / f"captions-{reuse}", batch_size=2, size=256, reuse_prefix=reuse,
                        generation=GenerationOptions(max_new_tokens=8, temperature=0.0, presence_penalty=0.0))
        with ForwardLog(model) as log:
            outcomes, stopped = run_to_end(model, job)
        assert not stopped and [o.status for o in outcomes] == ["written"] * 5
        assert sum(b * t for (b, t), _ in log.prefills) == prefilled  # three batches, the prefix once (reused)
        assert sum(shape == (1, len(prefix)) for shape, _ in log.prefills) == reuse
        captions[reuse] = [o.caption for o in outcomes]
    assert captions[True] == captions[False]


def test_misused_prefixes_are_refused(models, fixtures):
    model, other = models["qwen3_5_moe"], models["qwen3_5_dense"]
    prompts = image_prompts(model)
    head = model.text_before_images(prompts[0])
    prefix = prefill_prefix(model, head)
    refusals = [
        (PromptError, lambda: prefill_prefix(model, list(prompts[0].input_ids))),  # holds image pads
        (PromptError, lambda: generate_batch(model, [prompts[0], model.build_prompt("Hi")], shared_prefix=prefix)),
        (PromptError, lambda: generate_batch(model, [head], shared_prefix=prefix)),  # nothing after the prefix
        (GenerationError, lambda: generate_batch(model, prompts, kv_dtype="int8", shared_prefix=prefix)),
        (GenerationError, lambda: generate_batch(other, image_prompts(other), shared_prefix=prefix)),
    ]
    for error, call in refusals:
        with pytest.raises(error) as caught:
            call()
        assert FIX.search(str(caught.value)), str(caught.value)
