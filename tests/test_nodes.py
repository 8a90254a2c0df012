"""The node pack's logic that needs no ComfyUI: model folder and LoRA adapter listing and confinement, LoRA wires,
prompt ingredients, live text, Generate's engine call and speed line, Image Encode's batch, and the bridge's behaviour
outside ComfyUI (caption files: test_captions.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import torch

from a3b_core import EncodedImages, load_model
from a3b_core.errors import AdapterError, ConfigError, ImageError, PromptError, RemoteError
from a3b_core.prompting.conversation import Turn
from a3b_core.runtime.generation import BUDGET_CLOSE
from a3b_core.runtime.options import PRESET_NAMES, LoadOptions
from a3b_core.runtime.placement import PRESETS
from nodes import comfy_bridge
from nodes.generation import generate_answers, speed_line
from nodes.image_batch import encode_image_batch
from nodes.live_text import LiveText
from nodes.model_folders import (DEMO_MODEL, list_lora_adapters, list_model_folders, list_model_ggufs, loader_choices,
                                 resolve_lora, resolve_model)
from nodes.model_handle import A3BModelHandle, preset_budget_bytes
from nodes.prompt_spec import PromptSpec, build_prompts
from nodes.remote_handle import RemoteModelHandle
from tests.synthetic_adapters import write_demo_adapter
from tests.test_bad_inputs import FIX


def _model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


# --- model folders -----------------------------------------------------------------------------------------------

def test_model_folders_are_listed_one_and_two_levels_deep(tmp_path: Path) -> None:
    root = tmp_path / "LLM"
    _model(root / "Qwen3.5-35B-A3B")
    _model(root / "Qwen" / "Qwen3.6-35B-A3B-FP8")
    (root / "not-a-model").mkdir()
    (root / "loose.safetensors").write_bytes(b"")
    assert list_model_folders([str(root), str(tmp_path / "missing")]) == ["Qwen/Qwen3.6-35B-A3B-FP8",
                                                                         "Qwen3.5-35B-A3B"]
    assert loader_choices([str(root)])[:2] == [DEMO_MODEL, "a3b-demo-fp8"]


def test_a_symlinked_model_folder_is_listed_and_resolved(tmp_path: Path) -> None:
    elsewhere = _model(tmp_path / "hf-cache" / "snapshot")
    root = tmp_path / "LLM"
    root.mkdir()
    (root / "linked").symlink_to(elsewhere, target_is_directory=True)
    assert list_model_folders([str(root)]) == ["linked"]
    assert resolve_model("linked", [str(root)]) == str(root / "linked")


def test_resolve_model_searches_every_root_and_passes_the_demo_name(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    _model(second / "m")
    assert resolve_model("m", [str(first), str(second)]) == str(second / "m")
    assert resolve_model(DEMO_MODEL, []) == DEMO_MODEL and resolve_model("a3b-demo-fp8", []) == "a3b-demo-fp8"


@pytest.mark.parametrize("name", ["../outside", "/etc", "a/../../b", "", "  "])
def test_resolve_model_refuses_names_that_leave_the_llm_folders(tmp_path: Path, name: str) -> None:
    _model(tmp_path / "outside")
    root = tmp_path / "LLM"
    root.mkdir()
    with pytest.raises(ConfigError, match="not a folder name under models/LLM"):
        resolve_model(name, [str(root)])


def test_resolve_model_names_the_searched_folders_when_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"was not found .* in: {tmp_path}"):
        resolve_model("Qwen3.5-35B-A3B", [str(tmp_path)])


def _gguf(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")
    return path


def test_gguf_files_are_listed_without_mmproj_and_later_split_parts(tmp_path: Path) -> None:
    root = tmp_path / "LLM"
    _gguf(root / "Qwen3.5-35B-A3B-BF16.gguf")
    _gguf(root / "unsloth" / "Qwen3.6-35B-A3B-GGUF" / "Qwen3.6-35B-A3B-F16.gguf")
    _gguf(root / "unsloth" / "Qwen3.6-35B-A3B-GGUF" / "mmproj-F16.gguf")
    _gguf(root / "unsloth" / "Qwen3.6-35B-A3B-GGUF" / "MMPROJ-BF16.gguf")
    for part in (1, 2, 3):
        _gguf(root / "BF16" / f"Qwen3.5-35B-A3B-BF16-{part:05d}-of-00003.gguf")
    (root / "folder.gguf").mkdir()
    (root / "notes.txt").write_text("")
    _model(root / "Qwen3.5-27B")
    expected = ["BF16/Qwen3.5-35B-A3B-BF16-00001-of-00003.gguf", "Qwen3.5-35B-A3B-BF16.gguf",
                "unsloth/Qwen3.6-35B-A3B-GGUF/Qwen3.6-35B-A3B-F16.gguf"]
    assert list_model_ggufs([str(root), str(tmp_path / "missing")]) == expected
    assert loader_choices([str(root)])[2:] == sorted(expected + ["Qwen3.5-27B"])
    for name in expected:
        assert resolve_model(name, [str(root)]) == str(root / name)


@pytest.mark.parametrize("name", ["unsloth/mmproj-F16.gguf", "BF16/m-00002-of-00003.gguf", "folder.gguf",
                                  "../outside.gguf"])
def test_resolve_model_refuses_gguf_files_the_loader_does_not_list(tmp_path: Path, name: str) -> None:
    root = tmp_path / "LLM"
    _gguf(root / "unsloth" / "mmproj-F16.gguf")
    _gguf(root / "BF16" / "m-00002-of-00003.gguf")
    _gguf(tmp_path / "outside.gguf")
    (root / "folder.gguf").mkdir()
    with pytest.raises(ConfigError, match="not a folder name under models/LLM|was not found"):
        resolve_model(name, [str(root)])


def test_the_loader_loads_a_listed_gguf(tmp_path: Path, one_thread) -> None:
    from tests.tiny_gguf import build_gguf_fixtures
    files = build_gguf_fixtures()
    if files is None:
        pytest.skip("llama.cpp's converter could not be downloaded with pip, so no GGUF files can be made")
    root = tmp_path / "LLM"
    (root / "tiny").mkdir(parents=True)
    shutil.copyfile(files.dense_f32, root / "tiny" / "dense-F32.gguf")
    (name,) = list_model_ggufs([str(root)])
    model = load_model(resolve_model(name, [str(root)]), preset="cpu", compute_dtype="float32")
    assert model.logits(torch.tensor([[1, 2, 3]])).shape[:2] == (1, 3)


# --- LoRA adapters -----------------------------------------------------------------------------------------------

def _adapter(folder: Path, weights: str = "adapter_model.safetensors") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text("{}")
    (folder / weights).write_bytes(b"")
    return folder


def test_lora_adapters_are_listed_as_folders_and_as_files_beside_their_config(tmp_path: Path) -> None:
    loras, llm = tmp_path / "loras", tmp_path / "LLM"
    _adapter(loras / "pixel-style")
    _adapter(loras / "Qwen" / "anime")
    _adapter(loras / "kohya", weights="epoch-10.safetensors")  # no adapter_model.safetensors: only the file
    _adapter(loras / "trained", weights="checkpoint-500.safetensors")
    (loras / "trained" / "adapter_model.safetensors").write_bytes(b"")
    (loras / "sdxl-style.safetensors").write_bytes(b"")  # an image model's LoRA: no adapter_config.json
    _model(llm / "Qwen3.5-35B-A3B")
    _adapter(llm / "Qwen3.5-35B-A3B-captioner")
    assert list_lora_adapters([str(loras), str(llm), str(tmp_path / "missing")]) == [
        "Qwen/anime", "Qwen3.5-35B-A3B-captioner", "kohya/epoch-10.safetensors", "pixel-style", "trained",
        "trained/checkpoint-500.safetensors"]


def test_resolve_lora_searches_every_root(tmp_path: Path) -> None:
    first, second = tmp_path / "loras", tmp_path / "LLM"
    first.mkdir()
    _adapter(second / "Qwen" / "style")
    _adapter(second / "kohya", weights="style.safetensors")
    roots = [str(first), str(second)]
    assert resolve_lora("Qwen/style", roots) == str(second / "Qwen" / "style")
    assert resolve_lora("kohya/style.safetensors", roots) == str(second / "kohya" / "style.safetensors")


@pytest.mark.parametrize("name", ["../outside", "../outside/adapter_model.safetensors", "/etc", "a/../../b", "",
                                  "Qwen", "model"])
def test_resolve_lora_finds_only_the_listed_adapters(tmp_path: Path, name: str) -> None:
    _adapter(tmp_path / "outside")
    root = tmp_path / "loras"
    _adapter(root / "Qwen" / "style")
    _model(root / "model")
    with pytest.raises(AdapterError, match=f"LoRA adapter {name!r} was not found in: {root}"):
        resolve_lora(name, [str(root)])


def test_lora_wires_share_the_loaders_model_and_each_runs_its_own_adapters(tmp_path: Path, one_thread) -> None:
    first, second = write_demo_adapter(tmp_path / "first", seed=1), write_demo_adapter(tmp_path / "second", seed=2)
    base = A3BModelHandle(DEMO_MODEL, LoadOptions(preset="cpu"), keep_loaded=False)
    one = base.with_lora(str(first), 0.5)
    both = one.with_lora(str(second), -1.0)
    weights = [first / "adapter_model.safetensors", second / "adapter_model.safetensors"]
    model = both.acquire()
    assert model.loras == [(weights[0], 0.5), (weights[1], -1.0)]
    assert one.acquire() is model and model.loras == [(weights[0], 0.5)]
    assert base.acquire() is model and model.loras == []  # the Loader's own wire: the base model
    one.finished_run()  # keep_loaded off: the shared model is freed, and loaded again by the next use of any wire
    assert not base.loaded
    assert both.acquire() is not model and base.loaded and base.acquire().loras == []
    base.release()


def test_a_remote_model_takes_no_lora() -> None:
    with pytest.raises(RemoteError, match="not on a remote server's model"):
        RemoteModelHandle(remote=None).with_lora("style", 1.0)


# --- image batches -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo(one_thread):
    return load_model("a3b-demo", preset="cpu")


def test_an_image_batch_is_encoded_as_the_engine_encodes_it(demo) -> None:
    batch = torch.rand(3, 64, 96, 3, generator=torch.Generator().manual_seed(0))
    encoded = encode_image_batch(demo, batch, 64, "letterbox", True)
    whole = demo.encode_images(batch, size=64, resize="letterbox")
    assert encoded.grids == whole.grids and len(encoded) == 3
    for one, reference in zip(encoded.embeds, whole.embeds):
        torch.testing.assert_close(one, reference)


@pytest.mark.parametrize("image, what", [(torch.zeros(0, 64, 64, 3), "an empty batch"),
                                         (torch.zeros(64, 64, 3), r"of shape \(64, 64, 3\)")])
def test_an_empty_or_unbatched_image_input_is_refused(demo, image: torch.Tensor, what: str) -> None:
    with pytest.raises(ImageError, match=f"'image' input is {what}") as info:
        encode_image_batch(demo, image, 384, "stretch", True)
    assert FIX.search(str(info.value))


def test_a_bad_image_is_named_by_its_place_in_the_whole_batch(demo) -> None:
    batch = torch.rand(5, 32, 32, 3)
    batch[1, 4, 4, 0] = float("nan")
    with pytest.raises(ImageError, match="^Image 2 of 5: .*NaN") as info:
        encode_image_batch(demo, batch, 64, "stretch", True)
    assert FIX.search(str(info.value))


# --- prompt ingredients ------------------------------------------------------------------------------------------

def _images(count: int, first_row: int = 0) -> EncodedImages:
    """Stand-in vision output: image i is one 2-token embedding filled with first_row + i."""
    return EncodedImages([torch.full((2, 4), float(first_row + i)) for i in range(count)], [(1, 2, 4)] * count)


def test_a_follow_up_prompt_carries_the_previous_exchange_as_history() -> None:
    first = PromptSpec(user="Name a colour.", system="Be brief.")
    second = first.followed_by("Another one?", "Be brief.", None, True, "Blue.")
    third = second.followed_by("And one more?", "", None, False, "Red.")
    assert second.history == (Turn(user="Name a colour.", assistant="Blue."),)
    assert third.history == (Turn(user="Name a colour.", assistant="Blue."),
                             Turn(user="Another one?", assistant="Red."))
    assert (third.user, third.thinking, third.image_count, third.history_images) == ("And one more?", False, 0, None)


def test_a_follow_up_keeps_the_earlier_images_first() -> None:
    first = PromptSpec(user="Describe [[IMG]] and [[IMG]].", images=_images(2))
    second = first.followed_by("Now compare with [[IMG]].", "", _images(1, first_row=10), False, "Two shapes.")
    assert second.history == (Turn(user="Describe [[IMG]] and [[IMG]].", assistant="Two shapes.", num_images=2),)
    assert [float(e[0, 0]) for e in second.history_images.embeds] == [0.0, 1.0]
    third = second.followed_by("And now?", "", None, False, "Similar.")
    assert [turn.num_images for turn in third.history] == [2, 1]
    assert [float(e[0, 0]) for e in third.history_images.embeds] == [0.0, 1.0, 10.0]


def test_a_follow_up_needs_the_previous_answer() -> None:
    with pytest.raises(PromptError, match="'previous_answer' is empty"):
        PromptSpec(user="Hi").followed_by("Next", "", None, False, "  ")


def test_per_image_mode_needs_images_and_modes_are_checked() -> None:
    with pytest.raises(PromptError, match="mode 'per image' needs images"):
        build_prompts(object(), PromptSpec(user="Describe [[IMG]]"), "per image")
    with pytest.raises(PromptError, match="is not one of"):
        build_prompts(object(), PromptSpec(user="Hi"), "all at once")


# --- live text ---------------------------------------------------------------------------------------------------

class _ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_live_text_throttles_and_always_sends_the_final_answers() -> None:
    sent: list[str] = []
    clock = _ManualClock()
    live = LiveText(1, sent.append, clock)
    live.update(0, "Hel")
    live.update(0, "Hello")  # same instant: throttled
    clock.now = 1.0
    live.update(0, "Hello wor")
    live.finish(["Hello world."])
    assert sent == ["Hel", "Hello wor", "Hello world."]
    assert live.updates == 3


def test_live_text_shows_one_section_per_image_in_per_image_mode() -> None:
    sent: list[str] = []
    live = LiveText(2, sent.append, _ManualClock())
    live.update(1, "a slime")
    assert sent == ["[image 1]\n\n\n[image 2]\na slime"]
    live.finish(["a knight", "a slime"])
    assert sent[-1] == "[image 1]\na knight\n\n[image 2]\na slime"


# --- Generate's engine call and speed line ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_model():
    return load_model("a3b-demo")


def _thinking_prompts(model, count: int) -> list:
    return [model.build_prompt(user="Write a 4-panel comic storyboard.", thinking=True) for _ in range(count)]


@pytest.mark.parametrize("count", [1, 2], ids=["single", "batch"])
def test_the_thinking_budget_widget_caps_the_reasoning_and_an_answer_follows(demo_model, count: int) -> None:
    budget = 4  # the demo model reasons for 8 tokens, then ends without an answer, when nothing stops it
    streamed: dict[int, str] = {}
    results = generate_answers(demo_model, _thinking_prompts(demo_model, count), thinking_budget=budget,
                               on_text=streamed.__setitem__, max_new_tokens=64, seed=3)
    close = demo_model.tokenizer.encode(BUDGET_CLOSE)
    for index, result in enumerate(results):
        assert result.token_ids[budget:budget + len(close)] == close  # forced right after `budget` reasoning tokens
        assert len(demo_model.tokenizer.encode(result.reasoning)) <= budget
        assert result.text.strip()
        assert streamed[index] == result.full_text


def test_a_thinking_budget_of_0_means_no_cap(demo_model) -> None:
    (result,) = generate_answers(demo_model, _thinking_prompts(demo_model, 1), thinking_budget=0,
                                 on_text=lambda index, text: None, max_new_tokens=64, seed=3)
    assert len(demo_model.tokenizer.encode(result.reasoning)) > 4
    assert result.text == ""  # the demo model's own ending: it never closed its reasoning


def _stats(new_tokens: int, stop_reason: str, decode_tok_s: float = 41.23) -> dict:
    return {"ttft_s": 0.0312, "prefill_tok_s": 812.4, "decode_tok_s": decode_tok_s, "new_tokens": new_tokens,
            "stop_reason": stop_reason, "batch_size": 1, "prompt_tokens": 25}


def test_speed_line_of_one_answer() -> None:
    assert speed_line([_stats(32, "eos")]) == "TTFT 0.03 s · prefill 812 tok/s · decode 41.2 tok/s · 32 tokens · " \
                                              "stopped: eos"


def test_speed_line_of_a_batch_sums_the_tokens_and_counts_the_stop_reasons() -> None:
    batch = [_stats(30, "eos", 120.0), _stats(64, "max_new_tokens", 120.0), _stats(12, "eos", 120.0)]
    assert speed_line(batch) == "TTFT 0.03 s · prefill 812 tok/s · decode 120.0 tok/s · 3 answers, 106 tokens · " \
                                "stopped: 2 eos, 1 max_new_tokens"
    assert speed_line(batch[::2]).endswith("2 answers, 42 tokens · stopped: eos")


def test_speed_line_leaves_out_the_decode_speed_when_nothing_was_decoded() -> None:
    assert speed_line([_stats(1, "eos", 0.0)]) == "TTFT 0.03 s · prefill 812 tok/s · 1 token · stopped: eos"


def test_speed_line_of_a_real_run_reads_the_engines_stats(demo_model) -> None:
    (result,) = generate_answers(demo_model, [demo_model.build_prompt(user="Describe the image.")],
                                 thinking_budget=0, on_text=lambda index, text: None, max_new_tokens=5,
                                 temperature=0, seed=0)
    line = speed_line([result.stats])
    assert line.startswith("TTFT ") and line.endswith(f"{len(result.token_ids)} tokens · stopped: "
                                                      f"{result.stop_reason}"), line


# --- bridge and presets ------------------------------------------------------------------------------------------

def test_the_bridge_degrades_to_no_ops_outside_comfyui() -> None:
    assert comfy_bridge.IN_COMFYUI is False
    assert comfy_bridge.llm_roots() == [] and comfy_bridge.lora_roots() == []
    assert comfy_bridge.processing_interrupted() is False
    comfy_bridge.raise_if_interrupted()
    comfy_bridge.send_text("1", "text")
    comfy_bridge.free_device_memory(1 << 30, torch.device("cuda"))
    comfy_bridge.Progress(10).set(5)
    assert comfy_bridge.engine_device() == torch.device("cpu")
    assert comfy_bridge.Residency is None
    with pytest.raises(RuntimeError, match="only known inside ComfyUI"):
        comfy_bridge.output_directory()


@pytest.mark.parametrize("comfy_device, engine", [("cuda:1", "cuda:1"), ("cpu", "cpu"), ("mps", "cpu"),
                                                  ("xpu:0", "cpu")])
def test_the_engine_runs_on_comfyuis_device_when_it_is_a_cuda_gpu(comfy_device: str, engine: str) -> None:
    """ComfyUI's --cpu and --cuda-device choices hold for the engine; devices it cannot run on mean the CPU."""
    assert comfy_bridge.device_for_engine(torch.device(comfy_device)) == torch.device(engine)


def test_preset_budgets() -> None:
    """The preset names spelled once (a3b_core.runtime.options) are the planner's, and each frees what it plans for."""
    assert set(PRESET_NAMES) == {"auto", "cpu", *PRESETS}
    assert preset_budget_bytes("cpu") == 0
    for name, preset in PRESETS.items():
        assert preset_budget_bytes(name) == preset.vram_gib * 1024**3
    assert preset_budget_bytes("auto") > 1024**4  # everything: other models make room first




# --- the Loader's plan text --------------------------------------------------------------------------------------

@pytest.mark.parametrize("chat_template, in_use", [("auto", "model folder: chat_template.jinja"),
                                                   ("built-in", "built-in")])
def test_the_loaders_plan_says_which_chat_template_is_in_use(tmp_path: Path, fixtures, chat_template: str,
                                                            in_use: str) -> None:
    folder = tmp_path / "model"
    shutil.copytree(fixtures.moe_hf, folder)
    shutil.copy(Path(__file__).parent / "data" / "qwen3_5_chat_template.jinja", folder / "chat_template.jinja")
    handle = A3BModelHandle(str(folder), LoadOptions(preset="cpu", chat_template=chat_template), keep_loaded=False)
    handle.acquire()
    assert handle.plan_summary.endswith(f"; chat template: {in_use}")
    assert handle.plan_table.endswith(f"\nchat template: {in_use}")
    handle.release()
