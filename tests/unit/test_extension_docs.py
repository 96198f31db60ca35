"""docs/extensions.md carries the hook reference generated from the hookspecs, and every hookspec is documented."""

from __future__ import annotations

from pathlib import Path

from modules import extensions

DOC = (Path(__file__).resolve().parents[2] / "docs" / "extensions.md").read_text()


def test_reference_matches_the_hookspecs() -> None:
    section = DOC.split("<!-- hooks:begin -->\n", 1)[1].split("\n<!-- hooks:end -->", 1)[0]
    assert section == extensions.reference()


def test_every_hook_has_a_docstring_and_the_contract_names_them_all() -> None:
    required = {
        "setup", "ui", "custom_css", "custom_js", "state_modifier", "chat_input_modifier", "input_modifier",
        "bot_prefix_modifier", "output_modifier", "history_modifier", "custom_generate_chat_prompt",
        "custom_generate_reply", "tokenizer_modifier", "custom_tokenized_length", "logits_processor_modifier",
        "api_routes", "register_backends",
    }  # fmt: skip
    assert required == set(extensions.HOOK_NAMES)
    for name in extensions.HOOK_NAMES:
        assert (getattr(extensions.HookSpecs, name).__doc__ or "").strip(), name
