"""The pack as ComfyUI's /object_info describes it: nine nodes, their inputs, defaults and tooltips."""
from __future__ import annotations

import pytest

from a3b_core.runtime.options import CHAT_TEMPLATES, DENSE_FORMATS, KV_FORMATS, WEIGHT_FORMATS
from a3b_core.runtime.sampling import resolve_sampling
from tests.integration.comfy_server import PACK_NAME
from tests.integration.conftest import BROKEN_MODEL, TINY_MODEL

pytestmark = pytest.mark.comfyui

EXPECTED = {
    "A3BModelLoader": ("A3B Model Loader", ["model", "vram_preset", "weight_format", "kv_cache", "max_context",
                                            "keep_loaded", "device", "chat_template", "dense_format", "mmproj"],
                       ["A3B_MODEL"]),
    "A3BLoRA": ("A3B LoRA", ["model", "lora", "strength"], ["A3B_MODEL"]),
    "A3BRemoteModel": ("A3B Remote Model", ["base_url", "model", "api_key_env", "timeout"], ["A3B_MODEL"]),
    "A3BImageEncode": ("A3B Image Encode", ["model", "image", "size", "resize", "srgb"], ["A3B_IMAGES"]),
    "A3BVideoEncode": ("A3B Video Encode", ["model", "frame_rate", "fps", "max_frames", "max_frame_tokens", "video",
                                            "frames", "images"], ["A3B_IMAGES", "STRING"]),
    "A3BPrompt": ("A3B Prompt", ["system", "user", "thinking", "images", "previous", "previous_answer"],
                  ["A3B_PROMPT"]),
    "A3BGenerate": ("A3B Generate", ["model", "prompt", "mode", "max_new_tokens", "temperature", "top_p", "top_k",
                                     "min_p", "presence_penalty", "repetition_penalty", "seed", "thinking_budget"],
                    ["STRING", "STRING"]),
    "A3BSaveCaptions": ("A3B Save Captions", ["captions", "subfolder", "names", "filename_prefix", "trigger_word",
                                              "if_exists", "combined_file"], []),
    "A3BCaptionFolder": ("A3B Caption Folder", ["model", "folder_root", "folder", "recursive", "output_subfolder",
                                                "preset", "prompt", "existing", "trigger_word", "prefix", "suffix",
                                                "template", "banned", "required", "max_length", "dry_run", "start",
                                                "limit", "batch_size", "size", "max_new_tokens", "temperature",
                                                "seed"], ["STRING", "STRING", "STRING"]),
}


def _inputs(info: dict) -> dict[str, tuple]:
    return info["input"]["required"] | info["input"].get("optional", {})


@pytest.fixture(scope="module")
def object_info(comfy) -> dict:
    info = comfy.get("/object_info")
    assert "A3BModelLoader" in info, f"the pack did not load:\n{comfy.log_tail()}"
    return info


@pytest.mark.parametrize("node_id", sorted(EXPECTED))
def test_node_is_listed_with_its_inputs_outputs_and_tooltips(object_info: dict, node_id: str) -> None:
    display_name, input_names, outputs = EXPECTED[node_id]
    info = object_info[node_id]
    assert info["display_name"] == display_name
    assert info["category"] == "A3B"
    assert info["python_module"] == f"custom_nodes.{PACK_NAME}"
    inputs = _inputs(info)
    assert list(inputs) == input_names
    assert info["output"] == outputs
    missing_tooltips = [name for name, (_, options) in inputs.items() if not options.get("tooltip")]
    assert missing_tooltips == []


def test_loader_offers_the_demo_and_the_llm_folder_models(object_info: dict) -> None:
    inputs = _inputs(object_info["A3BModelLoader"])
    models = inputs["model"][1]["options"]
    assert models[:2] == ["a3b-demo", "a3b-demo-fp8"]
    assert {TINY_MODEL, BROKEN_MODEL} <= set(models)
    assert inputs["vram_preset"][1]["options"] == ["auto", "8gb", "12gb", "16gb", "24gb", "48gb", "cpu"]
    assert inputs["vram_preset"][1]["default"] == "auto"
    # the engine's own vocabulary, spelled once in a3b_core.runtime.options
    assert inputs["weight_format"][1]["options"] == list(WEIGHT_FORMATS)
    assert inputs["kv_cache"][1]["options"] == list(KV_FORMATS)
    # ComfyUI here runs with --cpu on a machine without GPUs: its device, or the CPU; the last widgets, optional
    assert inputs["device"][1]["options"] == ["auto", "cpu"] and inputs["device"][1]["default"] == "auto"
    assert inputs["chat_template"][1]["options"] == list(CHAT_TEMPLATES)
    assert inputs["chat_template"][1]["default"] == "auto"
    assert inputs["dense_format"][1]["options"] == list(DENSE_FORMATS)
    assert inputs["dense_format"][1]["default"] == "auto"
    assert all(word in inputs["dense_format"][1]["tooltip"] for word in ("memory", "accuracy", "CPU"))
    assert list(object_info["A3BModelLoader"]["input"]["optional"]) == ["device", "chat_template", "dense_format",
                                                                         "mmproj"]
    assert inputs["mmproj"][1]["options"][:2] == ["auto", "none"] and inputs["mmproj"][1]["default"] == "auto"


def test_generate_defaults_are_qwens_non_thinking_settings(object_info: dict) -> None:
    info = object_info["A3BGenerate"]
    inputs = _inputs(info)
    defaults = {name: inputs[name][1]["default"] for name in
                ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "repetition_penalty")}
    assert defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0, "presence_penalty": 1.5,
                        "repetition_penalty": 1.0}
    assert inputs["seed"][1]["control_after_generate"] is True
    # the last widget, and optional, so workflows saved without it keep their values and still validate
    assert list(info["input"]["optional"]) == ["thinking_budget"]
    assert (inputs["thinking_budget"][1]["default"], inputs["thinking_budget"][1]["min"]) == (0, 0)
    assert inputs["mode"][1]["options"] == ["single", "per image"]
    assert info["output_is_list"] == [True, True]
    assert info["input"]["hidden"] == {"unique_id": ["UNIQUE_ID"]}



def test_prompt_thinking_is_the_models_own_default_unless_chosen(object_info: dict) -> None:
    thinking = _inputs(object_info["A3BPrompt"])["thinking"][1]
    assert (thinking["options"], thinking["default"]) == (["auto", "on", "off"], "auto")
    assert "default" in thinking["tooltip"]


def test_every_sampler_widget_value_is_one_the_engine_accepts(object_info: dict) -> None:
    """Each widget's ends are accepted, and the engine's ranges are intervals (temperature: 0, then from 0.01, below
    the widget's 0.05 step), so every value a widget can take is accepted."""
    inputs = _inputs(object_info["A3BGenerate"])
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "repetition_penalty"):
        for end in ("min", "max"):
            resolve_sampling(False, **{name: inputs[name][1][end]})


def test_image_encode_and_save_captions_settings(object_info: dict) -> None:
    encode = _inputs(object_info["A3BImageEncode"])
    assert (encode["size"][1]["default"], encode["size"][1]["step"]) == (384, 32)
    assert encode["resize"][1]["options"] == ["stretch", "letterbox", "crop", "native"]
    assert encode["srgb"][1]["default"] is True
    save = object_info["A3BSaveCaptions"]
    assert save["output_node"] is True
    assert _inputs(save)["if_exists"][1]["options"] == ["skip", "overwrite"]
    assert save["input"]["optional"]["combined_file"][1]["default"] == ""  # API graphs saved before it still run


def test_the_js_extension_is_served(comfy) -> None:
    scripts = comfy.get("/extensions")
    assert f"/extensions/{PACK_NAME}/js/a3b.js" in scripts
