"""Conversations rendered by chat templates: the proxy reads their turns, so the
model's earlier answers in a completions prompt count as model text."""

from __future__ import annotations

import orjson
import pytest

from proxy.protocols import generate, openai
from proxy.protocols.chat_templates import conversation_texts, split_turns
from proxy.sim.templates import TEMPLATES, render, unrender
from proxy.sim.workload import Workload

SYSTEM, ASKED, ANSWERED, FOLLOW_UP = "You are X.", "Hi there", "Hello! How can I help?", "Plan Q3"

# Each family's rendering of system, user, assistant, user and the open assistant turn,
# written out from the families' published chat templates.
RENDERED = {
    "chatml": (
        "<|im_start|>system\nYou are X.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
        "<|im_start|>user\nPlan Q3<|im_end|>\n<|im_start|>assistant\n"
    ),
    "llama3": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are X.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello! How can I help?<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nPlan Q3<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "gemma": (
        "<bos><start_of_turn>user\nYou are X.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello! How can I help?<end_of_turn>\n"
        "<start_of_turn>user\nPlan Q3<end_of_turn>\n<start_of_turn>model\n"
    ),
    "phi3": (
        "<|system|>\nYou are X.<|end|>\n<|user|>\nHi there<|end|>\n"
        "<|assistant|>\nHello! How can I help?<|end|>\n<|user|>\nPlan Q3<|end|>\n<|assistant|>\n"
    ),
    "llama2": (
        "<s>[INST] <<SYS>>\nYou are X.\n<</SYS>>\n\nHi there [/INST] Hello! How can I help? "
        "</s><s>[INST] Plan Q3 [/INST]"
    ),
    "deepseek": (
        "<｜begin▁of▁sentence｜>You are X.<｜User｜>Hi there<｜Assistant｜>Hello! How can I "
        "help?<｜end▁of▁sentence｜><｜User｜>Plan Q3<｜Assistant｜>"
    ),
    "alpaca": (
        "You are X.\n\n### Instruction:\nHi there\n\n### Response:\nHello! How can I help?\n\n"
        "### Instruction:\nPlan Q3\n\n### Response:\n"
    ),
    "transcript": "You are X.\n\nHuman: Hi there\n\nAssistant: Hello! How can I help?\n\n"
    "Human: Plan Q3\n\nAssistant:",
}


@pytest.mark.parametrize("style", sorted(RENDERED))
def test_each_family_yields_its_turns_without_markers(style):
    turns = split_turns(RENDERED[style])
    assert turns is not None
    texts = [t.text for t in turns]
    assert ANSWERED in texts and texts[-1] == FOLLOW_UP, texts
    assert [t.text for t in turns if t.by_model] == [ANSWERED]
    assert all("<" not in t and "[" not in t and "###" not in t for t in texts), texts
    assert " ".join(texts).replace("\n", " ").split() == (
        f"{SYSTEM} {ASKED} {ANSWERED} {FOLLOW_UP}".split()
    )


@pytest.mark.parametrize(
    "prompt",
    [
        "Summarise this: the User: field of the form is optional.",
        "User: what is a tuple?",  # one user line, no model turn: a plain prompt
        "Translate to French: good morning",
        "",
    ],
)
def test_prompts_without_a_conversation_are_one_turn(prompt):
    assert split_turns(prompt) is None
    assert conversation_texts(prompt) == (prompt, "", False)


def test_completions_and_generate_requests_carry_the_model_turns_as_model_text():
    prompt = RENDERED["chatml"]
    for parsed in (
        openai.parse_request("completions", orjson.dumps({"prompt": prompt})),
        generate.parse_request("generate", orjson.dumps({"text": prompt})),
    ):
        assert parsed.model_text == ANSWERED
        assert parsed.prompt == f"{SYSTEM}\n{ASKED}\n{ANSWERED}\n{FOLLOW_UP}"


def test_a_completions_prompt_reads_like_the_chat_request_of_the_same_messages():
    """What the simulated clients render, the proxy reads back to the chat request's
    text; the simulator reads it back too (its answers match the chat ones)."""
    seen = set()
    for request in Workload(tenants=24, seed=3).requests(3000):
        if request.endpoint != "completions":
            continue
        seen.add(request.template)
        rendered = request.body()["prompt"]
        parsed = openai.parse_request("completions", orjson.dumps({"prompt": rendered}))
        assert parsed.prompt == request.prompt_text()
        model = [m["content"] for m in request.messages if m["role"] == "assistant"]
        assert parsed.model_text == "\n".join(model)
        assert unrender(rendered) == request.prompt_text()
    assert seen == set(TEMPLATES)


@pytest.mark.parametrize("style", TEMPLATES)
def test_sim_render_ends_with_the_open_assistant_turn(style):
    messages = [{"role": "user", "content": ASKED}]
    rendered = render(messages, style)
    assert unrender(rendered) == ASKED
    assert [t.role for t in split_turns(rendered) or ()] in (["user"], ["", "user"])
