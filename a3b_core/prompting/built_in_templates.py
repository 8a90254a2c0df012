"""The built-in chat templates of the model families, by the family's name (chat_format.py renders them): used when
the model folder has no chat template of its own (or the loader's chat_template is "built-in"), and the oracle the
folder templates are tested against.

Qwen3.5/3.6: texts trimmed, earlier answers without reasoning, and a generation prompt that opens a think block, or
writes an empty one when thinking is off; the models think or not as each prompt asks.
Qwen3-VL: the Instruct models never think (texts as given, earlier answers as given, a bare generation prompt); the
Thinking models always think (their generation prompt opens a think block, and an earlier answer is re-rendered
without its reasoning). Which variant a folder holds, its chat template tells.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ..errors import ChatTemplateError
from .chat_format import ChatFormat, answer_after_thinking, render
from .conversation import Prompt
from .folder_template import template_source
from .tokenizer import Tokenizer

QWEN3_5 = ChatFormat(
    trimmed=True,
    answer=answer_after_thinking,  # the answer arrives trimmed
    assistant_opening=lambda thinking: "<think>\n" if thinking else "<think>\n\n</think>\n\n",
)
QWEN3_VL_INSTRUCT = ChatFormat(trimmed=False, answer=lambda answer, reasoning: answer,
                               assistant_opening=lambda thinking: "")
QWEN3_VL_THINKING = ChatFormat(trimmed=False, answer=answer_after_thinking,
                               assistant_opening=lambda thinking: "<think>\n")

qwen3_5_prompt = partial(render, QWEN3_5)


def qwen3_vl_prompt(tokenizer: Tokenizer, user: str, *, thinking: bool = False, **options) -> Prompt:
    """The Thinking template when `thinking`, else the Instruct one (the engine passes the variant's choice, see
    qwen3_vl_always_thinks); the other options as chat_format's render."""
    return render(QWEN3_VL_THINKING if thinking else QWEN3_VL_INSTRUCT, tokenizer, user, thinking=thinking, **options)


def thinks_as_asked(folder: Path, carried: str | None = None) -> None:
    """Qwen3.5/3.6 think or not as each prompt asks."""
    return None


def qwen3_vl_always_thinks(folder: Path, carried: str | None = None) -> bool:
    """Whether the folder holds a Qwen3-VL Thinking model: its chat template opens a think block (the Instruct
    template never mentions one). The template is the folder's files' or, where it has none, the one the model file
    carries (`carried`: a GGUF's tokenizer.chat_template). Without a readable template, the folder's or file's name
    decides (the releases end in -Thinking or -Instruct)."""
    try:
        found = template_source(folder)
    except ChatTemplateError:
        found = None  # an unreadable template says nothing about the variant (the loader reports it if it uses it)
    source = found[0] if found is not None else carried
    if source is not None:
        return "<think>" in source
    return "thinking" in folder.name.lower()


@dataclass(frozen=True)
class BuiltInTemplate:
    """A family's built-in chat template and the thinking mode that goes with it."""
    build_prompt: Callable[..., Prompt]  # (tokenizer, user, *, system, image_token_counts, thinking, history, ...)
    # a model folder (and the template its model file carries, if any) -> whether its model always thinks (True),
    # never does (False), or as each prompt asks (None)
    fixed_thinking: Callable[[Path, str | None], bool | None]
    default_thinking: bool  # whether the template thinks when a prompt does not say (for models that think as asked)


BUILT_IN_TEMPLATES: Mapping[str, BuiltInTemplate] = {  # by Family.name
    "Qwen3.5/3.6": BuiltInTemplate(qwen3_5_prompt, fixed_thinking=thinks_as_asked, default_thinking=True),
    "Qwen3-VL": BuiltInTemplate(qwen3_vl_prompt, fixed_thinking=qwen3_vl_always_thinks, default_thinking=False),
}
