"""PEFT LoRA adapters through the engine vs peft itself (tests/tiny_loras.py): every adapter's logits on the text
prompt (and on the image prompt for the adapters that touch the vision tower), strength 0.5, two adapters at once,
removal giving the base model back bit for bit, and an adapter for another family refused."""
from pathlib import Path
from typing import Callable

import pytest
import torch

from a3b_core import load_model
from a3b_core.errors import A3BError
from tests.tiny_loras import ADAPTERS, LoraFixtures, build_lora_fixtures
from tests.tiny_qwen3_vl import VlFixtures, build_qwen3_vl_fixtures

TOL = 1e-4
MOE_ADAPTERS = [name for name, spec in ADAPTERS.items() if spec.base == "moe"]

pytestmark = pytest.mark.usefixtures("one_thread")


def _load(folder: Path, **kwargs):
    return load_model(folder, preset="cpu", compute_dtype="float32", **kwargs)


@pytest.fixture(scope="module")
def vl() -> VlFixtures:
    return build_qwen3_vl_fixtures()


@pytest.fixture(scope="module")
def loras() -> LoraFixtures:
    return build_lora_fixtures()


@pytest.fixture(scope="module")
def refs(loras) -> dict[str, torch.Tensor]:
    return loras.refs()


@pytest.fixture(scope="module")
def folders(fixtures, vl) -> dict[str, Path]:
    """The base checkpoints by the names tiny_loras.ADAPTERS uses."""
    return {"moe": fixtures.moe_hf, "dense": fixtures.dense, "moe_text": fixtures.moe_text, "vl_moe": vl.moe_hf}


@pytest.fixture(scope="module")
def engines(folders) -> Callable:
    """One engine model per base, loaded once on first use; each test sets the adapters it needs."""
    loaded = {}

    def engine(base: str):
        if base not in loaded:
            loaded[base] = _load(folders[base])
        return loaded[base]
    return engine


@pytest.fixture(scope="module")
def plain_moe(fixtures):
    """The Qwen3.5 MoE model never given an adapter: what removing every adapter must give back exactly."""
    return _load(fixtures.moe_hf)


def _image_logits(model, image: Path, refs: dict[str, torch.Tensor]) -> torch.Tensor:
    images = model.encode_images([image], size=384, resize="stretch")
    return model.logits(refs["image_a.input_ids"], images=images)


def _square_image(base: str, fixtures, vl) -> Path:
    return vl.square_image if base == "vl_moe" else fixtures.square_image


@pytest.mark.parametrize("base", ["moe", "dense", "moe_text", "vl_moe"])
def test_no_adapter_is_the_base(engines, refs, base):
    model = engines(base)
    model.set_loras([])
    torch.testing.assert_close(model.logits(refs["text.input_ids"]), refs[f"base.{base}.text.logits"],
                               atol=TOL, rtol=TOL)


@pytest.mark.parametrize("name", ADAPTERS)
def test_adapter_matches_peft(fixtures, vl, loras, refs, engines, name):
    spec = ADAPTERS[name]
    model = engines(spec.base)
    model.set_loras([(getattr(loras, name), 1.0)])
    torch.testing.assert_close(model.logits(refs["text.input_ids"]), refs[f"{name}.text.logits"], atol=TOL, rtol=TOL)
    if spec.vision:
        torch.testing.assert_close(_image_logits(model, _square_image(spec.base, fixtures, vl), refs),
                                   refs[f"{name}.image_a.logits"], atol=TOL, rtol=TOL)


def test_adapter_changes_the_logits(refs):
    """The references are not the base: an engine ignoring the adapters fails test_adapter_matches_peft."""
    for name, spec in ADAPTERS.items():
        for group in (["text", "image_a"] if spec.vision else ["text"]):
            if (name, group) == ("moe_vision", "text"):
                continue  # a vision-only adapter leaves a text-only prompt alone
            change = (refs[f"{name}.{group}.logits"] - refs[f"base.{spec.base}.{group}.logits"]).abs().max()
            assert change > 100 * TOL, (name, group, change)


def test_half_strength(loras, refs, engines):
    model = engines("moe")
    model.set_loras([(loras.moe_all, 0.5)])
    torch.testing.assert_close(model.logits(refs["text.input_ids"]), refs["moe_all@0.5.text.logits"],
                               atol=TOL, rtol=TOL)


@pytest.mark.parametrize("order", [["moe_all", "moe_second"], ["moe_second", "moe_all"]])
def test_two_adapters_at_once(loras, refs, engines, order):
    model = engines("moe")
    model.set_loras([(getattr(loras, name), 1.0) for name in order])
    torch.testing.assert_close(model.logits(refs["text.input_ids"]), refs["moe_all+moe_second.text.logits"],
                               atol=TOL, rtol=TOL)


def test_adapter_given_as_str(loras, refs, engines):
    model = engines("moe")
    model.set_loras([(str(loras.moe_second), 1.0)])
    torch.testing.assert_close(model.logits(refs["text.input_ids"]), refs["moe_second.text.logits"],
                               atol=TOL, rtol=TOL)


def test_load_model_with_loras_then_off_and_on(fixtures, loras, refs, plain_moe):
    ids = refs["text.input_ids"]
    model = _load(fixtures.moe_hf, loras=[(loras.moe_all, 1.0)])
    torch.testing.assert_close(model.logits(ids), refs["moe_all.text.logits"], atol=TOL, rtol=TOL)
    model.set_loras([])
    assert torch.equal(model.logits(ids), plain_moe.logits(ids))
    model.set_loras([(loras.moe_all, 1.0)])
    torch.testing.assert_close(model.logits(ids), refs["moe_all.text.logits"], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("name", MOE_ADAPTERS)
def test_removal_gives_the_base_back_exactly(fixtures, loras, refs, engines, plain_moe, name):
    model, ids = engines("moe"), refs["text.input_ids"]
    model.set_loras([(getattr(loras, name), 1.0)])
    model.logits(ids)
    _image_logits(model, fixtures.square_image, refs)
    model.set_loras([])
    assert torch.equal(model.logits(ids), plain_moe.logits(ids))
    assert torch.equal(_image_logits(model, fixtures.square_image, refs),
                       _image_logits(plain_moe, fixtures.square_image, refs))


@pytest.mark.parametrize("base, adapter", [("moe", "vl_all"), ("vl_moe", "moe_all")])
def test_adapter_for_another_family_is_refused(folders, loras, base, adapter):
    with pytest.raises(A3BError):
        _load(folders[base], loras=[(getattr(loras, adapter), 1.0)])
    model = _load(folders[base])
    with pytest.raises(A3BError):
        model.set_loras([(getattr(loras, adapter), 1.0)])
