"""A3B Save Captions."""
from __future__ import annotations

from a3b_core.errors import ConfigError

from . import comfy_bridge as bridge
from .captions import save_captions
from .comfy_bridge import io

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
                        "it), named like the image or numbered: the layout LoRA trainers read.",
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
                                        "<stem of line i>.txt. Leave empty to number the files instead."),
                io.String.Input("filename_prefix", default="caption",
                                tooltip="Used when names is empty: files are <prefix>_00001.txt, <prefix>_00002.txt, "
                                        "... A plain name: folders go into subfolder."),
                io.String.Input("trigger_word", default="",
                                tooltip="Optional LoRA trigger word written first in every caption, followed by "
                                        "', '."),
                io.Combo.Input("if_exists", options=IF_EXISTS, default="skip",
                               tooltip="skip: keep an existing caption file untouched (e.g. one you edited). "
                                       "overwrite: replace it."),
            ],
        )

    @classmethod
    def execute(cls, captions: list[str], subfolder: list[str], names: list[str], filename_prefix: list[str],
                trigger_word: list[str], if_exists: list[str]) -> io.NodeOutput:
        if if_exists[0] not in IF_EXISTS:  # ComfyUI 0.3.75 does not check V3 combo values itself
            raise ConfigError(f"if_exists is {if_exists[0]!r}; expected one of {IF_EXISTS}.")
        summary = save_captions(bridge.output_directory(), captions, subfolder[0], names[0], filename_prefix[0],
                                trigger_word[0], if_exists[0] == "overwrite")
        return io.NodeOutput(ui={"a3b_saved": [summary]})
