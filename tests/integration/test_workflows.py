"""The shipped API workflows, Stop, bad input, memory release and A3B LoRA, in a real ComfyUI."""
from __future__ import annotations

import copy

import pytest

from bench.demo_model.dataset import parse_shot
from nodes.live_text import LiveText
from tests.integration.comfy_server import ComfyServer
from tests.integration.conftest import (BROKEN_MODEL, TEST_MAX_NEW_TOKENS, caption_file_names, error_message,
                                        load_api_workflow)
from tests.integration.pixel_art_inputs import expected_captions
from tests.integration.storyboard_inputs import PANELS
from tests.integration.video_inputs import CLIP_NAME
from tests.integration.video_inputs import expected_caption as expected_clip_caption
from tests.integration.view_inputs import expected_captions as expected_view_captions
from tests.synthetic_adapters import write_demo_adapter

pytestmark = pytest.mark.comfyui

GENERATE_WORKFLOWS = ["multi_angle_captioning", "storyboard_shot_list", "video_lora_captioning"]


def _nodes(graph: dict, class_type: str) -> list[str]:
    return [node_id for node_id, node in graph.items() if node["class_type"] == class_type]


def _set_inputs(graph: dict, class_type: str, **inputs) -> dict:
    graph = copy.deepcopy(graph)
    for node_id in _nodes(graph, class_type):
        graph[node_id]["inputs"].update(inputs)
    return graph


def _succeeded(comfy: ComfyServer, entry: dict) -> None:
    assert entry["status"]["status_str"] == "success", f"{error_message(entry)}\n{comfy.log_tail()}"


@pytest.mark.parametrize("name", GENERATE_WORKFLOWS)
def test_api_workflow_runs_to_non_empty_answers(comfy: ComfyServer, name: str) -> None:
    graph = _set_inputs(load_api_workflow(name), "A3BGenerate", max_new_tokens=TEST_MAX_NEW_TOKENS)
    entry = comfy.run(graph)
    _succeeded(comfy, entry)
    (generate,) = _nodes(graph, "A3BGenerate")
    answers = entry["outputs"][generate]["a3b_answer"]
    images = sum(1 for node in graph.values() if node["class_type"] in ("LoadImage", "LoadVideo"))
    assert len(answers) == max(images, 1)  # per-image mode: one answer per image or clip
    assert all(answer.strip() for answer in answers)
    (speed,) = entry["outputs"][generate]["a3b_speed"]
    assert speed.startswith("TTFT ") and " tok/s · " in speed and " · stopped: " in speed, speed
    assert (f"{len(answers)} answers, " in speed) == (len(answers) > 1), speed
    for save in _nodes(graph, "A3BSaveCaptions"):
        inputs = graph[save]["inputs"]
        folder = comfy.output_dir / inputs["subfolder"]
        stems = [name.rsplit(".", 1)[0] for name in caption_file_names(graph, save)]
        combined = [inputs["combined_file"]] if inputs.get("combined_file") else []
        assert sorted(path.stem for path in folder.glob("*.txt")) == sorted(stems + combined)
        prefix = f"{inputs['trigger_word']}, " if inputs["trigger_word"] else ""
        assert all((folder / f"{stem}.txt").read_text().startswith(prefix) for stem in stems)
        for stem in combined:  # every answer in order, after its file's name
            lines = (folder / f"{stem}.txt").read_text().splitlines()
            assert [line.split(": ", 1)[0] for line in lines] == stems


def test_an_api_graph_saved_without_the_newest_optional_inputs_still_runs(comfy: ComfyServer) -> None:
    graph = _set_inputs(load_api_workflow("storyboard_shot_list"), "A3BGenerate", seed=51, max_new_tokens=16)
    graph = _set_inputs(graph, "A3BSaveCaptions", subfolder="a3b_captions/storyboard_older")
    (generate,), (save,) = _nodes(graph, "A3BGenerate"), _nodes(graph, "A3BSaveCaptions")
    del graph[generate]["inputs"]["thinking_budget"], graph[save]["inputs"]["combined_file"]
    entry = comfy.run(graph)
    _succeeded(comfy, entry)
    assert entry["outputs"][generate]["a3b_answer"][0].strip()
    saved = sorted(path.name for path in (comfy.output_dir / "a3b_captions" / "storyboard_older").iterdir())
    assert saved == sorted(name.replace(".png", ".txt") for name in PANELS)  # no combined file


def test_pixel_art_workflow_as_shipped_captions_its_folder_on_the_demo_model(comfy: ComfyServer) -> None:
    graph = load_api_workflow("pixel_art_lora_captioning", model="a3b-demo")  # the shipped default
    graph = _set_inputs(graph, "A3BCaptionFolder", output_subfolder="a3b_captions/pixel_art_demo")
    entry = comfy.run(graph)
    _succeeded(comfy, entry)
    folder = comfy.output_dir / "a3b_captions" / "pixel_art_demo"
    expected = {name.replace(".png", ".txt"): f"pxlart, {caption}\n" for name, caption in expected_captions().items()}
    assert {path.name: path.read_text() for path in folder.iterdir()} == expected
    (preview,) = _nodes(graph, "PreviewAny")  # the caption output list, one caption per image in sorted order
    assert entry["outputs"][preview]["text"] == [expected[name].strip() for name in sorted(expected)]
    (caption,) = _nodes(graph, "A3BCaptionFolder")
    assert entry["outputs"][caption]["a3b_saved"] == ["4 written"]


def test_multi_view_workflow_as_shipped_captions_each_view_on_the_demo_model(comfy: ComfyServer) -> None:
    graph = load_api_workflow("multi_angle_captioning", model="a3b-demo")
    entry = comfy.run(graph)
    _succeeded(comfy, entry)
    (generate,) = _nodes(graph, "A3BGenerate")
    expected = expected_view_captions()
    assert entry["outputs"][generate]["a3b_answer"] == list(expected.values())
    (save,) = _nodes(graph, "A3BSaveCaptions")
    folder = comfy.output_dir / graph[save]["inputs"]["subfolder"]
    assert {name: (folder / name.replace(".png", ".txt")).read_text().strip() for name in expected} == expected


def test_storyboard_workflow_as_shipped_describes_each_panel_on_the_demo_model(comfy: ComfyServer) -> None:
    graph = load_api_workflow("storyboard_shot_list", model="a3b-demo")
    entry = comfy.run(graph)
    _succeeded(comfy, entry)
    (generate,), (save,) = _nodes(graph, "A3BGenerate"), _nodes(graph, "A3BSaveCaptions")
    answers = entry["outputs"][generate]["a3b_answer"]
    assert [parse_shot(answer) for answer in answers] == list(PANELS.values()), answers
    folder = comfy.output_dir / graph[save]["inputs"]["subfolder"]
    for name, scene in PANELS.items():
        assert parse_shot((folder / name.replace(".png", ".txt")).read_text().strip()) == scene, name
    shot_list = (folder / f"{graph[save]['inputs']['combined_file']}.txt").read_text().splitlines()
    assert [tuple(line.split(": ", 1)) for line in shot_list] == [(name.removesuffix(".png"), answer)
                                                                 for name, answer in zip(PANELS, answers)]
    assert [parse_shot(line.split(": ", 1)[1]) for line in shot_list] == list(PANELS.values())


def test_video_workflow_as_shipped_captions_the_clip_on_the_demo_model(comfy: ComfyServer) -> None:
    graph = load_api_workflow("video_lora_captioning", model="a3b-demo")
    entry = comfy.run(graph)
    _succeeded(comfy, entry)
    (generate,) = _nodes(graph, "A3BGenerate")
    assert entry["outputs"][generate]["a3b_answer"] == [expected_clip_caption()]
    (save,) = _nodes(graph, "A3BSaveCaptions")
    caption = comfy.output_dir / graph[save]["inputs"]["subfolder"] / CLIP_NAME.replace(".webm", ".txt")
    assert caption.read_text().strip() == expected_clip_caption()


def test_the_folder_node_skips_captioned_images_on_a_rerun(comfy: ComfyServer) -> None:
    graph = _set_inputs(load_api_workflow("pixel_art_lora_captioning"), "A3BCaptionFolder",
                        output_subfolder="a3b_captions/pixel_art_rerun", max_new_tokens=TEST_MAX_NEW_TOKENS)
    (caption,) = _nodes(graph, "A3BCaptionFolder")
    _succeeded(comfy, first := comfy.run(graph))
    assert first["outputs"][caption]["a3b_saved"] == ["4 written"]
    files = {path: path.read_text() for path in (comfy.output_dir / "a3b_captions" / "pixel_art_rerun").iterdir()}
    second = comfy.run(_set_inputs(graph, "A3BCaptionFolder", seed=1))  # another input: not served from the cache
    _succeeded(comfy, second)
    assert second["outputs"][caption]["a3b_saved"] == ["4 skipped"]
    assert {path: path.read_text() for path in files} == files


@pytest.mark.parametrize("folder", ["..", "/etc"])
def test_the_folder_node_refuses_a_folder_outside_comfyuis_folders(comfy: ComfyServer, folder: str) -> None:
    graph = _set_inputs(load_api_workflow("pixel_art_lora_captioning"), "A3BCaptionFolder", folder=folder)
    entry = comfy.run(graph)
    assert entry["status"]["status_str"] == "error"
    message = error_message(entry)
    assert message.startswith("a3b_core.errors.ConfigError: folder ") and "ComfyUI's input folder" in message


def test_the_answers_stream_onto_the_generate_node(comfy: ComfyServer) -> None:
    graph = _set_inputs(load_api_workflow("storyboard_shot_list"), "A3BGenerate", seed=11, max_new_tokens=64)
    entry, live = comfy.run_watching(graph)
    _succeeded(comfy, entry)
    (generate,) = _nodes(graph, "A3BGenerate")
    texts = [text for node_id, text in live if node_id == generate]
    assert texts, "no live text was sent for the Generate node"
    answers = entry["outputs"][generate]["a3b_answer"]
    shown: list[str] = []
    LiveText(len(answers), shown.append).finish(answers)  # one section per panel
    assert len(answers) == len(PANELS) and texts[-1] == shown[-1]


def test_stop_ends_a_long_generation_and_the_next_prompt_still_runs(comfy: ComfyServer) -> None:
    # Greedy decoding of the tiny test model meets its end token only after ~400 tokens (seconds of decoding), long
    # after the interrupt, which is sent as soon as the first token has streamed.
    graph = _set_inputs(load_api_workflow("storyboard_shot_list"), "A3BGenerate", max_new_tokens=20000,
                        temperature=0.0, presence_penalty=0.0, seed=21)
    (generate,) = _nodes(graph, "A3BGenerate")
    entry, live = comfy.run_watching(graph, interrupt_after_text_from=generate)
    kinds = [kind for kind, _ in entry["status"]["messages"]]
    assert "execution_interrupted" in kinds, f"the generation was not interrupted: {kinds}"
    assert generate not in entry["outputs"]
    assert any(node_id == generate for node_id, _ in live)

    after = comfy.run(_set_inputs(graph, "A3BGenerate", max_new_tokens=16))
    _succeeded(comfy, after)
    assert after["outputs"][generate]["a3b_answer"][0].strip()


def test_a_model_folder_without_weights_fails_with_the_engines_message(comfy: ComfyServer) -> None:
    entry = comfy.run(load_api_workflow("storyboard_shot_list", model=BROKEN_MODEL))
    assert entry["status"]["status_str"] == "error"
    message = error_message(entry)
    assert message.startswith("a3b_core.errors.CheckpointError: ") and BROKEN_MODEL in message, message


@pytest.mark.parametrize("name", ["../outside", "/etc"])
def test_a_model_name_outside_the_llm_folders_is_refused(comfy: ComfyServer, name: str) -> None:
    # ComfyUI 0.3.75 does not check V3 combo values against their options, so the node itself must refuse.
    entry = comfy.run(load_api_workflow("storyboard_shot_list", model=name))
    assert entry["status"]["status_str"] == "error"
    message = error_message(entry)
    assert message.startswith("a3b_core.errors.ConfigError: ") and "not a folder name under models/LLM" in message


def test_an_image_marker_mismatch_fails_with_the_engines_message(comfy: ComfyServer) -> None:
    graph = _set_inputs(load_api_workflow("multi_angle_captioning"), "A3BPrompt",
                        user="Compare [[IMG]] with [[IMG]].")
    entry = comfy.run(graph)
    assert entry["status"]["status_str"] == "error"
    message = error_message(entry)
    assert "PromptError" in message and "[[IMG]]" in message, message


def test_comfyui_unload_releases_the_model_and_the_next_run_reloads_it(comfy: ComfyServer) -> None:
    graph = _set_inputs(load_api_workflow("storyboard_shot_list"), "A3BGenerate", seed=31, max_new_tokens=8)
    _succeeded(comfy, comfy.run(graph))
    released_before = comfy.log_text().count("A3B model released")
    status, _ = comfy.request("POST", "/free", {"unload_models": True})
    assert status == 200
    comfy.wait_for_log("A3B model released", occurrences=released_before + 1)

    loaded_before = comfy.log_text().count("A3B model loaded")
    _succeeded(comfy, comfy.run(_set_inputs(graph, "A3BGenerate", seed=32)))
    assert comfy.log_text().count("A3B model loaded") == loaded_before + 1


def test_keep_loaded_off_frees_the_model_after_each_generation(comfy: ComfyServer) -> None:
    graph = _set_inputs(load_api_workflow("storyboard_shot_list"), "A3BModelLoader", keep_loaded=False)
    graph = _set_inputs(graph, "A3BGenerate", seed=41, max_new_tokens=8)
    released_before = comfy.log_text().count("A3B model released")
    _succeeded(comfy, comfy.run(graph))
    assert comfy.log_text().count("A3B model released") == released_before + 1


def test_the_loaders_dense_format_reaches_the_engine(comfy: ComfyServer) -> None:
    graph = _set_inputs(load_api_workflow("storyboard_shot_list"), "A3BModelLoader", dense_format="int8",
                        keep_loaded=False)
    graph = _set_inputs(graph, "A3BGenerate", seed=61, max_new_tokens=8)
    entry = comfy.run(graph)
    _succeeded(comfy, entry)
    (loader,) = _nodes(graph, "A3BModelLoader")
    (summary,) = entry["outputs"][loader]["a3b_plan"]
    assert "dense int8 on cpu" in summary, summary


def _with_lora(graph: dict, lora: str, strength: float) -> dict:
    """`graph` with an A3B LoRA between its Loader and every node that takes the Loader's model."""
    graph = copy.deepcopy(graph)
    (loader,) = _nodes(graph, "A3BModelLoader")
    for node in graph.values():
        if node["inputs"].get("model") == [loader, 0]:
            node["inputs"]["model"] = ["lora", 0]
    graph["lora"] = {"class_type": "A3BLoRA", "inputs": {"model": [loader, 0], "lora": lora, "strength": strength}}
    return graph


def test_a_lora_changes_the_answers_and_at_strength_0_gives_the_base_models(comfy: ComfyServer) -> None:
    write_demo_adapter(comfy.base / "models" / "loras" / "demo-style")  # listed from the next /object_info on
    _, lora = comfy.get("/object_info/A3BLoRA")["A3BLoRA"]["input"]["required"]["lora"]
    assert "demo-style" in lora["options"]
    graph = _set_inputs(load_api_workflow("multi_angle_captioning", model="a3b-demo"), "A3BGenerate", temperature=0,
                        max_new_tokens=24, seed=1)
    graph = _set_inputs(graph, "A3BSaveCaptions", subfolder="a3b_captions/lora")
    (generate,) = _nodes(graph, "A3BGenerate")

    def answers(graph: dict) -> list[str]:
        entry = comfy.run(graph)
        _succeeded(comfy, entry)
        return entry["outputs"][generate]["a3b_answer"]

    base = answers(graph)
    adapted = answers(_with_lora(graph, "demo-style", 1.0))
    assert len(adapted) == len(base) and adapted != base
    assert answers(_with_lora(graph, "demo-style", 0.0)) == base
    # the Loader's own wire runs the base model again after a LoRA wire used the same loaded model
    assert answers(_set_inputs(graph, "A3BGenerate", seed=2)) == base
