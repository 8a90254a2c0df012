"""The command line (`python -m a3b_core`), through a3b_core.__main__.main: one way to name a model in every command,
the model folder's own caption prompt, every image path checked before any work, and --lora."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from a3b_core.__main__ import DEFAULT_CAPTION_PROMPT, build_parser, main
from a3b_core.runtime.loader import load_model
from a3b_core.runtime.options import parse_lora
from bench.demo_model import dataset
from bench.demo_model.train import DEMO_DIR, DEMO_FP8_DIR, TEST_SEED, write_test_images
from tests.synthetic_adapters import write_demo_adapter
from tests.test_bad_inputs import FIX

REPO = Path(__file__).parent.parent

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def scenes(tmp_path_factory) -> list[Path]:
    """Held-out demo scenes as PNG files."""
    return [path for path, _ in write_test_images(tmp_path_factory.mktemp("scenes"), TEST_SEED, 4)]


def captions(folder: Path | str, paths: list[Path], prompt: str) -> list[str]:
    """What the engine answers for each image with `prompt`, greedy, as the CLI prints it."""
    model = load_model(folder)
    chats = [model.build_prompt(user=prompt, images=model.encode_images(path)) for path in paths]
    return [f"{path}: {model.generate(chat, max_new_tokens=128, temperature=0).text}"
            for path, chat in zip(paths, chats)]


def run(capsys, *argv: str) -> tuple[int, list[str], str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


@pytest.mark.parametrize("model", ["a3b-demo-fp8", str(DEMO_FP8_DIR), "a3b_core/demo/a3b-demo-fp8"])
def test_the_fp8_demo_is_captioned_with_its_own_prompt_however_it_is_named(capsys, monkeypatch, scenes, model):
    monkeypatch.chdir(REPO)
    code, out, err = run(capsys, "caption", *map(str, scenes), "--model", model)
    assert code == 0, err
    assert out == captions(DEMO_FP8_DIR, scenes, dataset.CAPTION_PROMPT)


def test_the_bf16_demo_by_its_path_is_captioned_like_by_its_name(capsys, monkeypatch, scenes):
    monkeypatch.chdir(REPO)
    by_path = run(capsys, "caption", *map(str, scenes), "--model", "a3b_core/demo/a3b-demo")
    assert by_path == run(capsys, "caption", *map(str, scenes)) == (0, captions(DEMO_DIR, scenes,
                                                                              dataset.CAPTION_PROMPT), "")


def demo_copy(tmp_path: Path, prompt: str | None) -> Path:
    folder = tmp_path / "demo"
    shutil.copytree(DEMO_DIR, folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("a3b_caption_prompt", None)
    if prompt is not None:
        config["a3b_caption_prompt"] = prompt
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("folder_prompt, option, used", [
    (dataset.BACKGROUND_QUESTION, (), dataset.BACKGROUND_QUESTION),
    (None, (), DEFAULT_CAPTION_PROMPT),
    (dataset.BACKGROUND_QUESTION, ("--prompt", dataset.COUNT_QUESTION), dataset.COUNT_QUESTION),
], ids=["folder-prompt", "no-folder-prompt", "prompt-option-wins"])
def test_the_caption_prompt_comes_from_the_option_else_the_model_folder(capsys, tmp_path, scenes, folder_prompt,
                                                                        option, used):
    folder = demo_copy(tmp_path, folder_prompt)
    code, out, err = run(capsys, "caption", *map(str, scenes[:2]), "--model", str(folder), *option)
    assert code == 0, err
    assert out == captions(folder, scenes[:2], used)


@pytest.mark.parametrize("command", ["plan", "inspect"])
@pytest.mark.parametrize("name, folder", [("a3b-demo", DEMO_DIR), ("a3b-demo-fp8", DEMO_FP8_DIR)])
def test_plan_and_inspect_accept_the_demo_names(capsys, command, name, folder):
    by_name = run(capsys, command, name)
    assert by_name[0] == 0, by_name[2]
    by_path = run(capsys, command, str(folder))
    assert by_name == by_path


def test_a_missing_model_folder_gets_one_message_in_every_command(capsys, tmp_path, scenes):
    missing = str(tmp_path / "models" / "Qwen3.5-35B-A3B")
    results = [run(capsys, "plan", missing), run(capsys, "inspect", missing),
               run(capsys, "caption", str(scenes[0]), "--model", missing)]
    assert {code for code, _, _ in results} == {2}
    assert {tuple(out) for _, out, _ in results} == {()}
    messages = {err for _, _, err in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert missing in message and "model folder not found" in message and FIX.search(message)


@pytest.mark.parametrize("bad", ["missing.png", "folder"])
def test_caption_checks_every_image_path_before_any_work(capsys, tmp_path, scenes, bad):
    (tmp_path / "folder").mkdir()
    code, out, err = run(capsys, "caption", str(scenes[0]), str(tmp_path / bad))
    assert (code, out) == (2, [])
    assert str(tmp_path / bad) in err and "nothing was captioned" in err and FIX.search(err)


# --- --lora ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, parsed", [
    ("loras/style", ("loras/style", 1.0)),
    ("loras/style:0.5", ("loras/style", 0.5)),
    ("style:-1", ("style", -1.0)),
    ("style:0", ("style", 0.0)),
    ("C:\\loras\\style", ("C:\\loras\\style", 1.0)),
    ("C:\\loras\\style:0.75", ("C:\\loras\\style", 0.75)),
    ("a:b/style:2", ("a:b/style", 2.0)),
])
def test_a_lora_is_a_path_with_an_optional_strength_after_the_last_colon(text, parsed):
    assert parse_lora(text) == parsed


@pytest.mark.parametrize("command", ["caption", "caption-folder", "serve"])
def test_lora_is_repeatable_on_every_command_that_loads_a_model(command):
    first = ["x.png"] if command == "caption" else ["images" if command == "caption-folder" else "a3b-demo"]
    args = build_parser().parse_args([command, *first, "--lora", "a:0.5", "--lora", "C:\\b"])
    assert args.lora == ["a:0.5", "C:\\b"]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    return write_demo_adapter(tmp_path_factory.mktemp("lora") / "style")


def test_a_lora_changes_the_captions_and_at_strength_0_leaves_them_exactly(capsys, scenes, adapter):
    images = list(map(str, scenes[:2]))
    base = run(capsys, "caption", *images)
    adapted = run(capsys, "caption", *images, "--lora", str(adapter))
    assert base[0] == adapted[0] == 0, adapted[2]
    assert adapted[1] != base[1] and len(adapted[1]) == len(base[1])
    assert run(capsys, "caption", *images, "--lora", f"{adapter}:0") == base
    weights = str(adapter / "adapter_model.safetensors")  # the weights file given by itself is the same adapter
    assert run(capsys, "caption", *images, "--lora", f"{weights}:1.0") == adapted


@pytest.mark.parametrize("suffix, message", [(":nan", "is not a finite number"), (":inf", "is not a finite number"),
                                             (":strong", "LoRA adapter not found"), (":", "LoRA adapter not found")])
def test_a_bad_lora_strength_is_an_error_before_any_model_load(capsys, monkeypatch, scenes, adapter, suffix, message):
    monkeypatch.setattr("a3b_core.__main__.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    code, out, err = run(capsys, "caption", str(scenes[0]), "--lora", f"{adapter}{suffix}")
    assert (code, out) == (2, [])
    assert f"{adapter}{suffix}" in err and message in err and FIX.search(err), err


def test_a_lora_without_a_path_is_an_error(capsys, scenes):
    code, _, err = run(capsys, "caption", str(scenes[0]), "--lora", ":0.5")
    assert code == 2 and "':0.5' names no adapter" in err and FIX.search(err), err


def test_serve_loads_the_model_with_its_loras(monkeypatch, adapter):
    served = {}
    monkeypatch.setattr("a3b_core.services.openai_server.run", lambda model, options, *rest: served.update(
        model=model, options=options))
    assert main(["serve", "a3b-demo", "--lora", f"{adapter}:0.5", "--lora", str(adapter)]) == 0
    assert served["options"].loras == ((str(adapter), 0.5), (str(adapter), 1.0))
    assert served["options"].as_kwargs()["loras"] == served["options"].loras  # as load_model takes them
