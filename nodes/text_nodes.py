"""A3B Image Encode, A3B Prompt and A3B Generate."""
from __future__ import annotations

from typing import Any

from a3b_core.errors import PromptError
from a3b_core.runtime.options import RESIZE_MODES

from . import comfy_bridge as bridge
from .comfy_bridge import io
from .generation import generate_answers, speed_line
from .image_batch import encode_image_batch
from .live_text import LiveText
from .model_handle import A3BModelHandle
from .prompt_spec import AUTO_THINKING, MODES, SINGLE, THINKING_MODES, PromptSpec, fitted_prompts
from .wires import ImagesWire, ModelWire, PromptWire

CATEGORY = "A3B"
_MAX_SEED = 2**63 - 1


class A3BImageEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="A3BImageEncode",
            display_name="A3B Image Encode",
            category=CATEGORY,
            description="Runs the model's vision tower once over a batch of images; the result can feed any number "
                        "of prompts without encoding again.",
            inputs=[
                ModelWire.Input("model", tooltip="From A3B Model Loader or A3B Remote Model."),
                io.Image.Input("image", tooltip="One image or a batch (e.g. from Load Image or Image Batch)."),
                io.Int.Input("size", default=384, min=64, max=2048, step=32,
                             tooltip="Side length in pixels the images are resized to (a multiple of 32). Larger "
                                     "sizes show more detail and cost more image tokens. Ignored by 'native'."),
                io.Combo.Input("resize", options=list(RESIZE_MODES), default="stretch",
                               tooltip="stretch: squash to size x size; letterbox: fit inside and pad; crop: fill "
                                       "and cut the overhang; native: keep the image's own size (within the "
                                       "model's pixel limits, rounded to 32)."),
                io.Boolean.Input("srgb", default=True,
                                 tooltip="Treat the pixels as sRGB, as ComfyUI images are. Turn off only for images "
                                         "already in linear light."),
            ],
            outputs=[ImagesWire.Output(display_name="images", tooltip="Encoded images for A3B Prompt.")],
        )

    @classmethod
    def execute(cls, model: A3BModelHandle, image: Any, size: int, resize: str, srgb: bool) -> io.NodeOutput:
        return io.NodeOutput(encode_image_batch(model.acquire(), image, size, resize, srgb))


class A3BPrompt(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="A3BPrompt",
            display_name="A3B Prompt",
            category=CATEGORY,
            description="Writes the request: a system message, the user text with [[IMG]] where each image goes "
                        "and [[VID]] where each video goes, and whether the model thinks first.",
            inputs=[
                io.String.Input("system", multiline=True, default="",
                                tooltip="Optional system message (role, style, output format). Cannot hold images."),
                io.String.Input("user", multiline=True, default="Describe [[IMG]] in detail.",
                                tooltip="The request. Write [[IMG]] where each image goes and [[VID]] where each "
                                        "video goes, one marker per item in their order (in per-image mode: one "
                                        "marker). Without markers the images and videos come first."),
                io.Combo.Input("thinking", options=list(THINKING_MODES), default=AUTO_THINKING,
                               tooltip="on: the model reasons before answering (slower; the reasoning comes out of "
                                       "Generate's 'reasoning' output). off: it answers directly. auto: the model's "
                                       "own default (off for the demo models, on for Qwen3.5/3.6 releases; a "
                                       "Qwen3-VL model thinks or not by its variant whatever this says)."),
                ImagesWire.Input("images", optional=True,
                                 tooltip="Images from A3B Image Encode, or clips from A3B Video Encode."),
                PromptWire.Input("previous", optional=True,
                                tooltip="The previous prompt of a conversation, to ask a follow-up question."),
                io.String.Input("previous_answer", optional=True, force_input=True,
                                tooltip="The answer Generate gave to 'previous'."),
            ],
            outputs=[PromptWire.Output(display_name="prompt", tooltip="For A3B Generate.")],
        )

    @classmethod
    def execute(cls, system: str, user: str, thinking: str, images: Any = None, previous: PromptSpec | None = None,
                previous_answer: str = "") -> io.NodeOutput:
        if thinking not in THINKING_MODES:
            raise PromptError(f"thinking is {thinking!r}; choose one of {', '.join(THINKING_MODES)}.")
        mode = THINKING_MODES[thinking]
        if previous is None:
            spec = PromptSpec(user=user, system=system, images=images, thinking=mode)
        else:
            spec = previous.followed_by(user, system, images, mode, previous_answer)
        return io.NodeOutput(spec)


class A3BGenerate(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="A3BGenerate",
            display_name="A3B Generate",
            category=CATEGORY,
            description="Generates the answer, streaming it onto the node; Stop ends it within one token. The "
                        "defaults are Qwen's recommended settings for answers without thinking.",
            inputs=[
                ModelWire.Input("model", tooltip="From A3B Model Loader or A3B Remote Model."),
                PromptWire.Input("prompt", tooltip="From A3B Prompt."),
                io.Combo.Input("mode", options=MODES, default=SINGLE,
                               tooltip="single: one answer for the whole prompt. per image: the prompt is asked "
                                       "once for each image or clip (decoded together as a batch), one answer "
                                       "each."),
                io.Int.Input("max_new_tokens", default=512, min=1, max=32768,
                             tooltip="Upper limit on the answer's length in tokens (reasoning included)."),
                io.Float.Input("temperature", default=0.7, min=0.0, max=2.0, step=0.05,
                               tooltip="Randomness. 0 always picks the most likely token. Qwen recommends 0.7 "
                                       "without thinking, 1.0 with thinking."),
                io.Float.Input("top_p", default=0.8, min=0.01, max=1.0, step=0.01,
                               tooltip="Sample only from the most likely tokens whose probabilities add up to this. "
                                       "Qwen: 0.8 without thinking, 0.95 with thinking."),
                io.Int.Input("top_k", default=20, min=0, max=1000,
                             tooltip="Sample only from this many most likely tokens (0 = no limit). Qwen: 20."),
                io.Float.Input("min_p", default=0.0, min=0.0, max=1.0, step=0.01,
                               tooltip="Drop tokens less likely than this fraction of the top token. Qwen: 0."),
                io.Float.Input("presence_penalty", default=1.5, min=0.0, max=2.0, step=0.05,
                               tooltip="Discourages repeating tokens already used; against endless repetition. "
                                       "Qwen: 1.5."),
                io.Float.Input("repetition_penalty", default=1.0, min=1.0, max=2.0, step=0.01,
                               tooltip="Divides the scores of tokens already used (1.0 = off). Qwen: 1.0."),
                io.Int.Input("seed", default=0, min=0, max=_MAX_SEED, control_after_generate=True,
                             tooltip="Random seed; the same seed and inputs give the same answer."),
                # last, and optional: workflows saved before it existed keep their widget values in place (the UI
                # assigns them by position) and API graphs without it still validate
                io.Int.Input("thinking_budget", default=0, min=0, max=32768, optional=True,
                             tooltip="With thinking on: the most tokens the model may reason for; then its "
                                     "reasoning is closed and it answers. Counts towards max_new_tokens. "
                                     "0 = no limit. Not available with A3B Remote Model (keep 0)."),
            ],
            outputs=[
                io.String.Output(display_name="answer", is_output_list=True,
                                 tooltip="The answer; in per-image mode one answer per image or clip (a list)."),
                io.String.Output(display_name="reasoning", is_output_list=True,
                                 tooltip="The thinking before each answer (empty with thinking off)."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model: A3BModelHandle, prompt: PromptSpec, mode: str, max_new_tokens: int, temperature: float,
                top_p: float, top_k: int, min_p: float, presence_penalty: float, repetition_penalty: float,
                seed: int, thinking_budget: int = 0) -> io.NodeOutput:
        bridge.raise_if_interrupted()
        engine = model.acquire()
        prompts, fitted = fitted_prompts(engine, prompt, mode, max_new_tokens)
        node_id = cls.hidden.unique_id
        live = LiveText(len(prompts), lambda text: bridge.send_text(node_id, text))
        progress = bridge.Progress(max_new_tokens * len(prompts))

        def on_text(index: int, text_so_far: str) -> None:
            live.update(index, text_so_far)
            progress.set(live.updates)

        sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                        min_p=min_p, presence_penalty=presence_penalty, repetition_penalty=repetition_penalty,
                        seed=seed, should_stop=bridge.processing_interrupted)
        try:
            results = generate_answers(engine, prompts, thinking_budget=thinking_budget, on_text=on_text, **sampling)
        finally:
            model.finished_run()
        bridge.raise_if_interrupted()  # stopped early: end as ComfyUI's "interrupted", not with a partial answer
        answers = [result.text for result in results]
        live.finish(answers)
        progress.set(max_new_tokens * len(prompts))
        speed = " · ".join(part for part in (fitted, speed_line([result.stats for result in results])) if part)
        return io.NodeOutput(answers, [result.reasoning for result in results],
                             ui={"a3b_answer": answers, "a3b_speed": [speed]})
