"""ComfyUI's real frontend in headless Chromium: the JS extension registers, the shipped UI workflows load and
convert to exactly the shipped API copies, and run with the answer streamed onto the Generate node."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.integration.comfy_server import CHROMIUM, NODE_MODULES, PACK_NAME, ComfyServer
from tests.integration.conftest import (TEST_MAX_NEW_TOKENS, TINY_MODEL, WORKFLOWS, error_message,
                                        load_api_workflow)

pytestmark = pytest.mark.comfyui

UI_WORKFLOWS = sorted(WORKFLOWS.glob("*.json"))  # the API copies are in workflows/api/
FRONTEND_TIMEOUT_S = 900


def run_frontend(comfy: ComfyServer, out_dir: Path, mode: str, overrides: dict) -> dict:
    playwright = NODE_MODULES / "playwright-core"
    missing = [str(path) for path in (CHROMIUM, playwright) if not path.exists()]
    if missing:
        reason = f"headless browser not installed ({', '.join(missing)}); run `bash .ci/comfyui.sh`"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    command = ["node", str(Path(__file__).with_name("frontend.cjs")), "check", comfy.url, str(out_dir),
               json.dumps(overrides), mode, *map(str, UI_WORKFLOWS)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=FRONTEND_TIMEOUT_S,
                          env=dict(os.environ, A3B_PLAYWRIGHT=str(playwright)))
    assert done.returncode == 0, f"frontend check failed:\n{done.stderr[-4000:]}\n{comfy.log_tail()}"
    report = json.loads(done.stdout)
    assert report["pageErrors"] == []
    assert [entry["name"] for entry in report["workflows"]] == [path.stem for path in UI_WORKFLOWS]
    return report


def test_the_three_workflows_are_shipped() -> None:
    assert [path.stem for path in UI_WORKFLOWS] == ["comic_storyboard", "multi_angle_captioning",
                                                     "pixel_art_lora_captioning"]


def test_the_template_browser_lists_exactly_the_ui_workflows(comfy: ComfyServer) -> None:
    templates = comfy.get("/api/workflow_templates")
    assert sorted(templates[PACK_NAME]) == ["comic_storyboard", "multi_angle_captioning", "pixel_art_lora_captioning"]
    for name in templates[PACK_NAME]:  # what the browser opens: a UI graph
        workflow = comfy.get(f"/api/workflow_templates/{PACK_NAME}/{name}.json")
        assert workflow["nodes"] and workflow["links"], name


def test_ui_workflows_convert_to_the_shipped_api_copies(comfy: ComfyServer, tmp_path: Path) -> None:
    report = run_frontend(comfy, tmp_path, "convert", {"A3BModelLoader": {"model": TINY_MODEL}})
    for entry in report["workflows"]:
        assert entry["apiPrompt"] == load_api_workflow(entry["name"]), entry["name"]


def test_ui_workflows_run_and_stream_onto_the_generate_node(comfy: ComfyServer, tmp_path: Path) -> None:
    report = run_frontend(comfy, tmp_path, "run", {"A3BModelLoader": {"model": TINY_MODEL},
                                                   "A3BGenerate": {"max_new_tokens": TEST_MAX_NEW_TOKENS}})
    for entry in report["workflows"]:
        name, history = entry["name"], entry.get("history")
        assert history is not None, f"{name} was not queued: {entry.get('queueError')}"
        assert history["status"]["status_str"] == "success", f"{name}: {error_message(history)}"
        for node in entry["generateNodes"]:
            answers = history["outputs"][node["id"]]["a3b_answer"]
            assert all(answer.strip() for answer in answers), name
            assert node["liveTexts"], f"{name}: no live text reached the page for node {node['id']}"
            assert node["shownText"] == "\n\n".join(answers), name
        assert all(plan for plan in entry["planShown"]), name
        assert Path(entry["screenshot"]).stat().st_size > 10_000
