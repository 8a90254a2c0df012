"""A GGUF split by gguf-split is one model: any part opens the whole set, which gives the single file's logits, and
a set with a part missing, a part of another set, parts out of place or a tensor in two parts is refused by name."""
import shutil

import pytest
import torch

from a3b_core import load_model
from a3b_core.errors import CheckpointError
from a3b_core.release.gguf import GGUFCheckpoint
from tests.tiny_models import TEXT_PROMPT

gguf = pytest.importorskip("gguf", reason="the gguf package (requirements.txt) is not installed")
from tests.split_gguf import tensor_groups, write_split_set  # noqa: E402 (needs gguf)


def split(source, folder, count=3):
    folder.mkdir(exist_ok=True)
    return write_split_set(source, folder / source.stem, tensor_groups(source, count))


@pytest.mark.parametrize("name", ["moe_f32", "vl_moe_f32"])
def test_any_part_of_a_split_set_loads_the_single_files_model(ggufs, tmp_path, name, one_thread):
    single = getattr(ggufs, name)
    parts = split(single, tmp_path)
    ckpt = GGUFCheckpoint(parts[-1])
    assert ckpt.files == parts and ckpt.path == parts[0]
    assert {info.file for info in ckpt.infos.values()} == set(parts)
    assert set(ckpt.infos) == set(GGUFCheckpoint(single).infos)
    ckpt.close()
    ours = load_model(parts[1], preset="cpu", compute_dtype="float32")
    theirs = load_model(single, preset="cpu", compute_dtype="float32")
    ids = torch.tensor([theirs.tokenizer.encode(TEXT_PROMPT)])
    assert ours.tokenizer.encode(TEXT_PROMPT) == ids[0].tolist()
    torch.testing.assert_close(ours.logits(ids), theirs.logits(ids), rtol=0, atol=0)
    assert ours.chat_template_in_use == "model folder: GGUF tokenizer.chat_template"


def test_inspect_counts_the_parts(ggufs, tmp_path, capsys):
    from a3b_core.__main__ import main
    parts = split(ggufs.moe_f32, tmp_path)
    assert main(["inspect", str(parts[0])]) == 0
    assert "72 in 3 files" in capsys.readouterr().out


def test_a_missing_part_is_named(ggufs, tmp_path):
    parts = split(ggufs.moe_f32, tmp_path)
    parts[1].unlink()
    for passed in (parts[0], parts[2]):
        with pytest.raises(CheckpointError, match=f"{parts[1].name} is missing from {tmp_path}"):
            GGUFCheckpoint(passed)


def test_a_part_of_another_set_is_named(ggufs, tmp_path):
    parts = split(ggufs.moe_f32, tmp_path / "moe")
    foreign = split(ggufs.dense_f32, tmp_path / "dense")
    shutil.copyfile(foreign[1], parts[1])
    with pytest.raises(CheckpointError, match="split.tensors.count is .* belongs to another split set") as refused:
        GGUFCheckpoint(parts[0])
    assert str(parts[1]) in str(refused.value)


def test_parts_out_of_place_are_named(ggufs, tmp_path):
    parts = split(ggufs.moe_f32, tmp_path)
    parts[1].rename(tmp_path / "swap")
    parts[2].rename(parts[1])
    (tmp_path / "swap").rename(parts[2])
    with pytest.raises(CheckpointError, match=f"{parts[1]}: named part 2 of 3, the file is part 3 of 3"):
        GGUFCheckpoint(parts[0])


def test_a_part_renamed_away_from_its_set_is_refused(ggufs, tmp_path):
    parts = split(ggufs.moe_f32, tmp_path)
    renamed = parts[0].rename(tmp_path / "model.gguf")
    with pytest.raises(CheckpointError, match="part 1 of a GGUF split into 3 parts, but its name is not a part's"):
        GGUFCheckpoint(renamed)


def test_a_tensor_in_two_parts_is_named(ggufs, tmp_path):
    groups = tensor_groups(ggufs.moe_f32, 2)
    twice = groups[0][-1]
    parts = write_split_set(ggufs.moe_f32, tmp_path / "moe", [groups[0], [twice, *groups[1]]])
    with pytest.raises(CheckpointError, match=f"{parts[1]}: tensor '{twice}' is also in {parts[0].name}"):
        GGUFCheckpoint(parts[0])


def test_a_set_short_of_its_tensor_count_is_refused(ggufs, tmp_path):
    groups = tensor_groups(ggufs.moe_f32, 2)
    held = sum(map(len, groups))
    parts = write_split_set(ggufs.moe_f32, tmp_path / "moe", groups, tensors_count=held + 1)
    with pytest.raises(CheckpointError, match=f"{parts[0]}: the 2 parts hold {held} tensors, but "
                                              f"split.tensors.count says {held + 1}"):
        GGUFCheckpoint(parts[1])
