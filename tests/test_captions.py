"""A3B Save Captions without ComfyUI: every caption file, and the optional combined file, lands inside the output
folder (after links are resolved), names follow the images or are numbered, files are written atomically with
ordinary permissions, and every bad input is a ConfigError that names the input and the fix."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from a3b_core.errors import ConfigError
from nodes.captions import NAME_MAX, caption_stems, caption_text, confined_folder, save_captions, write_text_atomic
from tests.test_bad_inputs import FIX


@pytest.fixture
def output(tmp_path: Path) -> Path:
    """ComfyUI's output folder, beside a folder `outside` holding a file the user owns."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "victim.txt").write_text("mine\n")
    folder = tmp_path / "output"
    folder.mkdir()
    return folder


def tree(folder: Path) -> dict[str, str]:
    """Every entry under `folder`: file contents, link targets and folders."""
    entries = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        entries[key] = ("link " + os.readlink(path) if path.is_symlink() else
                        "folder" if path.is_dir() else path.read_text(errors="replace"))
    return entries


def save(output: Path, captions: list[str], subfolder: str = "caps", names: str = "", prefix: str = "caption",
         overwrite: bool = True, combined: str = "", trigger_word: str = "") -> str:
    return save_captions(str(output), captions, subfolder, names, prefix, trigger_word, overwrite, combined)


def refused(output: Path, match: str, **inputs) -> str:
    """Saving must fail with a ConfigError matching `match` that says what to do, and write nothing anywhere."""
    before = tree(output.parent)
    with pytest.raises(ConfigError, match=match) as info:
        save(output, **({"captions": ["a knight"]} | inputs))
    assert FIX.search(str(info.value)), str(info.value)
    assert tree(output.parent) == before
    return str(info.value)


# --- where files go ----------------------------------------------------------------------------------------------

def test_confined_folder_accepts_relative_subfolders(tmp_path: Path) -> None:
    root = tmp_path.resolve()
    assert confined_folder(str(tmp_path), "") == root
    assert confined_folder(str(tmp_path), "captions/set 1") == root / "captions" / "set 1"
    assert confined_folder(str(tmp_path), "captions\\win") == root / "captions" / "win"


@pytest.mark.parametrize("subfolder", ["..", "../x", "a/../../x", "/tmp/x", "C:\\x", "C:x", "a\\..\\..\\x", "a/C:x"])
def test_confined_folder_refuses_paths_out_of_the_output_folder(tmp_path: Path, subfolder: str) -> None:
    with pytest.raises(ConfigError, match="must be a relative folder inside ComfyUI's output folder"):
        confined_folder(str(tmp_path / "output"), subfolder)


def test_confined_folder_refuses_a_link_out_of_the_output_folder(tmp_path: Path) -> None:
    output = tmp_path / "output"
    output.mkdir()
    (output / "escape").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(ConfigError, match="through a link"):
        confined_folder(str(output), "escape/x")


@pytest.mark.parametrize("prefix", ["../../x", "../x", "..", "x/../../y", "a/b", "a\\b", "..\\x", "C:x", "C:\\x",
                                    "{outside}/x", "/{outside}/x", "my..caption"])
def test_a_prefix_with_a_path_in_it_is_refused(output: Path, prefix: str) -> None:
    refused(output, "filename_prefix", prefix=prefix.format(outside=output.parent / "outside"))


def test_an_absolute_prefix_cannot_overwrite_a_file_elsewhere(output: Path) -> None:
    victim = output.parent / "outside" / "victim"
    (victim.parent / "victim_00001.txt").write_text("mine\n")
    refused(output, "filename_prefix", prefix=str(victim), subfolder="")
    assert (victim.parent / "victim_00001.txt").read_text() == "mine\n"


@pytest.mark.parametrize("line", ["../../victim.png", "..\\..\\victim.png", "/abs/victim.png", "C:victim.png",
                                  "C:\\data\\victim.png", "sub/dir/victim.jpg"])
def test_names_lines_keep_only_the_file_name(output: Path, line: str) -> None:
    save(output, ["a knight"], names=line)
    assert tree(output) == {"caps": "folder", "caps/victim.txt": "a knight\n"}
    assert (output.parent / "outside" / "victim.txt").read_text() == "mine\n"


def test_a_drive_letter_left_in_a_names_line_is_refused(output: Path) -> None:
    refused(output, "names line 1.*drive letters", names="x/C:victim.png")  # "C:victim.txt" leaves on Windows


@pytest.mark.parametrize("line, needle", [("scene 1: intro.png", "':'"), ("what?.png", "'\\?'"),
                                         ("a|b.png", "'\\|'"), ("con.png", "device CON"), ("Aux.jpg", "device AUX"),
                                         ("lpt1.png", "device LPT1"), ("nul.tar.png", "device NUL")])
def test_a_name_windows_reads_otherwise_is_refused(output: Path, line: str, needle: str) -> None:
    message = refused(output, "names line 1", names=line)
    assert re.search(needle, message) and "Windows" in message
    assert tree(output) == {}


def test_a_filename_prefix_that_windows_cannot_name_is_refused(output: Path) -> None:
    assert "Windows" in refused(output, "filename_prefix", prefix="shot:1")
    save(output, ["a knight"], prefix="console")  # only the device names themselves are devices
    assert tree(output) == {"caps": "folder", "caps/console_00001.txt": "a knight\n"}


def test_a_link_at_the_caption_file_pointing_out_is_refused(output: Path) -> None:
    (output / "caps").mkdir()
    (output / "caps" / "knight.txt").symlink_to(output.parent / "outside" / "victim.txt")
    for overwrite in (True, False):
        message = refused(output, "outside ComfyUI's output folder", names="knight.png", overwrite=overwrite)
        assert "knight.txt" in message


def test_a_dangling_link_at_the_caption_file_pointing_out_is_refused(output: Path) -> None:
    (output / "caps").mkdir()
    (output / "caps" / "caption_00001.txt").symlink_to(output.parent / "outside" / "new.txt")
    refused(output, "outside ComfyUI's output folder")


def test_a_linked_folder_deeper_in_the_subfolder_pointing_out_is_refused(output: Path) -> None:
    (output / "caps").mkdir()
    (output / "caps" / "deeper").symlink_to(output.parent / "outside", target_is_directory=True)
    refused(output, "through a link", subfolder="caps/deeper")


def test_links_that_stay_inside_the_output_folder_are_followed(output: Path) -> None:
    (output / "real").mkdir()
    (output / "alias").symlink_to(output / "real", target_is_directory=True)
    save(output, ["a knight"], subfolder="alias")
    assert (output / "real" / "caption_00001.txt").read_text() == "a knight\n"


def test_every_path_is_checked_before_the_first_file_is_written(output: Path) -> None:
    (output / "caps" / "slime.txt").mkdir(parents=True)
    refused(output, "slime.txt.*is a folder", captions=["a knight", "a slime"], names="knight.png\nslime.png")


# --- characters and names a file system refuses, folders in the way, link loops ------------------------------

@pytest.mark.parametrize("field, inputs", [("subfolder", {"subfolder": "caps\0x"}),
                                           ("names line 1", {"names": "knight\0.png"}),
                                           ("filename_prefix", {"prefix": "cap\0tion"}),
                                           ("filename_prefix", {"prefix": "cap\ntion"}),
                                           ("subfolder", {"subfolder": "caps\tx"})])
def test_a_nul_or_other_control_character_is_refused(output: Path, field: str, inputs: dict) -> None:
    refused(output, f"{field}.*control character", **inputs)


def test_the_longest_legal_file_name_is_written(output: Path) -> None:
    stem = "k" * (NAME_MAX - len(".txt"))
    save(output, ["a knight", "a slime"], names=f"{'s' * 240}.png\n{stem}.png")
    assert sorted(os.listdir(output / "caps")) == sorted([f"{'s' * 240}.txt", f"{stem}.txt"])


@pytest.mark.parametrize("field, inputs", [("names", {"names": "k" * (NAME_MAX - len(".txt") + 1) + ".png"}),
                                           ("names", {"names": "é" * 126 + ".png"}),  # 130 characters, 256 bytes
                                           ("filename_prefix", {"prefix": "p" * 250})])
def test_a_file_name_over_the_file_system_limit_is_refused(output: Path, field: str, inputs: dict) -> None:
    refused(output, f"{field}.*{NAME_MAX} bytes", **inputs)


def test_a_folder_at_the_caption_file_is_refused_in_both_modes(output: Path) -> None:
    (output / "caps" / "caption_00001.txt").mkdir(parents=True)
    for overwrite in (True, False):
        refused(output, "caption_00001.txt.*is a folder", overwrite=overwrite)


def test_a_file_in_the_way_of_the_subfolder_is_a_clear_error(output: Path) -> None:
    (output / "caps").write_text("a file, not a folder\n")
    refused(output, "caps", subfolder="caps/set1")


def test_a_subfolder_name_over_the_file_system_limit_is_a_clear_error(output: Path) -> None:
    refused(output, "cannot be written", subfolder="x" * (NAME_MAX + 1))
    refused(output, "cannot be written", subfolder="/".join(["y" * 200] * 30))  # a path over PATH_MAX


@pytest.mark.parametrize("where", ["caps", "caps/caption_00001.txt"])
def test_a_link_loop_is_a_clear_error(output: Path, where: str) -> None:
    (output / where).parent.mkdir(exist_ok=True)
    (output / "loop").symlink_to(output / where)
    (output / where).symlink_to(output / "loop")
    refused(output, "loop")


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_caption_files_get_the_modes_of_any_saved_file(output: Path, umask: int, mode: int) -> None:
    old = os.umask(umask)
    try:
        save(output, ["a knight"])
    finally:
        os.umask(old)
    assert (output / "caps" / "caption_00001.txt").stat().st_mode & 0o777 == mode


# --- names and text ----------------------------------------------------------------------------------------------

def test_caption_stems_follow_the_image_names_or_number_the_files() -> None:
    assert caption_stems("knight.png\n  slime.webp \n\nsub/dir/tree.jpg\n", 3, "x") == ["knight", "slime", "tree"]
    assert caption_stems("C:\\data\\potion.png", 1, "x") == ["potion"]
    assert caption_stems("", 3, "shot") == ["shot_00001", "shot_00002", "shot_00003"]
    assert caption_stems(" \n", 1, "  ") == ["caption_00001"]


def test_caption_stems_refuse_mismatched_or_duplicate_names() -> None:
    with pytest.raises(ConfigError, match="names lists 2 image names but there are 3 captions"):
        caption_stems("a.png\nb.png", 3, "x")
    with pytest.raises(ConfigError, match="same file stem more than once \\(a\\)"):
        caption_stems("a.png\na.jpg", 2, "x")
    with pytest.raises(ConfigError, match="no usable file name"):
        caption_stems("..", 1, "x")


def test_caption_text_puts_the_trigger_word_first() -> None:
    assert caption_text("  a knight, blue armor \n", "") == "a knight, blue armor\n"
    assert caption_text("a knight", " pxlart ") == "pxlart, a knight\n"
    assert caption_text("", "pxlart") == "pxlart\n"


def test_save_captions_skips_or_overwrites_and_says_which(output: Path) -> None:
    summary = save(output, ["a knight", "a slime"], names="knight.png\nslime.png", overwrite=False)
    assert summary == f"{(output / 'caps').resolve()}\nsaved: knight.txt\nsaved: slime.txt"
    (output / "caps" / "slime.txt").write_text("edited\n")
    summary = save(output, ["a red knight", "a green slime"], names="knight.png\nslime.png", overwrite=False)
    assert summary.splitlines()[1:] == ["skipped (exists): knight.txt", "skipped (exists): slime.txt"]
    assert (output / "caps" / "slime.txt").read_text() == "edited\n"
    save(output, ["a red knight", "a green slime"], names="knight.png\nslime.png", overwrite=True)
    assert tree(output / "caps") == {"knight.txt": "a red knight\n", "slime.txt": "a green slime\n"}


# --- the combined file ---------------------------------------------------------------------------------------------

def test_the_combined_file_holds_every_caption_in_order_beside_the_caption_files(output: Path) -> None:
    summary = save(output, ["a knight", "a slime\nin a cave", "a tree"], names="knight.png\nslime.png\ntree.png",
                   combined="shot_list", trigger_word="pxl")
    assert tree(output / "caps") == {
        "knight.txt": "pxl, a knight\n", "slime.txt": "pxl, a slime\nin a cave\n", "tree.txt": "pxl, a tree\n",
        "shot_list.txt": "knight: pxl, a knight\nslime: pxl, a slime in a cave\ntree: pxl, a tree\n"}
    assert summary.splitlines()[-1] == "saved: shot_list.txt"


def test_the_combined_file_names_numbered_captions_and_keeps_a_txt_name(output: Path) -> None:
    save(output, ["a knight", "a slime"], prefix="shot", combined=" Shots.TXT ")
    assert (output / "caps" / "Shots.TXT").read_text() == "shot_00001: a knight\nshot_00002: a slime\n"


@pytest.mark.parametrize("combined", ["", "   "])
def test_an_empty_combined_file_writes_none(output: Path, combined: str) -> None:
    save(output, ["a knight"], prefix="shot", combined=combined)
    assert tree(output / "caps") == {"shot_00001.txt": "a knight\n"}


def test_the_combined_file_is_skipped_or_overwritten_like_the_caption_files(output: Path) -> None:
    save(output, ["a knight"], names="knight.png", combined="shots", overwrite=False)
    (output / "caps" / "shots.txt").write_text("edited\n")
    summary = save(output, ["a red knight"], names="knight.png", combined="shots", overwrite=False)
    assert summary.splitlines()[1:] == ["skipped (exists): knight.txt", "skipped (exists): shots.txt"]
    assert (output / "caps" / "shots.txt").read_text() == "edited\n"
    save(output, ["a red knight"], names="knight.png", combined="shots", overwrite=True)
    assert (output / "caps" / "shots.txt").read_text() == "knight: a red knight\n"


@pytest.mark.parametrize("combined, match", [
    ("../shots", "plain name"), ("../../outside/victim", "plain name"), ("/tmp/shots", "plain name"),
    ("sub/shots", "plain name"), ("..\\shots", "plain name"), ("C:shots", "plain name"), ("C:\\shots", "plain name"),
    ("shots:1", "Windows"), ("what?", "Windows"), ("con", "device CON"), ("NUL.txt", "device NUL"),
    ("shots\0x", "control character"), ("shots\ntwo", "control character"), ("s" * (NAME_MAX - 3), "255 bytes"),
    ("knight", "also one image's caption file"), ("KNIGHT.txt", "also one image's caption file")])
def test_a_hostile_combined_file_name_is_refused_and_nothing_is_written(output: Path, combined: str,
                                                                       match: str) -> None:
    message = refused(output, f"combined_file.*{match}", names="knight.png", combined=combined)
    assert repr(combined) in message


def test_a_combined_file_name_that_numbered_captions_take_is_refused(output: Path) -> None:
    refused(output, "combined_file.*also one image's caption file", captions=["a", "b"], combined="caption_00002")


def test_a_link_or_a_folder_at_the_combined_file_is_refused_in_both_modes(output: Path) -> None:
    (output / "caps").mkdir()
    (output / "caps" / "shots.txt").symlink_to(output.parent / "outside" / "victim.txt")
    (output / "caps" / "folder.txt").mkdir()
    for overwrite in (True, False):
        assert "shots.txt" in refused(output, "outside ComfyUI's output folder", combined="shots", overwrite=overwrite)
        assert "folder.txt" in refused(output, "is a folder", combined="folder", overwrite=overwrite)
    assert (output.parent / "outside" / "victim.txt").read_text() == "mine\n"


# --- atomic writes -----------------------------------------------------------------------------------------------

def test_write_text_atomic_skips_or_overwrites_and_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "new" / "knight.txt"
    assert write_text_atomic(target, "first\n", overwrite=False) is True
    assert write_text_atomic(target, "second\n", overwrite=False) is False
    assert target.read_text() == "first\n"
    assert write_text_atomic(target, "third\n", overwrite=True) is True
    assert target.read_text() == "third\n"
    assert os.listdir(target.parent) == ["knight.txt"]


def test_write_text_atomic_keeps_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    target = tmp_path / "knight.txt"
    target.write_text("kept\n")
    with pytest.raises(TypeError):
        write_text_atomic(target, None, overwrite=True)  # type: ignore[arg-type]
    assert target.read_text() == "kept\n"
    assert os.listdir(tmp_path) == ["knight.txt"]
