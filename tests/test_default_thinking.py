"""A model's default thinking mode: config.json's a3b_default_thinking (the demo folders: off), else the chat
template's own default (Qwen3.5's template thinks unless told not to), followed by build_prompt, the CLI, the nodes
and the remote client whenever the caller does not say."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from a3b_core import load_model
from a3b_core.__main__ import main as cli
from a3b_core.errors import ConfigError
from a3b_core.services.openai_client import RemoteChat, _thinking_switch
from nodes.prompt_spec import SINGLE, THINKING_MODES, PromptSpec, build_prompts
from tests.test_chat_template import QWEN3_5_TEMPLATE, folder, load  # noqa: F401 (folder: a fixture)

HEART = Path(__file__).parent.parent / "workflows" / "inputs" / "a3b_pixel_art" / "a3b_pixel_heart.png"

pytestmark = pytest.mark.usefixtures("one_thread")


def set_config(folder: Path, **fields) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


@pytest.mark.parametrize("name", ["a3b-demo", "a3b-demo-fp8"])
def test_the_demo_folders_say_thinking_off_and_prompts_follow(name):
    model = load_model(name, preset="cpu")
    assert model.default_thinking is False
    assert model.build_prompt("Describe the image.").prompt.thinking is False
    assert model.build_prompt("Describe the image.", thinking=True).prompt.thinking is True


def test_the_built_in_qwen3_5_template_thinks_by_default(folder):
    model = load(folder)
    prompt = model.build_prompt("Hi")
    assert model.default_thinking is True and prompt.prompt.thinking is True
    assert prompt.input_ids == model.build_prompt("Hi", thinking=True).input_ids
    assert prompt.input_ids != model.build_prompt("Hi", thinking=False).input_ids


@pytest.mark.parametrize("default_off", [False, True])
def test_a_folder_template_gives_its_own_default(folder, default_off):
    source = QWEN3_5_TEMPLATE.read_text(encoding="utf-8")
    if default_off:  # a fine-tune whose template answers directly unless enable_thinking is true
        source = source.replace("enable_thinking is defined and enable_thinking is false",
                                "not (enable_thinking is defined and enable_thinking is true)")
        assert source != QWEN3_5_TEMPLATE.read_text(encoding="utf-8")
    (folder / "chat_template.jinja").write_text(source, encoding="utf-8")
    model = load(folder)
    assert model.default_thinking is not default_off
    assert model.build_prompt("Hi").input_ids == model.build_prompt("Hi", thinking=not default_off).input_ids


def test_config_json_overrides_the_templates_default(folder):
    shutil.copy(QWEN3_5_TEMPLATE, folder / "chat_template.jinja")
    set_config(folder, a3b_default_thinking=False)
    model = load(folder)
    assert model.default_thinking is False and model.build_prompt("Hi").prompt.thinking is False


def test_a_malformed_default_is_refused_naming_the_field(folder):
    set_config(folder, a3b_default_thinking="no")
    with pytest.raises(ConfigError, match="a3b_default_thinking"):
        load(folder)


def test_the_cli_captions_in_the_models_default_mode(capsys):
    assert cli(["caption", str(HEART)]) == 0
    answer = capsys.readouterr().out.removeprefix(f"{HEART}: ")
    assert answer == "pixel art of a large red heart at the centre on a white background\n"  # thinking off
    assert cli(["caption", "--thinking", "--max-new-tokens", "8", str(HEART)]) == 0
    assert capsys.readouterr().out == f"{HEART}: \n"  # thinking on: 8 tokens of reasoning and no answer yet


def test_the_prompt_nodes_auto_leaves_the_choice_to_the_model(folder):
    assert THINKING_MODES == {"auto": None, "on": True, "off": False}  # A3B Prompt's choices
    for model, auto in ((load_model("a3b-demo", preset="cpu"), False), (load(folder), True)):
        for choice, thinking in THINKING_MODES.items():
            (prompt,) = build_prompts(model, PromptSpec(user="Describe the image.", thinking=thinking), SINGLE)
            assert prompt.prompt.thinking is (auto if thinking is None else thinking), choice


def test_the_remote_client_leaves_the_default_to_the_server():
    assert _thinking_switch(RemoteChat((), None).thinking) == {}
    assert _thinking_switch(False) == {"chat_template_kwargs": {"enable_thinking": False}}
