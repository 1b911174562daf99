"""Chat templates as the simulated clients render them for ``/v1/completions``.

A client of the legacy endpoint sends a whole conversation as one string, marked the
way its model family expects. The workload renders with one of these templates and the
simulated engine reads the turns back, as a real model reads its own markers. This is
the simulator's side of the wire, written from the templates themselves and kept apart
from the proxy's parser (``proxy.protocols.chat_templates``), which the tests check.
"""

from __future__ import annotations

import re

__all__ = ["TEMPLATES", "render", "unrender"]

# style -> (text before each turn by role, text after each turn, the open assistant turn)
_MARKS: dict[str, tuple[dict[str, str], str, str]] = {
    "chatml": (
        {r: f"<|im_start|>{r}\n" for r in ("system", "user", "assistant")},
        "<|im_end|>\n",
        "<|im_start|>assistant\n",
    ),
    "llama3": (
        {
            r: f"<|start_header_id|>{r}<|end_header_id|>\n\n"
            for r in ("system", "user", "assistant")
        },
        "<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    "gemma": (
        {
            "system": "<start_of_turn>user\n",
            "user": "<start_of_turn>user\n",
            "assistant": "<start_of_turn>model\n",
        },
        "<end_of_turn>\n",
        "<start_of_turn>model\n",
    ),  # fmt: skip
    "transcript": (
        {"system": "", "user": "User: ", "assistant": "Assistant: "},
        "\n\n",
        "Assistant:",
    ),
}
TEMPLATES = tuple(_MARKS)

_MARKER_RE = re.compile(
    r"<\|im_start\|>(?:system|user|assistant)\n|<\|im_end\|>\n?"
    r"|<\|start_header_id\|>(?:system|user|assistant)<\|end_header_id\|>\n\n|<\|eot_id\|>"
    r"|<start_of_turn>(?:user|model)\n|<end_of_turn>\n?"
    r"|^(?:User|Assistant): ?|^Assistant:$",
    re.M,
)


def render(messages: list[dict], style: str) -> str:
    """One prompt string of ``messages`` in ``style``, ending with the open assistant
    turn that asks the model to answer."""
    before, after, cue = _MARKS[style]
    return "".join(f"{before[m['role']]}{m['content']}{after}" for m in messages) + cue


def unrender(prompt: str) -> str | None:
    """The turn texts of a prompt :func:`render` made, joined by ``"\\n"`` (what a chat
    request with the same messages carries), or ``None`` for a prompt without markers."""
    if not _MARKER_RE.search(prompt):
        return None
    pieces = _MARKER_RE.split(prompt)
    return "\n".join(p.strip("\n") for p in pieces if p.strip())
