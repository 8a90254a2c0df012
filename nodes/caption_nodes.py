"""A3B Save Captions and A3B Caption Folder."""
from __future__ import annotations

from a3b_core.errors import ConfigError
from a3b_core.services.caption_folder import EXISTING_POLICIES, PRESETS, caption_folder, summary

from . import comfy_bridge as bridge
from .caption_folder import FOLDER_ROOTS, folder_job, output_lists
from .captions import save_captions
from .comfy_bridge import io
from .model_handle import A3BModelHandle
from .wires import ModelWire

CATEGORY = "A3B"
IF_EXISTS = ["skip", "overwrite"]


class A3BSaveCaptions(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="A3BSaveCaptions",
            display_name="A3B Save Captions",
            category=CATEGORY,
            description="Writes one .txt caption file per image into ComfyUI's output folder (or a subfolder of "
                        "it), named like the image or numbered: the layout LoRA trainers read; optionally one more "
                        "file with every caption in order (e.g. a storyboard's shot list).",
            is_input_list=True,  # all captions of a run arrive together, so numbering and name checks see them all
            is_output_node=True,
            inputs=[
                io.String.Input("captions", force_input=True,
                                tooltip="Captions from A3B Generate (per-image mode gives one per image)."),
                io.String.Input("subfolder", default="a3b_captions",
                                tooltip="Folder inside ComfyUI's output folder for the .txt files; created if "
                                        "missing. Relative only: absolute paths and '..' are refused."),
                io.String.Input("names", multiline=True, default="",
                                tooltip="The images' file names, one per line in batch order: caption i is saved as "
                                        "<stem of line i>.txt (or connect A3B Video Encode's names). Leave empty "
                                        "to number the files instead."),
                io.String.Input("filename_prefix", default="caption",
                                tooltip="Used when names is empty: files are <prefix>_00001.txt, <prefix>_00002.txt, "
                                        "... A plain name: folders go into subfolder."),
                io.String.Input("trigger_word", default="",
                                tooltip="Optional LoRA trigger word written first in every caption, followed by "
                                        "', '."),
                io.Combo.Input("if_exists", options=IF_EXISTS, default="skip",
                               tooltip="skip: keep an existing caption file untouched (e.g. one you edited). "
                                       "overwrite: replace it."),
                # last, and optional: workflows saved before it existed keep their widget values in place (the UI
                # assigns them by position) and API graphs without it still validate
                io.String.Input("combined_file", default="", optional=True,
                                tooltip="Optional: the name of one more file in the same subfolder that gets every "
                                        "caption in order, one per line as '<name>: <caption>' (e.g. 'shot_list' "
                                        "for shot_list.txt). A plain name; if_exists applies to it too. Leave "
                                        "empty for none."),
            ],
        )

    @classmethod
    def execute(cls, captions: list[str], subfolder: list[str], names: list[str], filename_prefix: list[str],
                trigger_word: list[str], if_exists: list[str], combined_file: list[str] | None = None) -> io.NodeOutput:
        if if_exists[0] not in IF_EXISTS:  # ComfyUI 0.3.75 does not check V3 combo values itself
            raise ConfigError(f"if_exists is {if_exists[0]!r}; expected one of {IF_EXISTS}.")
        summary = save_captions(bridge.output_directory(), captions, subfolder[0], names[0], filename_prefix[0],
                                trigger_word[0], if_exists[0] == "overwrite", (combined_file or [""])[0])
        return io.NodeOutput(ui={"a3b_saved": [summary]})


class A3BCaptionFolder(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="A3BCaptionFolder",
            display_name="A3B Caption Folder",
            category=CATEGORY,
            description="Captions every image of a folder (a LoRA dataset) into one .txt per image, a batch at a "
                        "time, so thousands of images take no more memory than one batch. A caption file is written "
                        "only when complete: after Stop, run it again with the same settings to carry on.",
            is_output_node=True,
            inputs=[
                ModelWire.Input("model", tooltip="From A3B Model Loader."),
                io.Combo.Input("folder_root", options=FOLDER_ROOTS, default="input",
                               tooltip="Which ComfyUI folder holds the images: its input or its output folder."),
                io.String.Input("folder", default="",
                                tooltip="The images' folder inside folder_root, e.g. 'datasets/pixel_art' (empty: "
                                        "folder_root itself). Relative only: absolute paths and '..' are refused."),
                io.Boolean.Input("recursive", default=False,
                                 tooltip="Also caption the images in subfolders (linked folders are not entered)."),
                io.String.Input("output_subfolder", default="",
                                tooltip="Empty: each caption beside its image. Else a folder inside ComfyUI's output "
                                        "folder that gets the captions in the image folder's layout."),
                io.Combo.Input("preset", options=list(PRESETS), default="natural",
                               tooltip="natural: descriptive sentences (the model's own captioning request). tags: "
                                       "comma-separated tags, cleaned and without repeats."),
                io.String.Input("prompt", multiline=True, default="",
                                tooltip="The request sent with every image; empty: the preset's."),
                io.Combo.Input("existing", options=list(EXISTING_POLICIES), default="skip",
                               tooltip="An image that already has a caption file. skip: keep it (a rerun carries on "
                                       "where a stopped run ended). overwrite: replace it. append / prepend: add the "
                                       "new caption after / before what the file holds, once per run: a stopped run "
                                       "run again with the same settings carries on without adding twice."),
                io.String.Input("trigger_word", default="",
                                tooltip="Optional LoRA trigger word written first in every caption, followed by "
                                        "', '."),
                io.String.Input("prefix", default="", tooltip="Text before every caption."),
                io.String.Input("suffix", default="", tooltip="Text after every caption."),
                io.String.Input("template", default="{caption}",
                                tooltip="The caption's text: {caption} is the model's caption, {name} the image's "
                                        "file name without extension, {folder} the name of its folder."),
                io.String.Input("banned", multiline=True, default="",
                                tooltip="Words or phrases removed from every caption (one per line or "
                                        "comma-separated; whole words, any case)."),
                io.String.Input("required", multiline=True, default="",
                                tooltip="Words or phrases every caption should hold; captions without them are still "
                                        "written and listed in the summary."),
                io.Int.Input("max_length", default=0, min=0, max=100000,
                             tooltip="Most characters of the model's caption, cut after a whole word or tag "
                                     "(0: no limit)."),
                io.Int.Input("dry_run", default=0, min=0, max=10000,
                             tooltip="Above 0: caption only the first this many images and write nothing, to check "
                                     "the settings."),
                io.Int.Input("start", default=0, min=0, max=10**9,
                             tooltip="Index of the first image, in the folder's sorted order."),
                io.Int.Input("limit", default=0, min=0, max=10**9, tooltip="Most images to caption (0: all)."),
                io.Int.Input("batch_size", default=8, min=1, max=256,
                             tooltip="Images captioned together in one batch; the next batch's files are read "
                                     "while it runs."),
                io.Int.Input("size", default=384, min=64, max=2048, step=32,
                             tooltip="Side length in pixels each image is resized to (a multiple of 32)."),
                io.Int.Input("max_new_tokens", default=160, min=1, max=4096,
                             tooltip="Upper limit on each caption's length in tokens."),
                io.Float.Input("temperature", default=0.0, min=0.0, max=2.0, step=0.05,
                               tooltip="0 (default): the most likely words, the same captions on every run."),
                io.Int.Input("seed", default=0, min=0, max=2**63 - 1,
                             tooltip="Random seed for temperatures above 0."),
            ],
            outputs=[
                io.String.Output(display_name="image_path", is_output_list=True,
                                 tooltip="Each captioned image's path (a list), in the order of the captions."),
                io.String.Output(display_name="caption", is_output_list=True,
                                 tooltip="Each image's caption as in its file (a list): new ones, and kept ones."),
                io.String.Output(display_name="summary", tooltip="What the run did, and every image that needs "
                                                                 "attention, by name."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model: A3BModelHandle, folder_root: str, folder: str, recursive: bool, output_subfolder: str,
                preset: str, prompt: str, existing: str, trigger_word: str, prefix: str, suffix: str,
                template: str, banned: str, required: str, max_length: int, dry_run: int, start: int, limit: int,
                batch_size: int, size: int, max_new_tokens: int, temperature: float, seed: int) -> io.NodeOutput:
        roots = {"input": bridge.input_directory(), "output": bridge.output_directory()}
        job = folder_job(roots, folder_root, folder, output_subfolder, recursive=recursive, preset=preset,
                         prompt=prompt, existing=existing, trigger_word=trigger_word, prefix=prefix, suffix=suffix,
                         template=template, banned=banned, required=required, max_length=max_length,
                         dry_run=dry_run, start=start, limit=limit, batch_size=batch_size, size=size,
                         max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        bridge.raise_if_interrupted()
        node_id = cls.hidden.unique_id
        outcomes, stopped, progress = [], False, None
        try:
            for step in caption_folder(model.acquire(), job, should_stop=bridge.processing_interrupted):
                progress = progress or bridge.Progress(step.total)
                progress.set(step.done, step.total)
                outcomes += step.outcomes
                stopped = step.stopped
                bridge.send_text(node_id, step.line())
        finally:
            model.finished_run()
        bridge.raise_if_interrupted()  # stopped: the finished captions are kept, the node ends as "interrupted"
        report = summary(outcomes, stopped)
        bridge.send_text(node_id, report)
        paths, captions = output_lists(outcomes)
        return io.NodeOutput(paths, captions, report, ui={"a3b_saved": [report]})
