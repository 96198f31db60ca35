"""The extension system through the real loader: every hook on a real generation, order, failures, overrides,
and the bundled extensions."""

from __future__ import annotations

import base64
import io
import json
import textwrap
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from fastapi.testclient import TestClient

from modules import extensions, loaders, models, shared
from modules.chat import engine
from modules.chat.prompt import ChatOptions
from modules.errors import ExtensionFailed
from modules.generation.params import GenerationParams
from modules.generation.pipeline import generate_text
from tests.conftest import DEFAULT_MODEL, run_async

SYSTEM = "You are a helpful AI assistant."


def asgi_get(app: Any, raw_path: bytes) -> tuple[int, dict[str, str], bytes]:
    """GET ``raw_path`` exactly as written (no `..` normalisation), the way uvicorn hands a raw request line on."""
    import anyio

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": unquote(raw_path.decode("ascii")),
        "raw_path": raw_path,
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }
    sent: list[dict[str, Any]] = []

    async def call() -> None:
        done = anyio.Event()
        requested = False

        async def receive() -> dict[str, Any]:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await done.wait()  # the client hangs up once the whole response has come
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                done.set()

        await app(scope, receive, send)

    run_async(call)
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return int(start["status"]), headers, body


HOOKTEST = """
from typing import Any

params = {"display_name": "Hook test", "is_tab": False, "suffix": "!"}
seen = []
prompts = []  # what tokenizer_modifier was given: the final prompts
OWN_PROMPT = "<|im_start|>user\\nName the capital of France.<|im_end|>\\n<|im_start|>assistant\\n"

def setup():
    seen.append("setup")

def ui():
    import gradio as gr
    gr.Markdown("hooktest-ui", elem_id="hooktest-ui")

def custom_css():
    return ".hooktest-css { color: red; }"

def custom_js():
    return "window.hooktest = 1;"

def state_modifier(state):
    seen.append("state_modifier")
    state["temperature"] = 0.0
    state["max_new_tokens"] = min(state["max_new_tokens"], 30)
    if state.get("system_message"):  # a chat setting: it must reach the prompt
        state["system_message"] += " HOOKED-SYSTEM"
    return state

def chat_input_modifier(text, visible_text, state):
    seen.append("chat_input_modifier")
    return text, visible_text + " [shown]"

def input_modifier(string, state, is_chat=False):
    seen.append("input_modifier")
    return string.replace("CAPITAL?", "What is the capital of France?")

def history_modifier(history):
    seen.append("history_modifier")
    history["messages"] = [m for m in history["messages"] if "DROP ME" not in m["content"]]
    return history

def bot_prefix_modifier(string, state):
    seen.append("bot_prefix_modifier")
    return string + "The capital of France is"

def custom_generate_chat_prompt(user_input, state, **kwargs):
    seen.append("custom_generate_chat_prompt")
    return OWN_PROMPT if "OWNPROMPT" in user_input else None

def custom_generate_reply(question, original_question, state, stopping_strings, is_chat):
    seen.append("custom_generate_reply")
    if "MAGIC" in original_question:
        return iter(["abra", "abracadabra"])
    return None

def tokenizer_modifier(state, prompt, input_ids):
    seen.append("tokenizer_modifier")
    prompts.append(prompt)
    if prompt == "TOKMOD":
        from modules import shared
        return prompt, shared.model.encode("The capital of France is")
    return prompt, input_ids

def custom_tokenized_length(prompt):
    seen.append("custom_tokenized_length")
    return 10**6 if "TRUNCATE-ME" in prompt else None  # the truncation must drop that message

def logits_processor_modifier(processor_list, input_ids):
    seen.append("logits_processor_modifier")

def output_modifier(string, state, is_chat=False):
    seen.append("output_modifier")
    return string.upper() + params["suffix"]

def api_routes(app):
    @app.get("/v1/hooktest")
    def hooktest():
        return {"seen": sorted(set(seen))}

def register_backends(register):
    from modules.loaders.base import Backend

    class NullBackend(Backend):
        loader_name = "hooktest-null"

        @classmethod
        def load(cls, path, options):
            return cls()

    register("hooktest-null", NullBackend)
"""


def write_extension(user_data: Path, name: str, source: str) -> Path:
    folder = user_data / "extensions" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "script.py").write_text(textwrap.dedent(source))
    return folder


def test_every_hook_runs_on_a_real_generation(with_default_model: Path, user_data: Path) -> None:
    write_extension(user_data, "hooktest", HOOKTEST)
    shared.extension_params["hooktest"] = {"suffix": "?!"}  # as settings.yaml's hooktest-suffix would
    ext, api = extensions.load_extensions(["hooktest", "openai"])
    assert ext.active and ext.params["suffix"] == "?!" and ext.display_name == "Hook test" and api.active
    models.load_model(DEFAULT_MODEL)
    assert ext.module.seen == ["setup"]
    ext.module.seen.clear()
    history = [
        {"role": "user", "content": "DROP ME please"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "TRUNCATE-ME old question"},
        {"role": "assistant", "content": "old answer"},
    ]
    params = GenerationParams(temperature=1.5, max_new_tokens=200)
    updates = list(engine.send(history, "CAPITAL?", params, options=ChatOptions(system=SYSTEM)))
    final = updates[-1]
    user, reply = final.history[-2], final.history[-1]
    assert user == {"role": "user", "content": "CAPITAL?", "visible": "CAPITAL? [shown]"}
    assert "Paris" in reply["content"]  # input_modifier and bot_prefix_modifier steered it; temperature 0 from state
    assert reply["visible"] == reply["content"].upper() + "?!"
    assert final.stats is not None and final.stats.new_tokens <= 30  # state_modifier capped it
    prompt = ext.module.prompts[-1]
    assert "HOOKED-SYSTEM" in prompt  # state_modifier ran before the prompt was built
    assert "What is the capital of France?" in prompt and "DROP ME" not in prompt  # input and history hooks
    assert "TRUNCATE-ME" not in prompt and "old answer" in prompt  # custom_tokenized_length drove truncation
    first_seen = list(dict.fromkeys(ext.module.seen))
    assert first_seen == [  # the documented order (docs/extensions.md)
        "chat_input_modifier", "state_modifier", "input_modifier", "history_modifier", "custom_generate_chat_prompt",
        "custom_tokenized_length", "bot_prefix_modifier", "custom_generate_reply", "tokenizer_modifier",
        "output_modifier",
    ], first_seen  # fmt: skip
    own = list(engine.send([], "OWNPROMPT", params, options=ChatOptions(system=SYSTEM)))[-1]
    assert ext.module.prompts[-1].startswith(ext.module.OWN_PROMPT)  # custom_generate_chat_prompt replaced it
    assert "Paris" in own.history[-1]["content"]
    steered, _ = generate_text("TOKMOD", GenerationParams(temperature=0, max_new_tokens=5))
    assert "Paris" in steered  # tokenizer_modifier's ids are what the model read
    magic, _ = generate_text("MAGIC words", GenerationParams())
    assert magic == "abracadabra"
    assert loaders.get("hooktest-null").loader_name == "hooktest-null"

    from server import create_app

    client = TestClient(create_app(), base_url="http://127.0.0.1")
    assert "state_modifier" in client.get("/v1/hooktest").json()["seen"]
    ext.module.seen.clear()
    completion = client.post("/v1/completions", json={"prompt": "Q: CAPITAL?\nA: The capital of France is"})
    assert completion.status_code == 200, completion.text
    assert "input_modifier" in ext.module.seen  # /v1/completions' raw prompt goes through the text hooks too
    assert "Paris" in completion.json()["choices"][0]["text"]  # steered by input_modifier (the API: model's text)
    magic_api = client.post("/v1/completions", json={"prompt": "MAGIC words", "max_tokens": 20}).json()
    assert magic_api["choices"][0]["text"] == "abracadabra"  # custom_generate_reply
    tokmod = client.post("/v1/completions", json={"prompt": "TOKMOD", "max_tokens": 5}).json()
    assert "Paris" in tokmod["choices"][0]["text"]  # tokenizer_modifier's ids
    page = client.get("/")
    assert page.status_code == 200
    config = client.get("/config").text
    assert "hooktest-ui" in config and "hooktest-css" in config and "window.hooktest" in config


def test_modifiers_chain_in_enable_order(hub: object, user_data: Path) -> None:
    for name in ("first", "second"):
        write_extension(
            user_data, name, f"def output_modifier(string, state, is_chat=False):\n    return string + '[{name}]'\n"
        )
    extensions.load_extensions(["first", "second"])
    assert extensions.apply_modifier("output_modifier", "x", state={}, is_chat=True) == "x[first][second]"
    extensions.reset()
    extensions.load_extensions(["second", "first"])
    assert extensions.apply_modifier("output_modifier", "x", state={}, is_chat=True) == "x[second][first]"


def test_a_failing_extension_is_switched_off_and_the_rest_goes_on(with_default_model: Path, user_data: Path) -> None:
    write_extension(user_data, "broken_import", "raise RuntimeError('boom at import')\n")
    write_extension(
        user_data,
        "broken_hook",
        "def output_modifier(string, state, is_chat=False):\n    raise ValueError('boom in hook')\n",
    )
    write_extension(
        user_data, "bad_signature", "def output_modifier(text_instead_of_string):\n    return text_instead_of_string\n"
    )
    write_extension(
        user_data, "fine", "def output_modifier(string, state, is_chat=False):\n    return string + ' [fine]'\n"
    )
    loaded = {
        e.name: e
        for e in extensions.load_extensions(["broken_import", "broken_hook", "bad_signature", "fine", "missing"])
    }
    assert not loaded["broken_import"].active and "boom at import" in (loaded["broken_import"].error or "")
    assert not loaded["bad_signature"].active and "hookspec" in (loaded["bad_signature"].error or "")
    assert not loaded["missing"].active
    assert loaded["broken_hook"].active and loaded["fine"].active
    models.load_model(DEFAULT_MODEL)
    final = list(
        engine.send([], "Hi", GenerationParams(temperature=0, max_new_tokens=5), options=ChatOptions(system=SYSTEM))
    )[-1]
    assert final.history[-1]["visible"].endswith(" [fine]")
    assert not loaded["broken_hook"].active and "boom in hook" in (loaded["broken_hook"].error or "")
    from modules import session

    statuses = {row[0]: row[1] for row in session.extension_rows()}
    assert statuses["broken_hook"].startswith("failed") and statuses["fine"] == "active"


def test_an_extension_reply_that_raises_midway_is_switched_off(with_default_model: Path, user_data: Path) -> None:
    write_extension(
        user_data,
        "flaky_reply",
        "def custom_generate_reply(question, original_question, state, stopping_strings, is_chat):\n"
        "    def pieces():\n"
        "        yield 'first'\n"
        "        raise RuntimeError('broke midway')\n"
        "    return pieces()\n",
    )
    (ext,) = extensions.load_extensions(["flaky_reply"])
    models.load_model(DEFAULT_MODEL)
    with pytest.raises(ExtensionFailed, match="flaky_reply"):
        generate_text("Hello", GenerationParams(temperature=0, max_new_tokens=5))
    assert not ext.active and "broke midway" in (ext.error or "")
    text, _ = generate_text("The capital of France is", GenerationParams(temperature=0, max_new_tokens=5))
    assert "Paris" in text  # the model answers again


def test_user_data_extension_wins_over_the_bundled_one(hub: object, user_data: Path) -> None:
    write_extension(user_data, "example", "params = {'display_name': 'My own example'}\n")
    (ext,) = extensions.load_extensions(["example"])
    assert ext.display_name == "My own example" and ext.path == user_data / "extensions" / "example"


def test_character_bias_changes_the_reply(with_default_model: Path) -> None:
    models.load_model(DEFAULT_MODEL)
    params = GenerationParams(temperature=0, max_new_tokens=20)
    options = ChatOptions(mode="chat", character="Assistant")
    plain = list(engine.send([], "How are you today?", params, options=options))[-1].history[-1]["content"]
    (ext,) = extensions.load_extensions(["character_bias"])
    ext.params["bias_string"] = "*sighs deeply and looks very sad*"
    biased = list(engine.send([], "How are you today?", params, options=options))[-1].history[-1]["content"]
    assert biased != plain and "*sighs" not in biased  # the bias steers the reply without being part of it


def test_long_replies_forbids_an_early_end(with_default_model: Path) -> None:
    models.load_model(DEFAULT_MODEL)
    params = GenerationParams(temperature=0, max_new_tokens=200)
    _, short = generate_text("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n", params)
    assert short.finish_reason == "stop" and short.new_tokens < 60
    (ext,) = extensions.load_extensions(["long_replies"])
    ext.params["min_length"] = 80
    _, longer = generate_text("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n", params)
    assert longer.new_tokens >= 80


def test_perplexity_colors_colours_every_token(with_default_model: Path) -> None:
    models.load_model(DEFAULT_MODEL)
    extensions.load_extensions(["perplexity_colors"])
    reply = list(
        engine.send(
            [],
            "What is the capital of France?",
            GenerationParams(temperature=0, max_new_tokens=12),
            options=ChatOptions(system=SYSTEM),
        )
    )[-1]
    visible = reply.history[-1]["visible"]
    assert visible.count('<span style="background-color: #') == reply.stats.new_tokens
    assert 'title="' in visible and "Paris" in visible


def test_superbooga_answers_from_an_added_document(with_default_model: Path, tmp_path: Path) -> None:
    models.load_model(DEFAULT_MODEL)
    question = "Who is the keeper of the Blue Lighthouse?"
    params = GenerationParams(temperature=0, max_new_tokens=40)
    facts = ("Olsson", "Mara", "Varn")  # only in the document
    before = list(engine.send([], question, params, options=ChatOptions(system=SYSTEM)))[-1].history[-1]["content"]
    assert not any(fact in before for fact in facts)
    (ext,) = extensions.load_extensions(["superbooga"])
    notes = tmp_path / "lighthouses.md"
    notes.write_text(
        "The Blue Lighthouse stands on the island of Varn. Its keeper is Mara Olsson. "
        "Ships pass it every morning.\n\nThe Red Lighthouse is in the south and has no keeper."
    )
    assert ext.module.add_file(notes) >= 1
    ext.module.add_text("recipes", "To bake bread, mix flour, water, yeast and salt. Let the dough rise for two hours.")
    hits = ext.module.store().search(question, 1)
    assert hits[0].document == "lighthouses.md"
    final = list(engine.send([], question, params, options=ChatOptions(system=SYSTEM)))[-1]
    assert any(fact in final.history[-1]["content"] for fact in facts), final.history[-1]["content"]
    assert final.history[-2]["content"] == question  # the history keeps the question alone
    with pytest.raises(ValueError):
        ext.module.add_text("empty", "   ")
    docs = ext.module.store().documents()
    ext.module.store().delete(docs[0][0])
    assert [d[1] for d in ext.module.store().documents()] == ["recipes"]


def test_image_generation_api_and_chat(with_default_model: Path, models_dir: Path) -> None:
    from PIL import Image

    from server import create_app
    from tests.fixtures.tiny_diffusers import build_tiny_pipeline

    build_tiny_pipeline(models_dir / "tiny-sd")
    extensions.load_extensions(["openai", "image_generation"])
    client = TestClient(create_app(), base_url="http://127.0.0.1")
    body = {"prompt": "a lighthouse", "n": 2, "size": "32x32", "response_format": "b64_json", "steps": 2, "seed": 3}
    response = client.post("/v1/images/generations", json=body)
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert len(data) == 2
    image = Image.open(io.BytesIO(base64.b64decode(data[0]["b64_json"])))
    assert image.size == (32, 32)
    again = client.post("/v1/images/generations", json=body).json()["data"]
    assert again[0]["b64_json"] == data[0]["b64_json"]  # seeded
    url = client.post("/v1/images/generations", json={**body, "response_format": "url", "n": 1}).json()["data"][0][
        "url"
    ]
    assert client.get(url.split("127.0.0.1")[1]).headers["content-type"] == "image/png"
    assert client.post("/v1/images/generations", json={**body, "size": "33x33"}).status_code == 400
    assert client.post("/v1/images/generations", json={**body, "model": "no-such-pipeline"}).status_code == 404
    assert client.post("/v1/images/generations", json={"n": 1}).status_code == 400
    # A path that climbs out of the images folder, sent as a raw request line would bring it (httpx, and so
    # TestClient, would normalise the `..` away before it reached the route): nothing outside is served.
    secret = b"\x89PNG not for you"
    (shared.user_data_dir() / "secret.png").write_bytes(secret)
    (shared.user_data_dir() / "cache" / "secret.png").write_bytes(secret)
    for raw in (
        b"/v1/images/files/../../secret.png",
        b"/v1/images/files/../secret.png",
        b"/v1/images/files/%2e%2e%2f%2e%2e%2fsecret.png",
        b"/v1/images/files/..%2Fsecret.png",
        b"/v1/images/files/..%5Csecret.png",
        b"/v1/images/files/%2e%2e",
    ):
        status, headers, content = asgi_get(client.app, raw)
        assert status == 404 and secret not in content, (raw, status, content[:80])
        assert headers.get("content-type") == "application/json", raw
        message = json.loads(content)["error"]["message"]  # the handler's refusal, or no route at all for a '/'
        assert message.startswith(("no image named", "no API route")), (raw, message)

    (ext,) = [e for e in extensions.active() if e.name == "image_generation"]
    ext.params.update(width=32, height=32, steps=2)
    models.load_model(DEFAULT_MODEL)
    reply = generate_text("ignored", GenerationParams(), state={"user_input": "/image a red boat"}, is_chat=True)[0]
    from extensions.image_generation.generator import images_dir

    # the chat shows it through the web UI's own file route (--gradio-auth guards it), not the keyed API
    assert reply.startswith(f"![a red boat](/gradio_api/file={images_dir()}/") and reply.endswith(".png)")
