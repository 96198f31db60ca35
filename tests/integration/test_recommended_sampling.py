"""The model's recommended sampling: read from GGUF and HF metadata and models_settings.yaml, used by the chat page
and by API requests that leave the fields out; the user's preset and the request's own values win."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from extensions.openai import core
from extensions.openai.protocol import ChatCompletionRequest
from modules import models, shared
from modules.lifecycle.gguf import read_metadata
from modules.models import _generation_config_sampling
from modules.ui import parameters_tab
from tests.conftest import DEFAULT_MODEL


def test_generation_config_json(tmp_path: Path) -> None:
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "eos_token_id": 2}))
    assert _generation_config_sampling(path) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    path.write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert _generation_config_sampling(path) == {"temperature": 0.0}  # transformers generates greedily then
    path.write_text(json.dumps({"bos_token_id": 1}))
    assert _generation_config_sampling(path) == {}
    assert _generation_config_sampling(tmp_path / "missing.json") == {}


def test_gguf_general_sampling_keys(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.6)
    writer.add_uint32("general.sampling.top_k", 20)
    writer.add_float32("general.sampling.penalty_repeat", 1.1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    sampling = read_metadata(path).sampling
    assert sampling["top_k"] == 20 and type(sampling["top_k"]) is int and sampling["temperature"] == pytest.approx(0.6)
    assert sampling["repetition_penalty"] == pytest.approx(1.1)


def test_models_settings_sampling_reaches_the_page_and_the_api(
    with_default_model: Path, user_data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (user_data / "models_settings.yaml").write_text(
        "'smollm2':\n  sampling: {temperature: 0.3, top_k: 5, top_p: 7, bogus: 1}\n"
    )
    with caplog.at_level(logging.WARNING):
        models.load_model(DEFAULT_MODEL)
    recommended, source = models.recommended_sampling()
    assert recommended == {"temperature": 0.3, "top_k": 5}  # top_p 7 and bogus are refused, with a warning
    assert source == "models_settings.yaml [smollm2]"
    assert "top_p=7 ignored" in caplog.text and "bogus=1 ignored" in caplog.text

    name, values = parameters_tab.page_start()  # a new page starts from the model's sampling
    assert name == parameters_tab.MODEL_PRESET and values["temperature"] == 0.3 and values["top_k"] == 5
    assert "temperature` 0.3" in parameters_tab.sampling_text()
    shared.ui_defaults["preset"] = "Creative"  # preset: in settings.yaml is the user's choice, and wins
    name, values = parameters_tab.page_start()
    assert name == "Creative" and values["temperature"] == 1.3

    def params(**fields: object) -> object:
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], **fields)
        return core.generation_params(req, max_tokens=None, default_max=16)

    assert params().temperature == 0.3 and params().top_k == 5  # type: ignore[attr-defined]
    chosen = params(temperature=0.9, top_k=0)
    assert chosen.temperature == 0.9 and chosen.top_k == 0  # type: ignore[attr-defined]
    models.unload_model()
    assert params().temperature == 1.0 and models.recommended_sampling() == ({}, "")  # type: ignore[attr-defined]


def test_the_default_system_message_reaches_instruct_chats_that_send_none(
    with_default_model: Path, user_data: Path
) -> None:
    from extensions.openai import anthropic, ollama
    from modules.chat.engine import stream_reply
    from modules.chat.prompt import ChatOptions
    from modules.generation.params import GenerationParams
    from modules.ui import model_tab

    shipped = Path(__file__).parents[2] / "user_data" / "models_settings.yaml"
    (user_data / "models_settings.yaml").write_text(shipped.read_text())  # the entry the project ships
    models.load_model(DEFAULT_MODEL)
    system, source = models.default_system_message()
    assert system == "You are a helpful AI assistant." and source == "models_settings.yaml [SmolLM2-135M-Instruct]"
    assert "Default system message (from models_settings.yaml [SmolLM2-135M-Instruct])" in model_tab.status_text()
    said = f"<|im_start|>system\n{system}<|im_end|>"

    def prompt(messages: list[dict[str, str]]) -> str:
        return core.prepare_chat(ChatCompletionRequest(messages=messages, temperature=0), shared.model).prompt

    question = {"role": "user", "content": "What is the capital of France?"}
    assert said in prompt([question])  # a newcomer's first API call
    own = prompt([{"role": "system", "content": "Answer in one word."}, question])
    assert "Answer in one word." in own and system not in own  # the request's own system message wins
    assert system not in prompt([{"role": "developer", "content": "Be terse."}, question])
    # Anthropic's and Ollama's system fields are the request's own too
    req = anthropic.MessagesRequest.model_validate(
        {"model": "x", "max_tokens": 8, "system": "Answer in one word.", "messages": [question]}
    )
    assert system not in core.prepare_chat(anthropic.to_chat(req), shared.model).prompt
    req = anthropic.MessagesRequest.model_validate({"model": "x", "max_tokens": 8, "messages": [question]})
    assert said in core.prepare_chat(anthropic.to_chat(req), shared.model).prompt
    generate = ollama.GenerateRequest.model_validate({"model": "x", "prompt": "Hi", "system": "Be terse."})
    assert system not in core.prepare_chat(ollama._generate_chat_request(generate), shared.model).prompt
    # the chat page with its system box emptied gets it too
    params = GenerationParams(temperature=0, max_new_tokens=24)
    *_, last = stream_reply([question], params, options=ChatOptions(mode="instruct", system=""))
    assert "Paris" in last.history[-1]["content"]  # with the system message the greedy answer holds on both CPUs
    models.unload_model()
    assert models.default_system_message() == ("", "")
