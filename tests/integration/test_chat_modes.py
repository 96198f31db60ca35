"""Prompt building in every mode, truncation, and the chat actions, on the real default model."""

from __future__ import annotations

from pathlib import Path

import pytest

from modules import models
from modules.chat import engine
from modules.chat.prompt import ChatOptions, build_chat_prompt, build_impersonate_prompt
from modules.errors import InvalidRequest
from modules.generation.params import GenerationParams
from tests.conftest import DEFAULT_MODEL

HISTORY = [
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi there."},
    {"role": "user", "content": "Name a colour."},
]
GREEDY = GenerationParams(temperature=0, max_new_tokens=16)


def test_instruct_mode_uses_the_model_template(with_default_model: Path) -> None:
    backend = models.load_model(DEFAULT_MODEL)
    chat = build_chat_prompt(backend, HISTORY, ChatOptions(system="Be brief."), 32)
    assert chat.prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>")
    assert chat.prompt.endswith("<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n")
    alpaca = build_chat_prompt(backend, HISTORY, ChatOptions(instruction_template="Alpaca"), 32)
    assert "### Instruction:\nName a colour." in alpaca.prompt and alpaca.prompt.endswith("### Response:\n")
    started = build_chat_prompt(backend, HISTORY, ChatOptions(start_with="Sure,"), 32)
    assert started.prompt.endswith("assistant\nSure,") and started.reply_prefix == "Sure,"


def test_chat_and_chat_instruct_modes(with_default_model: Path) -> None:
    backend = models.load_model(DEFAULT_MODEL)
    chat = build_chat_prompt(
        backend,
        HISTORY,
        ChatOptions(mode="chat", character="Assistant", user_name="Ann", user_bio="Ann likes sailing."),
        32,
    )
    assert chat.prompt.startswith("The following is a conversation with an AI")
    assert "Ann likes sailing." in chat.prompt
    assert chat.prompt.endswith("Ann: Hello!\nAI: Hi there.\nAnn: Name a colour.\nAI:")
    assert chat.stop == ["\nAnn:"]
    wrapped = build_chat_prompt(backend, HISTORY, ChatOptions(mode="chat-instruct", character="Assistant"), 32)
    assert wrapped.prompt.startswith("<|im_start|>")
    assert 'Write a single reply for the character "AI"' in wrapped.prompt and wrapped.prompt.endswith("assistant\nAI:")
    with pytest.raises(InvalidRequest):
        build_chat_prompt(backend, HISTORY, ChatOptions(mode="telepathy"), 32)


def test_truncation_keeps_system_context_and_newest(with_default_model: Path) -> None:
    backend = models.load_model(DEFAULT_MODEL, {"n_ctx": 256})
    long = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"Message number {i}: " + "words " * 20}
        for i in range(40)
    ]
    long.append({"role": "user", "content": "The newest question?"})
    chat = build_chat_prompt(backend, long, ChatOptions(system="SYSTEM RULES"), 64)
    assert "SYSTEM RULES" in chat.prompt and "The newest question?" in chat.prompt
    assert "Message number 0:" not in chat.prompt and 1 < chat.kept < len(long)
    assert len(backend.encode(chat.prompt)) <= 256 - 64
    persona = build_chat_prompt(backend, long, ChatOptions(mode="chat", character="Assistant"), 64)
    assert persona.prompt.startswith("The following is a conversation")


def test_impersonate_prompts(with_default_model: Path) -> None:
    backend = models.load_model(DEFAULT_MODEL)
    prompt, stops = build_impersonate_prompt(backend, HISTORY[:2], ChatOptions(mode="chat", character="Assistant"), 32)
    assert prompt.endswith("AI: Hi there.\nYou:") and "\nAI:" in stops
    prompt, _ = build_impersonate_prompt(backend, HISTORY[:2], ChatOptions(system="S"), 32)
    assert prompt.endswith("<|im_start|>assistant\nHi there.<|im_end|>\n<|im_start|>user\n")
    drafts = list(engine.impersonate(HISTORY[:2], GREEDY, options=ChatOptions(mode="chat", character="Assistant")))
    assert drafts and drafts[-1].strip()


def test_regenerate_keeps_versions_and_they_can_be_browsed(with_default_model: Path) -> None:
    models.load_model(DEFAULT_MODEL)
    first = list(engine.send([], "Tell me a short fact.", GREEDY.replace(temperature=1.0, seed=1)))[-1].history
    second = list(engine.regenerate(first, GREEDY.replace(temperature=1.0, seed=2)))[-1].history
    reply = second[-1]
    assert reply["versions"][0] == first[-1]["content"] and reply["version"] == 1
    assert reply["content"] == reply["versions"][1] != reply["versions"][0]
    third = list(engine.regenerate(second, GREEDY.replace(temperature=1.0, seed=3)))[-1].history
    assert len(third[-1]["versions"]) == 3
    back = engine.set_version(third, len(third) - 1, -1)
    assert back[-1]["content"] == third[-1]["versions"][1] and back[-1]["version"] == 1
    assert engine.set_version(back, len(back) - 1, +1)[-1]["content"] == third[-1]["versions"][2]


def test_edit_remove_send_as_assistant_continue(with_default_model: Path) -> None:
    models.load_model(DEFAULT_MODEL)
    chat = list(engine.send([], "Count: one, two,", GREEDY))[-1].history
    edited = engine.edit_message(chat, 1, "three, four,")
    assert edited[1]["content"] == "three, four," and chat[1]["content"] != "three, four,"
    continued = list(engine.continue_reply(edited, GREEDY))[-1].history
    assert continued[-1]["content"].startswith("three, four,") and len(continued[-1]["content"]) > len("three, four,")
    assert len(continued) == 2
    mine = engine.send_as_assistant(continued, "I am the assistant now.")
    assert mine[-1] == {"role": "assistant", "content": "I am the assistant now."}
    removed, text = engine.remove_last(mine)
    assert removed == [] and text == "Count: one, two,"
    with pytest.raises(InvalidRequest):
        list(engine.regenerate([], GREEDY))
