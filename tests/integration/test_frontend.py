"""ComfyUI's real frontend in headless Chromium: the template browser lists the shipped UI workflows, which load
(also as saved before the newest widget) and convert to exactly the shipped API copies, and run with the answer
streamed onto the Generate node and the speed line shown under it; the thinking budget stops the reasoning."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from a3b_core.prompting.tokenizer import Tokenizer
from bench.demo_model.train import DEMO_DIR
from tests.integration.comfy_server import CHROMIUM, NODE_MODULES, PACK_NAME, ComfyServer
from tests.integration.conftest import (TEST_MAX_NEW_TOKENS, TINY_MODEL, WORKFLOWS, caption_file_names,
                                        error_message, load_api_workflow)

pytestmark = pytest.mark.comfyui

UI_WORKFLOWS = sorted(WORKFLOWS.glob("*.json"))  # the API copies are in workflows/api/
FRONTEND_TIMEOUT_S = 900


def run_frontend(comfy: ComfyServer, out_dir: Path, mode: str, widgets: dict, previews: list = (),
                 workflows: list[Path] = UI_WORKFLOWS) -> dict:
    """Loads `workflows` in the real frontend with the `widgets` values set ({"NodeClass": {"widget": value}}) and a
    Preview as Text node wired to each [NodeClass, output slot] in `previews`; converts ('convert') or runs them."""
    playwright = NODE_MODULES / "playwright-core"
    missing = [str(path) for path in (CHROMIUM, playwright) if not path.exists()]
    if missing:
        reason = f"headless browser not installed ({', '.join(missing)}); run `bash .ci/comfyui.sh`"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    command = ["node", str(Path(__file__).with_name("frontend.cjs")), "check", comfy.url, str(out_dir),
               json.dumps({"widgets": widgets, "previews": previews}), mode, *map(str, workflows)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=FRONTEND_TIMEOUT_S,
                          env=dict(os.environ, A3B_PLAYWRIGHT=str(playwright)))
    assert done.returncode == 0, f"frontend check failed:\n{done.stderr[-4000:]}\n{comfy.log_tail()}"
    report = json.loads(done.stdout)
    assert report["pageErrors"] == []
    assert [entry["name"] for entry in report["workflows"]] == [path.stem for path in workflows]
    return report


SHIPPED = ["multi_angle_captioning", "pixel_art_lora_captioning", "storyboard_shot_list", "video_lora_captioning"]


def test_the_four_workflows_are_shipped() -> None:
    assert [path.stem for path in UI_WORKFLOWS] == SHIPPED


def test_the_template_browser_lists_exactly_the_ui_workflows(comfy: ComfyServer) -> None:
    templates = comfy.get("/api/workflow_templates")
    assert sorted(templates[PACK_NAME]) == SHIPPED
    for name in templates[PACK_NAME]:  # what the browser opens: a UI graph
        workflow = comfy.get(f"/api/workflow_templates/{PACK_NAME}/{name}.json")
        assert workflow["nodes"] and workflow["links"], name


def test_ui_workflows_convert_to_the_shipped_api_copies(comfy: ComfyServer, tmp_path: Path) -> None:
    report = run_frontend(comfy, tmp_path, "convert", {"A3BModelLoader": {"model": TINY_MODEL}})
    for entry in report["workflows"]:
        assert entry["apiPrompt"] == load_api_workflow(entry["name"]), entry["name"]


def test_workflows_saved_before_the_thinking_budget_widget_keep_their_values(comfy: ComfyServer,
                                                                            tmp_path: Path) -> None:
    # The frontend assigns saved widget values by position: the newest widget must come last, so an older file
    # (one value fewer, no thinking_budget input) loads with every value in its place and the new widget at its
    # default.
    saved = tmp_path / "saved"
    saved.mkdir()
    for path in UI_WORKFLOWS:
        workflow = json.loads(path.read_text())
        for node in workflow["nodes"]:
            if node["type"] == "A3BGenerate":
                assert node["widgets_values"][-1] == 0 and node["inputs"][-1]["name"] == "thinking_budget"
                node["widgets_values"] = node["widgets_values"][:-1]
                node["inputs"] = node["inputs"][:-1]
        (saved / path.name).write_text(json.dumps(workflow))
    report = run_frontend(comfy, tmp_path, "convert", {"A3BModelLoader": {"model": TINY_MODEL}},
                          workflows=sorted(saved.glob("*.json")))
    for entry in report["workflows"]:
        assert entry["apiPrompt"] == load_api_workflow(entry["name"]), entry["name"]


SPEED_LINE = re.compile(r"TTFT \d+\.\d\d s · prefill \d+ tok/s · (decode \d+\.\d tok/s · )?"
                        r"((?P<answers>\d+) answers, )?(?P<tokens>\d+) tokens? · stopped: (?P<reasons>.+)")


def test_ui_workflows_run_and_stream_onto_the_generate_node(comfy: ComfyServer, tmp_path: Path) -> None:
    report = run_frontend(comfy, tmp_path, "run", {"A3BModelLoader": {"model": TINY_MODEL},
                                                   "A3BGenerate": {"max_new_tokens": TEST_MAX_NEW_TOKENS},
                                                   "A3BCaptionFolder": {"max_new_tokens": TEST_MAX_NEW_TOKENS}})
    for entry in report["workflows"]:
        name, history = entry["name"], entry.get("history")
        assert history is not None, f"{name} was not queued: {entry.get('queueError')}"
        assert history["status"]["status_str"] == "success", f"{name}: {error_message(history)}"
        for node in entry["generateNodes"]:
            answers = history["outputs"][node["id"]]["a3b_answer"]
            assert all(answer.strip() for answer in answers), name
            assert node["liveTexts"], f"{name}: no live text reached the page for node {node['id']}"
            assert node["shownText"] == "\n\n".join(answers), name
            _check_speed_line(node, history, len(answers))
        for node_id, node in entry["apiPrompt"].items():
            if node["class_type"] == "A3BCaptionFolder":  # the pixel-art workflow captions its dataset folder
                assert history["outputs"][node_id]["a3b_saved"] in (["4 written"], ["4 skipped"]), name
            if node["class_type"] == "A3BSaveCaptions":  # one caption file per image or clip, named after it
                folder = comfy.output_dir / node["inputs"]["subfolder"]
                for file_name in caption_file_names(entry["apiPrompt"], node_id):
                    assert (folder / f"{file_name.rsplit('.', 1)[0]}.txt").read_text().strip(), f"{name}: {file_name}"
        assert all(plan for plan in entry["planShown"]), name
        assert Path(entry["screenshot"]).stat().st_size > 10_000


def _check_speed_line(node: dict, history: dict, answers: int, max_new_tokens: int = TEST_MAX_NEW_TOKENS) -> re.Match:
    """The speed line is shown on the page under the answer, as the server sent it, and describes the run."""
    assert node["speedShown"] == history["outputs"][node["id"]]["a3b_speed"][0]
    assert node["speedOnPage"]
    order = node["widgetOrder"]
    answer_widget = "$$node-text-preview" if "$$node-text-preview" in order else "a3b_answer"
    assert order.index("a3b_speed") > order.index(answer_widget), order
    line = SPEED_LINE.fullmatch(node["speedShown"])
    assert line, node["speedShown"]
    assert int(line["answers"] or 1) == answers
    assert 1 <= int(line["tokens"]) <= answers * max_new_tokens
    return line


def test_the_thinking_budget_stops_the_reasoning_and_an_answer_follows(comfy: ComfyServer, tmp_path: Path) -> None:
    # unbounded, the demo model reasons for about 55 tokens a panel here and then ends without an answer; cut at 4, it
    # answers each panel with a shot (about 50 tokens) and ends
    budget, max_new_tokens = 4, 256
    (workflow,) = [path for path in UI_WORKFLOWS if path.stem == "storyboard_shot_list"]
    report = run_frontend(comfy, tmp_path, "run",
                          {"A3BModelLoader": {"model": "a3b-demo"}, "A3BPrompt": {"thinking": "on"},
                           "A3BGenerate": {"thinking_budget": budget, "max_new_tokens": max_new_tokens}},
                          previews=[["A3BGenerate", 1]], workflows=[workflow])
    (entry,) = report["workflows"]
    history = entry["history"]
    assert history["status"]["status_str"] == "success", error_message(history)
    (node,) = entry["generateNodes"]
    (reasoning_preview,) = [node_id for node_id, graph_node in entry["apiPrompt"].items()
                            if graph_node["inputs"].get("source") == [node["id"], 1]]
    reasonings = history["outputs"][reasoning_preview]["text"]  # one per panel (per-image mode)
    tokenizer = Tokenizer.from_folder(DEMO_DIR)
    assert all(1 <= len(tokenizer.encode(reasoning)) <= budget for reasoning in reasonings), reasonings
    answers = history["outputs"][node["id"]]["a3b_answer"]
    assert len(answers) == len(reasonings) == 4 and all(answer.strip() for answer in answers)
    assert node["shownText"] == "\n\n".join(answers)
    line = _check_speed_line(node, history, len(answers), max_new_tokens)
    assert int(line["tokens"]) > budget * len(answers) and line["reasons"] == "eos"
    assert Path(entry["screenshot"]).stat().st_size > 10_000
