"""The Qwen3-VL chat templates (models/chat.py renders them). The Instruct models never think: texts as given,
earlier answers as given, and a bare generation prompt. The Thinking models always think: their generation prompt
opens a think block, and an earlier answer is re-rendered without its reasoning. Which variant a folder holds, its
chat template tells."""
from __future__ import annotations

from pathlib import Path

from ...errors import ChatTemplateError
from ...prompting.conversation import Prompt
from ...prompting.folder_template import template_source
from ...prompting.tokenizer import Tokenizer
from ..chat import ChatFormat, answer_after_thinking, render

INSTRUCT = ChatFormat(trimmed=False, answer=lambda answer, reasoning: answer, assistant_opening=lambda thinking: "")
THINKING = ChatFormat(trimmed=False, answer=answer_after_thinking, assistant_opening=lambda thinking: "<think>\n")


def build_prompt(tokenizer: Tokenizer, user: str, *, thinking: bool = False, **options) -> Prompt:
    """The Thinking template when `thinking`, else the Instruct one (the engine passes the variant's choice, see
    always_thinks); the other options as models/chat.py's render."""
    return render(THINKING if thinking else INSTRUCT, tokenizer, user, thinking=thinking, **options)


def always_thinks(folder: Path) -> bool:
    """Whether the folder holds a Thinking model: its chat template opens a think block (the Instruct template never
    mentions one). Without a readable template, the folder's name decides (the releases end in -Thinking or
    -Instruct)."""
    try:
        found = template_source(folder)
    except ChatTemplateError:
        found = None  # an unreadable template says nothing about the variant (the loader reports it if it uses it)
    if found is not None:
        return "<think>" in found[0]
    return "thinking" in folder.name.lower()
