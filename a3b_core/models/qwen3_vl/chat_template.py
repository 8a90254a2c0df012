"""The Qwen3-VL chat templates (models/chat.py renders them). The Instruct models never think: texts as given,
earlier answers as given, and a bare generation prompt. The Thinking models always think: their generation prompt
opens a think block, and an earlier answer is re-rendered without its reasoning. Which variant a folder holds, its
chat template tells."""
from __future__ import annotations

import json
from pathlib import Path

from ...config import inside_folder
from ...prompt import Prompt
from ...tokenizer import Tokenizer
from ..chat import ChatFormat, answer_after_thinking, render

INSTRUCT = ChatFormat(trimmed=False, answer=lambda turn: turn.assistant, assistant_opening=lambda thinking: "")
THINKING = ChatFormat(trimmed=False, answer=lambda turn: answer_after_thinking(turn.assistant, turn.reasoning),
                      assistant_opening=lambda thinking: "<think>\n")
# Where a release keeps its chat template: the file itself, or a JSON object's "chat_template" field
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


def build_prompt(tokenizer: Tokenizer, user: str, *, thinking: bool = False, **options) -> Prompt:
    """The Thinking template when `thinking`, else the Instruct one (the engine passes the variant's choice, see
    always_thinks); the other options as models/chat.py's render."""
    return render(THINKING if thinking else INSTRUCT, tokenizer, user, thinking=thinking, **options)


def always_thinks(folder: Path) -> bool:
    """Whether the folder holds a Thinking model: its chat template opens a think block (the Instruct template never
    mentions one). Without a template file, the folder's name decides (the releases end in -Thinking or
    -Instruct)."""
    for name in TEMPLATE_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            text = inside_folder(folder, path).read_text(encoding="utf-8")
            template = text if name.endswith(".jinja") else json.loads(text).get("chat_template")
        except (OSError, ValueError, AttributeError, RecursionError):
            continue  # an unreadable file says nothing about the variant
        if isinstance(template, str):
            return "<think>" in template
    return "thinking" in folder.name.lower()
