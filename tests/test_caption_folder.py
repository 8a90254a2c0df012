"""Captioning a folder (a3b_core.services.caption_folder, the CLI's caption-folder and the node's input handling) with the
embedded demo model, on folders of generated images: nested folders, mixed formats, an unreadable file, names with
spaces and non-ASCII letters. Every image gets exactly one caption file, reruns skip, stopped runs resume, nothing
outside the chosen folders is written, and each option changes what it says."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from a3b_core.__main__ import main
from a3b_core.errors import ConfigError
from a3b_core.runtime.loader import load_model
from a3b_core.runtime.options import GenerationOptions
from a3b_core.services import caption_folder as folder_module
from a3b_core.services.caption_folder import (RUN_JOURNAL, TAGS_PROMPT, FolderJob, FolderProgress, Shaping,
                                              caption_folder, caption_request, check_shaping, combined, run_to_end,
                                              shape_caption, summary)
from bench.demo_model import dataset
from nodes.caption_folder import folder_job, output_lists
from tests.hostile_inputs import EPS, REPO, fake_ghostscript
from tests.test_bad_inputs import FIX

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = GenerationOptions(max_new_tokens=24, temperature=0.0, presence_penalty=0.0)
IMAGES = ["knight one.png", "sub/é slime.jpg", "sub/deeper/ドラゴン.webp", "sub/tree.PNG", "zebra.jpeg"]


@pytest.fixture(scope="module")
def model():
    return load_model("a3b-demo")


@pytest.fixture(scope="module")
def model_fp32():
    """For tests that compare captions made in different batches: a batch's size changes the order of the sums in
    prefill (oneDNN's blocking), which in BF16 can flip a near-tie greedy token; in float32 it does not here."""
    return load_model("a3b-demo", compute_dtype="float32")


def make_dataset(root: Path) -> Path:
    """`root/data`: the IMAGES (demo scenes), an unreadable 'broken.png' and a non-image file; beside it
    `root/outside` with a file the user owns."""
    data = root / "data"
    for index, (name, sample) in enumerate(zip(IMAGES, dataset.make_samples(11, len(IMAGES)))):
        path = data / name
        path.parent.mkdir(parents=True, exist_ok=True)
        sample.image.convert("RGB").save(path, format={".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG",
                                                        ".webp": "WEBP"}[path.suffix.lower()])
    (data / "sub" / "broken.png").write_bytes(b"not a picture")
    (data / "notes.md").write_text("my notes\n")
    (root / "outside").mkdir()
    (root / "outside" / "victim.txt").write_text("mine\n")
    return data


def job(folder: Path, **options) -> FolderJob:
    return FolderJob(folder, **({"recursive": True, "batch_size": 2, "size": 256, "generation": FAST} | options))


def tree(folder: Path) -> dict[str, str]:
    """Every file under `folder` (links as their targets) with its text or size."""
    entries = {}
    for path in sorted(folder.rglob("*")):
        key = path.relative_to(folder).as_posix()
        if path.is_symlink():
            entries[key] = "link " + os.readlink(path)
        elif path.is_file():
            entries[key] = path.read_text() if path.suffix == ".txt" else f"{path.stat().st_size} bytes"
    return entries


def captions_of(folder: Path) -> dict[str, str]:
    return {key: text for key, text in tree(folder).items() if key.endswith(".txt")}


def txt(name: str) -> str:
    return str(Path(name).with_suffix(".txt").as_posix())


# --- one caption per image, nothing else touched ----------------------------------------------------------------

def test_every_readable_image_gets_exactly_one_caption_and_nothing_else_is_written(tmp_path, model):
    data = make_dataset(tmp_path)
    before = tree(tmp_path)
    outcomes, stopped = run_to_end(model, job(data))
    assert not stopped
    after = tree(tmp_path)
    new = {key: value for key, value in after.items() if key not in before}
    assert sorted(new) == sorted(f"data/{txt(name)}" for name in IMAGES)
    assert all(text.endswith("\n") and text.strip() for text in new.values())
    assert {key: after[key] for key in before} == before  # images, notes and the outside file untouched
    assert [o.status for o in outcomes].count("written") == len(IMAGES)
    (broken,) = [o for o in outcomes if o.status == "unreadable"]
    assert broken.image.name == "broken.png" and "broken.png" in summary(outcomes)


def test_captions_go_into_the_mirror_folder_and_the_image_folder_is_left_as_it_was(tmp_path, model):
    data = make_dataset(tmp_path)
    before = tree(data)
    run_to_end(model, job(data, output_dir=tmp_path / "captions"))
    assert tree(data) == before
    assert sorted(captions_of(tmp_path / "captions")) == sorted(txt(name) for name in IMAGES)


def test_without_recursive_only_the_folders_own_images_are_captioned(tmp_path, model):
    data = make_dataset(tmp_path)
    run_to_end(model, job(data, recursive=False))
    assert sorted(captions_of(data)) == ["knight one.txt", "zebra.txt"]


def test_extensions_start_and_limit_pick_the_images(tmp_path, model):
    data = make_dataset(tmp_path)
    run_to_end(model, job(data, extensions=(".png",)))
    assert sorted(captions_of(data)) == ["knight one.txt", "sub/tree.txt"]
    other = make_dataset(tmp_path / "second")
    # sorted by path inside the folder: knight one.png, sub/broken.png, sub/deeper/ドラゴン.webp, sub/tree.PNG, ...
    run_to_end(model, job(other, start=2, limit=2))
    assert sorted(captions_of(other)) == ["sub/deeper/ドラゴン.txt", "sub/tree.txt"]


# --- reruns and stops --------------------------------------------------------------------------------------------

def test_a_rerun_skips_every_captioned_image_without_generating(tmp_path, model):
    data = make_dataset(tmp_path)
    run_to_end(model, job(data))
    times = {path: path.stat().st_mtime_ns for path in data.rglob("*.txt")}
    steps = list(caption_folder(model, job(data)))
    assert len(steps) == 2  # the up-front step, then one batch: the unreadable file alone
    statuses = [o.status for step in steps for o in step.outcomes]
    assert statuses.count("skipped") == len(IMAGES) and statuses.count("unreadable") == 1
    assert steps[-1].new_tokens == 0
    assert {path: path.stat().st_mtime_ns for path in data.rglob("*.txt")} == times


def _hand_written(data: Path) -> None:
    for name in IMAGES:
        (data / name).with_suffix(".txt").write_text("hand written\n")


def _stop_after_the_first_batch(model, folder_job: FolderJob) -> list[FolderProgress]:
    stop = False
    steps = []
    for step in caption_folder(model, folder_job, should_stop=lambda: stop):
        steps.append(step)
        stop = any(o.status == "written" for o in step.outcomes)
    assert steps[-1].stopped
    return steps


def test_a_run_stopped_between_batches_resumes_to_the_same_captions(tmp_path, model_fp32):
    model = model_fp32
    whole = make_dataset(tmp_path / "whole")
    run_to_end(model, job(whole))
    data = make_dataset(tmp_path / "stopped")
    steps = _stop_after_the_first_batch(model, job(data))
    # the first batch only: 'knight one.png' and the unreadable 'sub/broken.png'
    assert steps[-1].stopped and list(captions_of(data)) == ["knight one.txt"]
    assert "stopped" in summary([o for s in steps for o in s.outcomes], stopped=True)
    first, *rest = caption_folder(model, job(data))
    assert [(o.image.name, o.status) for o in first.outcomes] == [("knight one.png", "skipped")]  # before any batch
    assert sum(step.captioned for step in rest[-1:]) == len(IMAGES) - 1
    assert captions_of(data) == captions_of(whole)


def test_a_stop_within_a_batch_writes_none_of_its_unfinished_captions(tmp_path, model):
    whole = make_dataset(tmp_path / "whole")
    run_to_end(model, job(whole))
    data = make_dataset(tmp_path / "stopped")
    polls = 0

    def stop_after_a_few_tokens() -> bool:
        nonlocal polls
        polls += 1
        return polls > 4  # the engine polls before its prefill and after every token

    outcomes, stopped = run_to_end(model, job(data), should_stop=stop_after_a_few_tokens)
    assert stopped and captions_of(data) == {}
    assert not [p for p in data.rglob("*") if p.name.startswith(".a3b-")]  # no temporary files left
    run_to_end(model, job(data))
    assert captions_of(data) == captions_of(whole)


@pytest.mark.parametrize("policy", ["append", "prepend", "overwrite"])
def test_a_stopped_run_that_changes_files_resumes_without_adding_a_caption_twice(tmp_path, model_fp32, policy):
    model = model_fp32
    whole = make_dataset(tmp_path / "whole")
    _hand_written(whole)
    run_to_end(model, job(whole, existing=policy))
    assert not (whole / RUN_JOURNAL).exists()  # a finished run leaves no journal
    data = make_dataset(tmp_path / "stopped")
    _hand_written(data)
    _stop_after_the_first_batch(model, job(data, existing=policy))
    assert (data / RUN_JOURNAL).exists()
    first, *_ = caption_folder(model, job(data, existing=policy))
    assert [(o.image.name, o.status) for o in first.outcomes] == [("knight one.png", "skipped")]
    assert captions_of(data) == captions_of(whole)
    assert not (data / RUN_JOURNAL).exists()


def test_a_caption_whose_file_was_never_replaced_is_redone_once(tmp_path, model_fp32):
    """A crash after the journal named a file but before the file was replaced, and a journal line cut short."""
    model = model_fp32
    whole = make_dataset(tmp_path / "whole")
    _hand_written(whole)
    run_to_end(model, job(whole, existing="append"))
    data = make_dataset(tmp_path / "crashed")
    _hand_written(data)
    _stop_after_the_first_batch(model, job(data, existing="append"))
    (data / "knight one.txt").write_text("hand written\n")  # the replacement that never happened
    with open(data / RUN_JOURNAL, "a", encoding="utf-8") as journal:
        journal.write('{"file": "zebra.txt", "sha')
    run_to_end(model, job(data, existing="append"))
    assert captions_of(data) == captions_of(whole)


def test_a_rerun_with_other_settings_starts_a_new_journal(tmp_path, model):
    data = make_dataset(tmp_path)
    _hand_written(data)
    _stop_after_the_first_batch(model, job(data, existing="append"))
    first = next(caption_folder(model, job(data, existing="append", shaping=Shaping(trigger="pxl"))))
    assert not [o for o in first.outcomes if o.status == "skipped"]
    assert "pxl" in (data / RUN_JOURNAL).read_text().splitlines()[0]


# --- existing caption files --------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["skip", "overwrite", "append", "prepend"])
def test_existing_caption_files_are_kept_replaced_or_extended(tmp_path, model, policy):
    data = make_dataset(tmp_path)
    run_to_end(model, job(data, output_dir=tmp_path / "fresh"))
    fresh = captions_of(tmp_path / "fresh")["knight one.txt"].strip()
    (data / "knight one.txt").write_text("pxl, hand written\n")
    run_to_end(model, job(data, existing=policy, shaping=Shaping(trigger="pxl")))
    want = {"skip": "pxl, hand written", "overwrite": f"pxl, {fresh}", "append": f"pxl, hand written {fresh}",
            "prepend": f"pxl, {fresh} hand written"}[policy]
    assert (data / "knight one.txt").read_text() == want + "\n"


# --- shaping -----------------------------------------------------------------------------------------------------

def test_banned_phrases_are_removed_as_whole_words_in_any_case() -> None:
    shaping = Shaping(ban=("red", "at the top"))
    assert shape_caption("A Red heart at the top, reddish sky.", shaping, False, "n", "f") == "A heart, reddish sky."
    assert shape_caption("red, heart, Red sky, sky, top", Shaping(ban=("red",)), True, "n", "f") == "heart, sky, top"


def test_max_length_cuts_after_a_whole_word_or_tag() -> None:
    assert shape_caption("a large red heart on white", Shaping(max_length=14), False, "n", "f") == "a large red"
    assert shape_caption("heart, red, white background", Shaping(max_length=12), True, "n", "f") == "heart, red"
    assert shape_caption("a large red heart", Shaping(max_length=0), False, "n", "f") == "a large red heart"


def test_template_prefix_suffix_and_trigger_are_placed_around_the_caption() -> None:
    shaping = Shaping(trigger="pxl", prefix="pixel art,", suffix="8-bit.", template="{name} in {folder}: {caption}")
    assert shape_caption("a heart", shaping, False, "knight", "sprites") == \
        "pxl, pixel art, knight in sprites: a heart 8-bit."
    assert shape_caption("heart", Shaping(prefix="pixel art", suffix="8-bit"), True, "n", "f") == \
        "pixel art, heart, 8-bit"


@pytest.mark.parametrize("template, needle", [("{caption} {size}", "{size}"), ("{name}", "{caption}"),
                                              ("{caption", "not a valid template")])
def test_a_bad_template_is_refused_before_any_work(template, needle) -> None:
    with pytest.raises(ConfigError) as error:
        check_shaping(Shaping(template=template))
    assert needle in str(error.value) and FIX.search(str(error.value))


def test_required_phrases_are_checked_and_missing_ones_reported(tmp_path, model):
    data = make_dataset(tmp_path)
    outcomes, _ = run_to_end(model, job(data, shaping=Shaping(require=("background", "unicorn"))))
    written = [o for o in outcomes if o.status == "written"]
    assert written and all(o.missing == ("unicorn",) for o in written)  # demo captions end "on a ... background"
    assert summary(outcomes).count("missing 'unicorn'") == len(written)


def test_append_and_prepend_keep_the_trigger_first_and_once() -> None:
    shaping = Shaping(trigger="pxl")
    assert combined("pxl, old", "pxl, new", "append", shaping, False) == "pxl, old new"
    assert combined("old", "pxl, new", "prepend", shaping, True) == "pxl, new, old"
    assert combined("pxl, old", "pxl, new", "overwrite", shaping, False) == "pxl, new"


def test_the_tags_preset_asks_for_tags_and_the_prompt_overrides_any_preset(tmp_path, model):
    data = tmp_path / "data"
    data.mkdir()
    assert caption_request(model, FolderJob(data)) == model.config.caption_prompt
    assert caption_request(model, FolderJob(data, preset="tags")) == TAGS_PROMPT
    assert caption_request(model, FolderJob(data, preset="tags", prompt="Say hi.")) == "Say hi."


# --- dry run, batches, progress ---------------------------------------------------------------------------------

def test_a_dry_run_shows_the_first_captions_a_real_run_writes_and_writes_nothing(tmp_path, model):
    data = make_dataset(tmp_path)
    before = tree(tmp_path)
    outcomes, _ = run_to_end(model, job(data, dry_run=3))
    assert tree(tmp_path) == before
    shown = {o.image.name: o.caption + "\n" for o in outcomes if o.status == "dry run"}
    assert len(shown) == 2  # the first three images in order include the unreadable one
    run_to_end(model, job(data))
    written = {Path(key).with_suffix("").name: text for key, text in captions_of(data).items()}
    assert {Path(name).stem: text for name, text in shown.items()} == {
        stem: written[stem] for stem in (Path(name).stem for name in shown)}


def test_batch_size_sets_the_images_per_engine_call_and_not_the_captions(tmp_path, model_fp32):
    model = model_fp32
    one = make_dataset(tmp_path / "one")
    many = make_dataset(tmp_path / "many")
    steps_one = list(caption_folder(model, job(one, batch_size=1)))
    steps_many = list(caption_folder(model, job(many, batch_size=6)))
    assert len(steps_one) == 1 + len(IMAGES) + 1 and len(steps_many) == 2
    assert captions_of(one) == captions_of(many)
    last = steps_many[-1]
    assert last.done == last.total == len(IMAGES) + 1 and last.captioned == len(IMAGES) and last.new_tokens > 0
    assert "6/6 images" in last.line() and "tok/s" in last.line()


def test_the_progress_line_shows_rate_eta_and_tokens_per_second() -> None:
    step = FolderProgress(total=100, done=40, outcomes=[], captioned=40, new_tokens=800, generation_s=20.0,
                          seconds=60.0, to_caption=100)
    assert step.line() == "40/100 images · 40.0 img/min · ETA 1m 30s · 40.0 tok/s"


def test_a_batch_ends_once_its_images_hold_max_batch_pixels(tmp_path, model, monkeypatch):
    """With room for two 256x256 images per batch, the five images (and the unreadable file, which holds no pixels)
    are captioned in three batches, whatever batch_size allows."""
    monkeypatch.setattr(folder_module, "MAX_BATCH_PIXELS", 2 * 256 * 256)
    data = make_dataset(tmp_path)
    steps = list(caption_folder(model, job(data, batch_size=8)))
    assert [len(step.outcomes) for step in steps[1:]] == [3, 2, 1]  # knight, broken, dragon | tree, slime | zebra
    assert len(captions_of(data)) == len(IMAGES)


# --- links, duplicates, bad input --------------------------------------------------------------------------------

def test_a_fifo_named_like_a_caption_file_is_refused_by_name_and_the_run_goes_on(tmp_path, model):
    """`existing` append reads a caption file before adding to it; one that is a FIFO would wait forever for a
    writer. It is refused by name, the other images are captioned, and the run ends."""
    data = make_dataset(tmp_path)
    os.mkfifo(data / "zebra.txt")
    finished: list = []
    run = threading.Thread(target=lambda: finished.append(run_to_end(model, job(data, existing="append"))),
                           daemon=True)
    run.start()
    run.join(timeout=600)
    if not finished:
        with open(data / "zebra.txt", "w"):  # the reader waits for a writer: let it go before failing
            pass
    assert finished, "the run hung on the FIFO"
    outcomes, _ = finished[0]
    refused = {o.image.name: o.detail for o in outcomes if o.status == "refused"}
    assert list(refused) == ["zebra.jpeg"] and "not a regular file" in refused["zebra.jpeg"]
    assert sum(o.status == "written" for o in outcomes) == len(IMAGES) - 1


def test_postscript_named_png_is_reported_unreadable_and_no_program_runs(tmp_path):
    """EPS bytes in a .png: the CLI run reports the file by name, captions the others and exits normally; the
    stand-in gs first on its PATH never runs."""
    data = make_dataset(tmp_path)
    (data / "drawing.png").write_bytes(EPS)
    env, marker = fake_ghostscript(tmp_path)
    done = subprocess.run([sys.executable, "-m", "a3b_core", "caption-folder", str(data), "--size", "256",
                           "--max-new-tokens", "8"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert f"unreadable: {data / 'drawing.png'}: " in done.stderr and "not an image in a format" in done.stderr
    assert sorted(captions_of(data)) == ["knight one.txt", "zebra.txt"]
    assert not marker.exists()



def test_links_out_of_the_folder_are_refused_by_name_and_the_target_is_untouched(tmp_path, model):
    data = make_dataset(tmp_path)
    shutil.copy(data / "knight one.png", tmp_path / "outside" / "far.png")
    (data / "escape.png").symlink_to(tmp_path / "outside" / "far.png")
    (data / "zebra.txt").symlink_to(tmp_path / "outside" / "victim.txt")
    outcomes, _ = run_to_end(model, job(data, recursive=False))
    refused = {o.image.name: o.detail for o in outcomes if o.status == "refused"}
    assert sorted(refused) == ["escape.png", "zebra.jpeg"] and "outside the folder" in refused["escape.png"]
    assert (tmp_path / "outside" / "victim.txt").read_text() == "mine\n"
    assert not (tmp_path / "outside" / "far.txt").exists() and not (data / "escape.txt").exists()
    assert (data / "knight one.txt").is_file()


def test_a_journal_link_out_of_the_folder_is_refused_and_its_target_untouched(tmp_path, model):
    data = make_dataset(tmp_path)
    (data / RUN_JOURNAL).symlink_to(tmp_path / "outside" / "victim.txt")
    with pytest.raises(ConfigError, match="journal.*outside") as info:
        run_to_end(model, job(data, existing="append"))
    assert FIX.search(str(info.value)), str(info.value)
    assert (tmp_path / "outside" / "victim.txt").read_text() == "mine\n"
    assert captions_of(data) == {}


def test_two_images_with_one_caption_file_are_refused_before_any_caption(tmp_path, model):
    data = make_dataset(tmp_path)
    shutil.copy(data / "zebra.jpeg", data / "zebra.png")
    with pytest.raises(ConfigError) as error:
        run_to_end(model, job(data))
    assert "zebra.txt" in str(error.value) and FIX.search(str(error.value))
    assert captions_of(data) == {}


@pytest.mark.parametrize("options, needle", [({"existing": "merge"}, "existing"), ({"preset": "poem"}, "preset"),
                                             ({"batch_size": 0}, "batch_size"), ({"start": -1}, "start")])
def test_bad_options_are_refused_naming_the_option(tmp_path, model, options, needle):
    data = make_dataset(tmp_path)
    with pytest.raises(ConfigError) as error:
        run_to_end(model, job(data, **options))
    assert str(error.value).startswith(needle) and FIX.search(str(error.value))


# --- the node's inputs -------------------------------------------------------------------------------------------

NODE_DEFAULTS = dict(recursive=True, preset="natural", prompt="", existing="skip", trigger_word="", prefix="",
                     suffix="", template="{caption}", banned="", required="", max_length=0, dry_run=0, start=0,
                     limit=0, batch_size=2, size=256, max_new_tokens=24, temperature=0.0, seed=0)


def comfy_roots(tmp_path: Path) -> dict[str, str]:
    for name in ("input", "output"):
        (tmp_path / name).mkdir(exist_ok=True)
    return {"input": str(tmp_path / "input"), "output": str(tmp_path / "output")}


@pytest.mark.parametrize("folder", ["../outside", "/etc", "escape"])
def test_the_node_refuses_a_folder_outside_comfyuis_folders(tmp_path, folder):
    roots = comfy_roots(tmp_path)
    (tmp_path / "outside").mkdir()
    (tmp_path / "input" / "escape").symlink_to(tmp_path / "outside")
    with pytest.raises(ConfigError) as error:
        folder_job(roots, "input", folder, "", **NODE_DEFAULTS)
    assert str(error.value).startswith("folder ") and "ComfyUI's input folder" in str(error.value)
    with pytest.raises(ConfigError) as error:
        folder_job(roots, "input", "", "../outside", **NODE_DEFAULTS)
    assert str(error.value).startswith("output_subfolder ") and FIX.search(str(error.value))


def test_the_node_captions_a_folder_of_its_input_folder_into_its_output_folder(tmp_path, model):
    roots = comfy_roots(tmp_path)
    make_dataset(tmp_path / "input" / "sets")
    task = folder_job(roots, "input", "sets/data", "captions/set 1", **NODE_DEFAULTS | {"trigger_word": "pxl"})
    outcomes, _ = run_to_end(model, task)
    mirror = tmp_path / "output" / "captions" / "set 1"
    assert sorted(captions_of(mirror)) == sorted(txt(name) for name in IMAGES)
    paths, captions = output_lists(outcomes)
    assert sorted(Path(p).name for p in paths) == sorted(Path(name).name for name in IMAGES)
    assert all(caption.startswith("pxl, ") for caption in captions)
    rerun, _ = run_to_end(model, task)  # kept captions are in the lists too, as their files hold them
    assert output_lists(rerun) == (paths, captions)


# --- the command line --------------------------------------------------------------------------------------------

def test_the_cli_dry_run_prints_captions_and_writes_nothing(tmp_path, capsys):
    data = make_dataset(tmp_path)
    before = tree(tmp_path)
    code = main(["caption-folder", str(data), "--recursive", "--dry-run", "2", "--trigger", "pxl", "--size", "256",
                 "--max-new-tokens", "24"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert tree(tmp_path) == before
    # the first two images in order: 'knight one.png', and the unreadable 'sub/broken.png', reported
    (line,) = out.splitlines()
    assert line.startswith(f"{data / 'knight one.png'}: pxl, ") and "1 dry run" in err and "broken.png" in err


def test_the_cli_writes_the_captions_and_refuses_a_missing_folder(tmp_path, capsys):
    data = make_dataset(tmp_path)
    assert main(["caption-folder", str(data), "--size", "256", "--max-new-tokens", "24", "--batch-size", "3"]) == 0
    assert sorted(captions_of(data)) == ["knight one.txt", "zebra.txt"]
    assert main(["caption-folder", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "nowhere: no such folder" in err and FIX.search(err)
