"""Chat templates: the model's own (sandboxed), the fallback, and user instruction templates."""

from __future__ import annotations

from pathlib import Path

import pytest

from modules.chat import templates
from modules.errors import InvalidRequest
from modules.lifecycle.gguf import read_metadata

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Capital of France?"},
]


def test_renders_the_default_models_own_template() -> None:
    from tests.conftest import default_model_path

    meta = read_metadata(default_model_path())
    assert meta.chat_template and "im_start" in meta.chat_template
    text = templates.render(meta.chat_template, MESSAGES, bos_token=meta.bos_token, eos_token=meta.eos_token)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_fallback_template_when_the_model_has_none() -> None:
    text = templates.render(None, MESSAGES[1:2])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert templates.render(None, MESSAGES[1:2], add_generation_prompt=False).endswith("<|im_end|>\n")


def test_template_helpers_raise_exception_and_tojson() -> None:
    source = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}{{ tools | tojson }}"
    with pytest.raises(InvalidRequest, match="user first"):
        templates.render(source, MESSAGES)
    assert templates.render(source, MESSAGES[1:], tools=[{"name": "é"}]) == '[{"name": "é"}]'


def test_sandbox_blocks_python_internals() -> None:
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(InvalidRequest):
        templates.render(evil, MESSAGES)


def test_syntax_error_is_a_clear_error() -> None:
    with pytest.raises(InvalidRequest, match="syntax error"):
        templates.render("{% for %}", MESSAGES)


def test_instruction_templates_from_user_data(hub: object, user_data: Path) -> None:
    assert {"ChatML", "Alpaca", "Llama-3", "Mistral"} <= set(templates.list_instruction_templates())
    alpaca = templates.load_instruction_template("Alpaca")
    text = templates.render(alpaca, MESSAGES[1:2])
    assert "### Instruction:\nHi" in text and text.endswith("### Response:\n")
    (user_data / "instruction-templates" / "Mine.yaml").write_text(
        "instruction_template: '{{ messages[-1].content }}!'\n"
    )
    assert templates.render(templates.load_instruction_template("Mine"), MESSAGES) == "Capital of France?!"
    with pytest.raises(InvalidRequest):
        templates.load_instruction_template("../presets/Min-P")
    with pytest.raises(InvalidRequest, match="does not exist"):
        templates.load_instruction_template("Nope")
