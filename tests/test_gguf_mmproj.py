"""GGUF vision projectors (mmproj) as llama.cpp's converter writes them (--mmproj) from the tiny Qwen3.5-MoE and
Qwen3-VL-MoE fixtures: every vision tensor equals the release's, the vision_config from the metadata is the release's,
a GGUF model with its mmproj gives the folder's image logits, the mmproj beside a model is found, and an mmproj of
another model, an unclear choice of mmproj, and images without one are refused by name."""
from pathlib import Path

import numpy as np
import pytest
import torch

from a3b_core import load_model
from a3b_core.errors import CheckpointError, ConfigError, ImageError
from a3b_core.models.vision import parse_vision_config
from a3b_core.release.config import read_config
from a3b_core.release.gguf_mmproj import MmprojCheckpoint, find_mmproj
from a3b_core.release.safetensors import Checkpoint
from tests.tiny_models import build_fixtures
from tests.tiny_qwen3_vl import build_qwen3_vl_fixtures

gguf = pytest.importorskip("gguf", reason="the gguf package (requirements.txt) is not installed")
pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["qwen3_5", "qwen3_vl"]
TOL = 1e-4


@pytest.fixture(scope="module")
def pairs(ggufs):
    """family -> (the model's GGUF, its mmproj, the release folder both were converted from)."""
    return {"qwen3_5": (ggufs.moe_f32, ggufs.moe_mmproj_f32, build_fixtures().moe_hf),
            "qwen3_vl": (ggufs.vl_moe_f32, ggufs.vl_moe_mmproj_f32, build_qwen3_vl_fixtures().moe_bf16)}


def side_by_side(folder: Path, model: Path, **mmprojs: Path) -> Path:
    """A folder holding the model as model.gguf and each mmproj under its given name (links, not copies)."""
    folder.mkdir(exist_ok=True)
    (folder / "model.gguf").symlink_to(model)
    for name, path in mmprojs.items():
        (folder / f"{name}.gguf").symlink_to(path)
    return folder / "model.gguf"


def rewritten(source: Path, out: Path, metadata: dict | None = None, q8_0: bool = False) -> Path:
    """A copy of an mmproj with some metadata values replaced, or with its matrices stored as Q8_0."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, arch="clip")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = (metadata or {}).get(key, field.contents())
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type)
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        if q8_0 and data.ndim == 2 and data.shape[-1] % 32 == 0:
            writer.add_tensor(tensor.name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def image_logits(model, image: Path, input_ids: torch.Tensor) -> torch.Tensor:
    return model.logits(input_ids, images=model.encode_images(image, resize="native"))


# ------------------------------------------------------------------------------------------------ tensors, config
@pytest.mark.parametrize("family", FAMILIES)
def test_every_vision_tensor_of_the_release_equals_the_mmprojs(pairs, family):
    _, mmproj, folder = pairs[family]
    release, ckpt = Checkpoint(folder), MmprojCheckpoint(mmproj)
    vision = {name for name in release.infos if ".visual." in name}
    assert set(ckpt.infos) == vision
    for name in sorted(vision):
        want = release.weight(name, release.infos[name].dtype)
        got = ckpt.raw(name)
        assert got.shape == want.shape == ckpt.infos[name].shape, name
        assert torch.equal(got, want.to(got.dtype)), name  # f32 mmproj of a bf16/f32 release: exact


@pytest.mark.parametrize("family", FAMILIES)
def test_the_vision_config_from_the_metadata_is_the_releases(pairs, family):
    _, mmproj, folder = pairs[family]
    ours = parse_vision_config(MmprojCheckpoint(mmproj).vision_config, str(mmproj))
    theirs = parse_vision_config(read_config(folder)["vision_config"], str(folder))
    assert ours == theirs
    assert bool(ours.deepstack_indexes) == (family == "qwen3_vl")


def test_q8_0_matrices_are_dequantized(pairs, tmp_path):
    _, mmproj, _ = pairs["qwen3_vl"]
    exact, quantized = MmprojCheckpoint(mmproj), MmprojCheckpoint(rewritten(mmproj, tmp_path / "q8.gguf", q8_0=True))
    stored = {r.sources[0].type_name for r in quantized.infos.values()}
    assert "Q8_0" in stored
    for name, info in exact.infos.items():
        got, want = quantized.raw(name), exact.raw(name)
        assert got.shape == want.shape and got.dtype == torch.float32
        # Q8_0: one scale per 32 values, 8-bit steps of max|block| / 127
        assert (got - want).abs().max() <= want.abs().max() / 127 + 1e-6, name


# ------------------------------------------------------------------------------------------------ load_model
@pytest.mark.parametrize("family", FAMILIES)
def test_image_logits_of_a_gguf_with_its_mmproj_equal_the_folders(pairs, family):
    model_file, mmproj, folder = pairs[family]
    image = build_qwen3_vl_fixtures().square_image
    ours = load_model(model_file, preset="cpu", compute_dtype="float32", mmproj=mmproj)
    theirs = load_model(folder, preset="cpu", compute_dtype="float32")
    assert ours.vision is not None and ours.config.vision == theirs.config.vision
    # one prompt for both (the tiny GGUFs' chat template is a text-only one)
    images = theirs.encode_images(image, resize="native")
    ids = torch.tensor([theirs.build_prompt(user="Describe [[IMG]] briefly.", images=images).input_ids])
    torch.testing.assert_close(image_logits(ours, image, ids), image_logits(theirs, image, ids), rtol=0, atol=TOL)


def test_auto_finds_the_mmproj_beside_the_model(pairs, tmp_path):
    model_file, mmproj, _ = pairs["qwen3_vl"]
    beside = side_by_side(tmp_path, model_file, **{"mmproj-model-F32": mmproj})
    assert find_mmproj(beside) == tmp_path / "mmproj-model-F32.gguf"
    model = load_model(beside, preset="cpu", compute_dtype="float32")
    assert model.vision is not None and model.config.vision.deepstack_indexes == (0, 2, 3)
    assert len(model.encode_images(build_qwen3_vl_fixtures().square_image).embeds) == 1


def test_without_an_mmproj_a_gguf_loads_text_only_and_refuses_images(pairs, tmp_path):
    model_file, mmproj, _ = pairs["qwen3_vl"]
    beside = side_by_side(tmp_path, model_file, **{"mmproj-model-F32": mmproj})
    for model in (load_model(beside, preset="cpu", compute_dtype="float32", mmproj="none"),
                  load_model(model_file, preset="cpu", compute_dtype="float32")):  # no mmproj* file beside it
        assert model.vision is None and model.config.vision is None
        with pytest.raises(ImageError, match=r"put the mmproj file beside the model or pass mmproj="):
            model.encode_images(build_qwen3_vl_fixtures().square_image)


def test_the_converted_experts_are_cached_once_with_or_without_the_mmproj(pairs, tmp_path, monkeypatch):
    model_file, mmproj, _ = pairs["qwen3_vl"]
    beside = side_by_side(tmp_path / "models", model_file, **{"mmproj-model-F32": mmproj})
    monkeypatch.setenv("A3B_CACHE_DIR", str(tmp_path / "cache"))
    for choice in ("auto", "none"):
        model = load_model(beside, preset="cpu", compute_dtype="float32", weight_format="int8", mmproj=choice)
        assert (model.vision is not None) == (choice == "auto") and model.plan.expert_format_cpu == "int8"
    assert len(list((tmp_path / "cache" / "experts").iterdir())) == 1


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("family", FAMILIES)
def test_the_mmproj_of_the_other_family_is_refused(pairs, family):
    model_file, _, _ = pairs[family]
    _, other, _ = pairs["qwen3_vl" if family == "qwen3_5" else "qwen3_5"]
    with pytest.raises(CheckpointError, match="an mmproj of another model") as refused:
        load_model(model_file, preset="cpu", compute_dtype="float32", mmproj=other)
    assert str(other) in str(refused.value) and str(model_file) in str(refused.value)


def test_an_mmproj_of_other_sizes_is_refused(pairs, tmp_path):
    model_file, mmproj, _ = pairs["qwen3_vl"]
    wider = rewritten(mmproj, tmp_path / "mmproj-wider.gguf", {"clip.vision.projection_dim": 256})
    with pytest.raises(CheckpointError, match=r"projects images to 256 features .* hidden size 128: an mmproj of "
                                              r"another model"):
        load_model(model_file, preset="cpu", compute_dtype="float32", mmproj=wider)


def test_an_mmproj_with_other_image_normalization_is_refused(pairs, tmp_path):
    _, mmproj, _ = pairs["qwen3_5"]
    clip_mean = rewritten(mmproj, tmp_path / "mmproj-clip.gguf",
                          {"clip.vision.image_mean": [0.48145466, 0.4578275, 0.40821073]})
    with pytest.raises(CheckpointError, match=r"clip.vision.image_mean .* an mmproj of another model"):
        MmprojCheckpoint(clip_mean)


def test_the_text_model_is_refused_as_an_mmproj(pairs):
    model_file, _, _ = pairs["qwen3_vl"]
    with pytest.raises(CheckpointError, match="not a vision projector"):
        load_model(model_file, preset="cpu", compute_dtype="float32", mmproj=model_file)


def test_two_mmproj_candidates_with_auto_are_refused_unless_one_shares_the_models_name(tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    for name in ("Qwen3-VL-30B-A3B-Q8_0.gguf", "mmproj-Qwen3-VL-30B-A3B-F16.gguf", "mmproj-Qwen3.5-35B-A3B-F16.gguf"):
        (folder / name).write_bytes(b"")
    assert find_mmproj(folder / "Qwen3-VL-30B-A3B-Q8_0.gguf") == folder / "mmproj-Qwen3-VL-30B-A3B-F16.gguf"
    (folder / "mmproj-Qwen3-VL-30B-A3B-BF16.gguf").write_bytes(b"")  # two of the same model: no clear choice
    with pytest.raises(CheckpointError, match=r"3 vision projectors .*mmproj-Qwen3-VL-30B-A3B-BF16.gguf.* mmproj="):
        find_mmproj(folder / "Qwen3-VL-30B-A3B-Q8_0.gguf")
    assert find_mmproj(tmp_path / "alone.gguf") is None


def test_two_mmproj_files_beside_a_model_stop_load_model_with_auto(pairs, tmp_path):
    model_file, mmproj, _ = pairs["qwen3_vl"]
    _, other, _ = pairs["qwen3_5"]
    beside = side_by_side(tmp_path, model_file, **{"mmproj-a": mmproj, "mmproj-b": other})
    with pytest.raises(CheckpointError, match=r"mmproj-a.gguf, mmproj-b.gguf\) and none is clearly its own"):
        load_model(beside, preset="cpu", compute_dtype="float32")
    model = load_model(beside, preset="cpu", compute_dtype="float32", mmproj=tmp_path / "mmproj-a.gguf")
    assert model.vision is not None


def test_an_mmproj_for_a_model_folder_is_refused(pairs):
    _, mmproj, folder = pairs["qwen3_vl"]
    with pytest.raises(ConfigError, match="for a .gguf model only"):
        load_model(folder, preset="cpu", compute_dtype="float32", mmproj=mmproj)


def test_the_cli_reads_the_mmproj(pairs, tmp_path, capsys):
    from a3b_core.__main__ import main
    model_file, mmproj, _ = pairs["qwen3_vl"]
    assert main(["inspect", str(model_file), "--mmproj", str(mmproj)]) == 0
    with_vision = capsys.readouterr().out
    assert main(["inspect", str(model_file), "--mmproj", "none"]) == 0
    assert "in 2 files" in with_vision and "in 1 files" in capsys.readouterr().out
    assert main(["plan", str(model_file), "--preset", "cpu", "--mmproj", str(mmproj)]) == 0
    assert "vision" in capsys.readouterr().out


def test_the_loader_node_lists_and_resolves_the_mmproj_files_under_models_llm(tmp_path):
    from nodes.model_folders import list_mmproj_files, mmproj_choices, resolve_mmproj
    root = tmp_path / "LLM"
    (root / "Qwen3-VL-GGUF").mkdir(parents=True)
    for name in ("Qwen3-VL-GGUF/Qwen3-VL-30B-A3B-F16.gguf", "Qwen3-VL-GGUF/mmproj-Qwen3-VL-30B-A3B-F16.gguf",
                 "mmproj-other.gguf", "mmproj-notes.txt"):
        (root / name).write_bytes(b"")
    files = ["Qwen3-VL-GGUF/mmproj-Qwen3-VL-30B-A3B-F16.gguf", "mmproj-other.gguf"]
    assert list_mmproj_files([str(root), str(tmp_path / "missing")]) == files
    assert mmproj_choices([str(root)]) == ["auto", "none", *files]
    assert resolve_mmproj(files[0], [str(tmp_path), str(root)]) == str(root / files[0])
    assert resolve_mmproj("auto", []) == "auto" and resolve_mmproj("none", []) == "none"
    for outside in ("../mmproj-other.gguf", str(root / "mmproj-other.gguf"), "Qwen3-VL-GGUF/Qwen3-VL-30B-A3B-F16.gguf"):
        with pytest.raises(ConfigError, match="was not found in"):
            resolve_mmproj(outside, [str(root / "Qwen3-VL-GGUF")])
