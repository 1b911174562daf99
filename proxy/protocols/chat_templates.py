"""Conversations rendered into one prompt string by a chat template.

Clients of ``/v1/completions`` and of the native ``/generate`` endpoints send a whole
conversation as text, its turns marked by the model family's template. The earlier
assistant turns in it are the model's own words: the detector must judge them as a
model's output (boilerplate that every tenant's answers share), not as the user's
private text, or the first answers of other tenants that reuse the same phrasing
would look like leaks of this prompt.

:func:`split_turns` recognises the templates that serving engines ship (the
``chat_template`` of the Hugging Face ``tokenizer_config.json`` of each family) and
the plain transcript forms; anything else is a prompt of one unmarked turn.

==============  ========================================================================
style           markers
==============  ========================================================================
ChatML          ``<|im_start|>ROLE\\n ... <|im_end|>`` (Qwen, Yi, Hermes, many fine-tunes)
Llama 3         ``<|start_header_id|>ROLE<|end_header_id|>\\n\\n ... <|eot_id|>``
Gemma           ``<start_of_turn>user|model\\n ... <end_of_turn>``
Phi-3, Zephyr   ``<|system|>``, ``<|user|>``, ``<|assistant|>`` ... ``<|end|>`` or ``</s>``
DeepSeek        ``<｜User｜>`` ... ``<｜Assistant｜>`` ... ``<｜end▁of▁sentence｜>``
Llama 2/Mistral ``[INST] user [/INST] answer </s>``
Alpaca          ``### Instruction:`` / ``### Input:`` / ``### Response:`` headings
transcript      lines opening with ``User:``/``Human:`` and ``Assistant:``/``AI:``
==============  ========================================================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Turn", "conversation_texts", "split_turns"]

ASSISTANT_ROLES = frozenset({"assistant", "model", "gpt", "bot", "ai"})


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn of a rendered conversation; ``role`` is lower case, ``""`` for text
    before the first marker."""

    role: str
    text: str

    @property
    def by_model(self) -> bool:
        return self.role in ASSISTANT_ROLES


@dataclass(frozen=True, slots=True)
class _Style:
    name: str
    header: re.Pattern[str]  # group 1: the role (or the marker that implies it)
    noise: re.Pattern[str] | None  # end-of-turn and begin-of-text tokens, removed
    needs_model_turn: bool = False  # marker words that ordinary prose also uses


_STYLES = (
    _Style(
        "chatml",
        re.compile(r"<\|im_start\|>[ \t]*([A-Za-z_]+)[^\n]*\n?"),
        re.compile(r"<\|im_end\|>|<\|endoftext\|>"),
    ),
    _Style(
        "llama3",
        re.compile(r"<\|start_header_id\|>\s*([A-Za-z_]+)\s*<\|end_header_id\|>\n*"),
        re.compile(r"<\|eot_id\|>|<\|begin_of_text\|>|<\|end_of_text\|>"),
    ),
    _Style(
        "gemma",
        re.compile(r"<start_of_turn>[ \t]*([A-Za-z_]+)[^\n]*\n?"),
        re.compile(r"<end_of_turn>|<bos>|<eos>"),
    ),
    _Style(
        "phi",
        re.compile(r"<\|(system|user|assistant)\|>\n?"),
        re.compile(r"<\|end\|>|<\|endoftext\|>|</s>|<s>"),
    ),
    _Style(
        "deepseek",
        re.compile(r"<｜(User|Assistant)｜>"),
        re.compile(r"<｜(?:end|begin)▁of▁sentence｜>"),
    ),
    _Style(
        "llama2",
        re.compile(r"(\[INST\]|\[/INST\])"),
        re.compile(r"</?s>|<<SYS>>\n?|\n?<</SYS>>\n*"),
    ),
    _Style(
        "alpaca",
        re.compile(r"(?m)^###[ \t]*(Instruction|Input|Response)[ \t]*:?[ \t]*\n?"),
        None,
        needs_model_turn=True,
    ),
    _Style(
        "transcript",
        re.compile(r"(?mi)^[ \t]*(Human|User|Assistant|AI|System)[ \t]*:[ \t]*"),
        None,
        needs_model_turn=True,
    ),
)

_ROLE_OF_MARKER = {
    "[inst]": "user",
    "[/inst]": "assistant",
    "instruction": "user",
    "input": "user",
    "response": "assistant",
    "human": "user",
}


def split_turns(prompt: str) -> list[Turn] | None:
    """The turns of ``prompt`` if a known chat template rendered it, else ``None``.

    Edge cases: the first style whose markers occur wins (templates are not mixed);
    text before the first marker is a turn with role ``""``; empty turns (the open
    assistant header that ends a prompt awaiting an answer) are dropped. The plain
    Alpaca and transcript forms count only with a model marker and a user marker among
    them (the model's may be the open one at the end), since words such as "User:"
    also open ordinary lines.
    """
    for style in _STYLES:
        turns = _split(prompt, style)
        if turns is None:
            continue
        if style.needs_model_turn and not (
            any(t.by_model for t in turns) and any(t.role and not t.by_model for t in turns)
        ):
            continue
        return [t for t in turns if t.text]
    return None


def conversation_texts(prompt: str) -> tuple[str, str, bool]:
    """``(text, model_text, turns_known)`` of a prompt that may be a rendered
    conversation: the turns' texts joined by ``"\\n"`` (what a chat request of the same
    turns yields), the model's turns among them, and True; ``(prompt, "", False)`` when
    no template is recognised."""
    turns = split_turns(prompt)
    if turns is None:
        return prompt, "", False
    text = "\n".join(t.text for t in turns)
    return text, "\n".join(t.text for t in turns if t.by_model), True


def _split(prompt: str, style: _Style) -> list[Turn] | None:
    marks = list(style.header.finditer(prompt))
    if not marks:
        return None
    turns: list[Turn] = []
    bounds: list[tuple[str | None, int, int]] = [(None, 0, marks[0].start())]
    bounds += [
        (m.group(1).lower(), m.end(), nxt.start() if nxt is not None else len(prompt))
        for m, nxt in zip(marks, [*marks[1:], None], strict=True)
    ]
    for role, start, end in bounds:
        text = prompt[start:end]
        if style.noise is not None:
            text = style.noise.sub("\n", text)
        if role is not None or text.strip():
            turns.append(Turn(_ROLE_OF_MARKER.get(role, role) if role else "", text.strip()))
    return turns
