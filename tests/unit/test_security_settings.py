"""Security settings come only from the command line, the environment and settings.yaml: never from a model folder's
textgen.yaml, user_data/models_settings.yaml or an API request's load args."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from modules import models_settings, shared
from modules.errors import InvalidRequest
from modules.loaders.base import ModelMetadata
from modules.settings import SECURITY_KEYS, Settings, _base_type, load_settings


def test_the_list_holds_every_security_setting_and_no_tuning_knob() -> None:
    for name in (
        "trust_remote_code", "remote_url", "remote_api_key", "api_key", "admin_key", "model_dir", "lora_dir",
        "user_data_dir", "gradio_auth", "gradio_auth_path", "listen", "listen_host", "listen_port", "api_port",
        "enable_code_execution", "extensions", "api_cors_origins",
    ):  # fmt: skip
        assert name in SECURITY_KEYS, name
    paths = [n for n, f in Settings.model_fields.items() if _base_type(f.annotation)[0] is Path]
    assert paths and set(paths) <= SECURITY_KEYS  # every Path-typed setting, present and future
    for name in ("n_ctx", "n_gpu_layers", "threads", "parallel", "load_in_4bit", "cache_type", "loader"):
        assert name not in SECURITY_KEYS, name  # per-model settings keep working


def _model_folder(models: Path, yaml_text: str) -> Path:
    folder = models / "downloaded-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "textgen.yaml").write_text(yaml_text)
    return folder


def test_a_model_folder_cannot_turn_on_trust_remote_code(
    hub: object, models_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _model_folder(
        models_dir,
        "trust_remote_code: true\nremote_url: http://attacker.example\nremote_api_key: sk-stolen\n"
        "model_dir: /\nlisten: true\nextensions: [evil]\nn_ctx: 2048\n",
    )
    with caplog.at_level(logging.WARNING, logger="modules.models_settings"):
        resolved = models_settings.resolve(folder.name, folder, ModelMetadata(name=folder.name))
    options = resolved.options
    assert options["n_ctx"] == 2048 and resolved.sources["n_ctx"] == "textgen.yaml"  # the file was read
    assert options["trust_remote_code"] is False and "trust_remote_code" not in resolved.sources
    assert options["remote_url"] is None and options["remote_api_key"] is None
    assert options["model_dir"] == Path(shared.settings.model_dir) and options["listen"] is False
    assert options["extensions"] == []
    warned = caplog.text
    for key in ("trust_remote_code", "remote_url", "remote_api_key", "model_dir", "listen", "extensions"):
        assert f"textgen.yaml: {key} ignored" in warned, key
    assert "sk-stolen" not in warned  # a key's value is never logged


def test_models_settings_yaml_cannot_set_them_either(hub: object, user_data: Path, models_dir: Path) -> None:
    (user_data / "models_settings.yaml").write_text(
        "downloaded:\n  trust_remote_code: true\n  api_key: sk-x\n  enable_code_execution: true\n  n_batch: 64\n"
    )
    folder = _model_folder(models_dir, "")
    resolved = models_settings.resolve(folder.name, folder, ModelMetadata(name=folder.name))
    assert resolved.options["n_batch"] == 64
    assert resolved.options["trust_remote_code"] is False
    assert resolved.options["api_key"] is None and resolved.options["enable_code_execution"] is False


def test_the_command_line_still_sets_them(user_data: Path, models_dir: Path) -> None:
    shared.init(
        load_settings(
            ["--user-data-dir", str(user_data), "--model-dir", str(models_dir), "--trust-remote-code"], env={}
        )
    )
    try:
        folder = _model_folder(models_dir, "trust_remote_code: false\n")
        resolved = models_settings.resolve(folder.name, folder, ModelMetadata(name=folder.name))
        assert resolved.options["trust_remote_code"] is True and resolved.sources["trust_remote_code"] == "flag"
    finally:
        shared.init()


def test_a_request_naming_one_is_refused() -> None:
    models_settings.check_request_overrides({"n_ctx": 1024, "n-gpu-layers": 0})
    for key in ("trust_remote_code", "trust-remote-code", "remote_url", "admin_key", "lora_dir", "listen_port"):
        with pytest.raises(InvalidRequest) as info:
            models_settings.check_request_overrides({"n_ctx": 1024, key: True})
        assert info.value.param == f"args.{key}" and key in str(info.value)


def test_the_model_tab_never_puts_the_remote_key_into_a_visitors_page(hub: object, user_data: Path) -> None:
    import json

    import gradio as gr

    from modules import shared
    from modules.ui import model_tab

    shared.init(load_settings(["--user-data-dir", str(user_data), "--remote-api-key", "sk-remote-secret"], env={}))
    with gr.Blocks() as page:
        model_tab.build()
    config = json.dumps(page.get_config_file(), default=str)
    assert "sk-remote-secret" not in config
    assert "set on the server (hidden)" in config  # the field says a key is set
