"""The transformers backend: the real default model as an HF folder, tiny random models for everything else
(samplers, constraints, 4/8-bit, LoRA stacking, vision, safety), and the same pipeline as llama.cpp."""

from __future__ import annotations

import json
import pickle
import shutil
import threading
from pathlib import Path

import jsonschema
import pytest
from PIL import Image

from modules import extensions, models, shared
from modules.chat.prompt import render_messages
from modules.errors import ExtensionFailed, InvalidRequest, ModelLoadError, QueueFull
from modules.generation.params import GenerationParams
from modules.generation.pipeline import generate_reply, generate_text, launch, prepare
from tests.conftest import hf_default_model

CAPITAL = [
    {"role": "system", "content": "You are a helpful AI assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_real_model_as_hf_folder_answers(hub: object, models_dir: Path) -> None:
    (models_dir / "SmolLM2-135M-Instruct").symlink_to(hf_default_model())
    backend = models.load_model("SmolLM2-135M-Instruct")
    assert backend.loader_name == "transformers" and shared.model_options["loader"] == "transformers"
    text, stats = generate_text(render_messages(backend, CAPITAL), GenerationParams(temperature=0, max_new_tokens=20))
    assert "Paris" in text and stats.finish_reason == "stop"


def token_ids(prompt: str, params: GenerationParams) -> list[int]:
    """The ids of the tokens a generation produced."""
    return [t.token_id for d in generate_reply(prompt, params) for t in d.tokens]


def test_streams_seeds_samplers_and_cancel(tiny: Path) -> None:
    backend = models.load_model("tiny-llama")
    prompt = "Once upon a time"
    params = GenerationParams(temperature=1.0, max_new_tokens=12, seed=5, ban_eos=True)
    first, stats = generate_text(prompt, params)
    assert stats.new_tokens == 12 and generate_text(prompt, params)[0] == first
    assert generate_text(prompt, params.replace(seed=6))[0] != first
    everything = params.replace(
        top_k=50, top_p=0.95, min_p=0.01, typical_p=0.99, top_a=0.01, tfs=0.99, epsilon_cutoff=1, eta_cutoff=1,
        repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1, no_repeat_ngram_size=3,
        dry_multiplier=0.5, xtc_probability=0.2, dynatemp_range=0.3, temperature_last=True, logit_bias={5: -100},
    )  # fmt: skip
    _text, stats = generate_text(prompt, everything)
    assert stats.new_tokens == 12
    for mode in (1, 2):
        assert generate_text(prompt, params.replace(mirostat_mode=mode))[1].new_tokens == 12
    # The samplers change what comes out the way they say: greedy is deterministic, and every filter that keeps
    # only the most likely token turns a seeded sample back into the greedy answer, whatever the seed.
    greedy_params = GenerationParams(temperature=0, max_new_tokens=12, ban_eos=True)
    greedy = generate_text(prompt, greedy_params)[0]
    assert generate_text(prompt, greedy_params.replace(seed=99))[0] == greedy
    assert first != greedy  # temperature 1 on a random model does sample
    for only_the_top in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        for seed in (5, 6):
            assert generate_text(prompt, params.replace(seed=seed, **only_the_top))[0] == greedy, only_the_top
    ids = token_ids(prompt, greedy_params)
    assert len(ids) == 12
    # a bias against the greedy first token moves the greedy answer off it
    assert token_ids(prompt, greedy_params.replace(logit_bias={ids[0]: -100.0}))[0] != ids[0]
    # a large positive bias makes one token certain even when sampling
    assert token_ids(prompt, params.replace(logit_bias={ids[0]: 100.0})) == [ids[0]] * 12
    fresh = token_ids(prompt, params.replace(no_repeat_ngram_size=1))
    assert len(fresh) == 12 and len(set(fresh)) == 12  # no token twice
    # a cancel ends the generation within a step, counted in the engine's forward passes: the engine does not wait
    # for its reader, so the tokens the reader has seen say nothing about how soon it stopped
    cancel = threading.Event()
    steps_at_cancel = -1
    for seen, delta in enumerate(
        generate_reply(prompt, GenerationParams(max_new_tokens=5000, ban_eos=True), cancel=cancel), 1
    ):
        if seen == 3:
            cancel.set()
            steps_at_cancel = backend.stats()["steps"]
        if delta.stats:
            assert delta.stats.finish_reason == "cancelled"
            assert backend.stats()["steps"] - steps_at_cancel <= 2
    assert backend.stats()["busy_slots"] == 0


def test_logprobs_and_min_tokens(tiny: Path) -> None:
    backend = models.load_model("tiny-llama")
    deltas = list(
        generate_reply(
            "Hello",
            GenerationParams(temperature=0.8, seed=2, max_new_tokens=5, ban_eos=True, logprobs=True, top_logprobs=3),
        )
    )
    tokens = [t for d in deltas for t in d.tokens]
    assert len(tokens) == 5
    for token in tokens:
        assert token.logprob is not None and token.logprob <= 0 and len(token.top_logprobs or []) == 3
    # A bias towards EOS makes the model stop at once; min_tokens holds EOS back until 30 tokens are out.
    eos_first = {backend.metadata.eos_token_ids[0]: 100.0}
    _, stats = generate_text("Hello", GenerationParams(temperature=0, max_new_tokens=40, logit_bias=eos_first))
    assert stats.finish_reason == "stop" and stats.new_tokens <= 1
    _, stats = generate_text(
        "Hello", GenerationParams(temperature=0, max_new_tokens=40, min_tokens=30, logit_bias=eos_first)
    )
    assert stats.finish_reason == "stop" and 30 <= stats.new_tokens <= 31


def test_json_schema_regex_and_grammar_constrain_the_output(tiny: Path) -> None:
    models.load_model("tiny-llama")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    text, stats = generate_text(
        "Person:", GenerationParams(temperature=0.7, seed=1, max_new_tokens=120, json_schema=schema)
    )
    assert stats.finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    digits, _ = generate_text(
        "Code:", GenerationParams(temperature=1.0, seed=3, max_new_tokens=20, regex=r"[0-9]{4}-[a-z]{3}")
    )
    assert len(digits) == 8 and digits[:4].isdigit() and digits[4] == "-"
    answer, _ = generate_text(
        "Yes or no?", GenerationParams(temperature=1.0, seed=3, max_new_tokens=10, grammar='root ::= "yes" | "no"')
    )
    assert answer in ("yes", "no")
    with pytest.raises(InvalidRequest):
        list(generate_reply("x", GenerationParams(grammar="root ::= (")))


def test_queue_full(tiny: Path) -> None:
    backend = models.load_model("tiny-llama", {"max_queue": 0, "parallel": 1})
    ids = backend.encode("Hello")
    running = backend.generate(ids, GenerationParams(max_new_tokens=200, ban_eos=True), cancel := threading.Event())
    next(running)
    with pytest.raises(QueueFull):
        backend.generate(ids, GenerationParams(max_new_tokens=2), threading.Event())
    cancel.set()
    list(running)


def test_a_stream_never_started_gives_its_place_back(tiny: Path) -> None:
    import gc

    backend = models.load_model("tiny-llama", {"max_queue": 1, "parallel": 1})
    ids = backend.encode("Hello")
    running = backend.generate(ids, GenerationParams(max_new_tokens=200, ban_eos=True), cancel := threading.Event())
    next(running)  # holds the model
    unstarted = backend.generate(ids, GenerationParams(max_new_tokens=2), threading.Event())
    assert backend.stats()["queue_depth"] == 1
    with pytest.raises(QueueFull):
        backend.generate(ids, GenerationParams(max_new_tokens=2), threading.Event())
    del unstarted  # its client went away before reading anything
    gc.collect()
    assert backend.stats()["queue_depth"] == 0
    waiting = backend.generate(ids, GenerationParams(max_new_tokens=2), threading.Event())  # not QueueFull
    cancel.set()
    list(running)
    assert [e.finish_reason for e in waiting][-1] == "length"
    assert backend.stats()["queue_depth"] == 0


@pytest.mark.parametrize("flag", ["load_in_4bit", "load_in_8bit"])
def test_bitsandbytes_on_the_cpu(tiny: Path, flag: str) -> None:
    options = {flag: True, "compute_dtype": "float32", "quant_type": "nf4", "use_double_quant": True}
    backend = models.load_model("tiny-llama", options)
    assert backend.metadata.extra["quantized"] == ("4-bit" if flag == "load_in_4bit" else "8-bit")
    linear = type(backend.model.model.layers[0].self_attn.q_proj).__name__
    assert linear in ("Linear4bit", "Linear8bitLt")
    text, stats = generate_text("Hello", GenerationParams(temperature=0, max_new_tokens=6, ban_eos=True))
    assert stats.new_tokens == 6 and text


def test_a_lora_on_a_4bit_model_leaves_the_base_as_it_was(
    hub: object, models_dir: Path, user_data: Path, tmp_path: Path
) -> None:
    """bitsandbytes repacks 4-bit weights for AVX512-BF16 CPUs (Sapphire Rapids) at the first reply and unpacks
    them wrongly when PEFT reads the state dict to apply a LoRA: the model answered garbage from then on, also
    once the LoRA was removed. The default model: the tiny one's layers are too small to be repacked."""
    from modules.settings import load_settings
    from tests.fixtures.tiny_hf import build_tiny_lora

    (models_dir / "SmolLM2-135M-Instruct").symlink_to(hf_default_model())
    build_tiny_lora(tmp_path / "loras" / "lora-a", hf_default_model(), targets=("q_proj", "v_proj", "down_proj"))
    folders = ["--user-data-dir", str(user_data), "--model-dir", str(models_dir), "--lora-dir", str(tmp_path / "loras")]
    shared.init(load_settings(folders, env={}))
    models.load_model("SmolLM2-135M-Instruct", {"loader": "transformers", "load_in_4bit": True})  # no double quant
    params = GenerationParams(temperature=0, max_new_tokens=8, ban_eos=True)
    base = generate_text("Hello", params)[0]
    models.apply_loras(["lora-a"])
    one = generate_text("Hello", params)[0]
    models.apply_loras([])
    assert generate_text("Hello", params)[0] == base
    assert one != base


def test_lora_load_stack_unload(tiny: Path) -> None:
    models.load_model("tiny-llama")
    params = GenerationParams(temperature=0, max_new_tokens=8, ban_eos=True)
    base = generate_text("Hello", params)[0]
    models.apply_loras(["lora-a"])
    one = generate_text("Hello", params)[0]
    models.apply_loras(["lora-a", "lora-b"])
    two = generate_text("Hello", params)[0]
    models.apply_loras(["lora-a"], [0.0])  # scaled to nothing: the base model's output
    zero = generate_text("Hello", params)[0]
    models.apply_loras([])
    assert generate_text("Hello", params)[0] == base
    assert one != base and two != one and zero == base
    assert shared.loras == []
    with pytest.raises(Exception, match="not in"):
        models.apply_loras(["missing-lora"])


def test_vision_model_sees_the_image(tiny: Path) -> None:
    backend = models.load_model("tiny-llava")
    assert backend.supports_vision
    prompt = render_messages(
        backend, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    )
    red, blue = Image.new("RGB", (40, 40), "red"), Image.new("RGB", (40, 40), (0, 0, 255))
    prepared = prepare(prompt, GenerationParams(), backend, images=[red])
    image_token = backend.model.config.image_token_index
    assert prepared.prompt_ids.count(image_token) > 1 and "pixel_values" in prepared.extra["model_inputs"]
    params = GenerationParams(temperature=0, max_new_tokens=3, logprobs=True, top_logprobs=3)

    def first_token(image: Image.Image) -> list[float]:
        deltas = list(generate_reply(prompt, params, images=[image]))
        return [t.logprob for d in deltas for t in d.tokens[:1] for t in (t.top_logprobs or [])]

    assert first_token(red) != first_token(blue)
    llama = models.load_model("tiny-llama")
    assert not llama.supports_vision
    with pytest.raises(InvalidRequest, match="cannot see images"):
        prepare(prompt, GenerationParams(), llama, images=[red])


def test_extension_logits_processors_apply(tiny: Path, user_data: Path) -> None:
    banned = 1000
    folder = user_data / "extensions" / "ban"
    folder.mkdir(parents=True)
    (folder / "script.py").write_text(
        "def logits_processor_modifier(processor_list, input_ids):\n"
        "    def ban(input_ids, scores):\n"
        f"        scores[:, {banned}] = float('-inf')\n"
        "        return scores\n"
        "    processor_list.append(ban)\n"
    )
    backend = models.load_model("tiny-llama")
    ids = backend.encode("Hello")
    forced = GenerationParams(temperature=0, max_new_tokens=3, logit_bias={banned: 50})

    def tokens() -> list[int]:  # through the pipeline, which hands the extensions' processors to the backend
        prepared = prepare(ids, forced, backend)
        return [e.token_id for e in launch(prepared, backend, threading.Event()) if e.token_id >= 0]

    assert tokens()[0] == banned
    extensions.load_extensions(["ban"])
    assert banned not in tokens()
    broken = user_data / "extensions" / "broken_processor"
    broken.mkdir(parents=True)
    (broken / "script.py").write_text(
        "def logits_processor_modifier(processor_list, input_ids):\n"
        "    def fail(input_ids, scores):\n"
        "        raise ValueError('processor broke')\n"
        "    processor_list.append(fail)\n"
    )
    (ext,) = extensions.load_extensions(["broken_processor"])
    with pytest.raises(ExtensionFailed, match="broken_processor"):
        tokens()
    assert not ext.active and "processor broke" in (ext.error or "")
    assert banned not in tokens()


def test_bin_weights_load_safely_and_remote_code_is_off(tiny: Path) -> None:
    assert models.load_model("tiny-llama-bin").loader_name == "transformers"  # torch.load with weights_only
    evil = tiny / "evil-bin"
    shutil.copytree(tiny / "tiny-llama-bin", evil, dirs_exist_ok=True)

    marker = tiny / "evil-bin-ran"
    marker.unlink(missing_ok=True)

    class Exploit:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (open, (str(marker), "w"))  # unpickling this creates the marker file

    with open(evil / "pytorch_model.bin", "wb") as handle:
        pickle.dump(Exploit(), handle)
    with pytest.raises(ModelLoadError):
        models.load_model("evil-bin")
    assert not marker.exists(), "loading the .bin ran code from its pickle"
    remote = tiny / "needs-remote-code"
    shutil.copytree(tiny / "tiny-llama", remote, dirs_exist_ok=True)
    config = json.loads((remote / "config.json").read_text())
    config["model_type"] = "textgen-custom-architecture"  # only the shipped code knows it
    config["auto_map"] = {
        "AutoModelForCausalLM": "modeling_custom.CustomModel",
        "AutoConfig": "modeling_custom.CustomConfig",
    }
    (remote / "config.json").write_text(json.dumps(config))
    (remote / "modeling_custom.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(ModelLoadError, match="--trust-remote-code"):
        models.load_model("needs-remote-code")  # the shipped code would exit the process: it never ran
    assert shared.model is None


def test_images_through_the_api(tiny: Path) -> None:
    import base64
    import io

    from fastapi.testclient import TestClient

    from server import create_app

    extensions.load_extensions(["openai"])
    models.load_model("tiny-llava")
    client = TestClient(create_app(), base_url="http://127.0.0.1")
    buffer = io.BytesIO()
    Image.new("RGB", (40, 40), "green").save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    body = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}],
            }
        ],
        "max_tokens": 4,
        "temperature": 0,
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] > 10  # the image became several tokens
    bad = {
        **body,
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}]}
        ],
    }
    assert client.post("/v1/chat/completions", json=bad).status_code == 400
    models.load_model("tiny-llama")
    refused = client.post("/v1/chat/completions", json=body)
    assert refused.status_code == 400 and "cannot see images" in refused.json()["error"]["message"]


@pytest.mark.gpu
def test_bitsandbytes_and_offload_on_a_gpu(tiny: Path) -> None:
    backend = models.load_model("tiny-llama", {"load_in_4bit": True, "compute_dtype": "float16"})
    assert str(backend.metadata.extra["device"]).startswith("cuda")
    assert generate_text("Hello", GenerationParams(temperature=0, max_new_tokens=5, ban_eos=True))[1].new_tokens == 5
    offloaded = models.load_model("tiny-llama", {"gpu_memory": ["1MiB"], "cpu_memory": "4GiB"})
    devices = {str(p.device) for p in offloaded.model.parameters()}
    assert "cpu" in devices  # the 1 MiB GPU budget pushed layers to the CPU
    assert generate_text("Hello", GenerationParams(temperature=0, max_new_tokens=5, ban_eos=True))[1].new_tokens == 5


def test_tools_and_json_through_the_api_on_transformers(tiny: Path) -> None:
    from fastapi.testclient import TestClient

    from server import create_app

    extensions.load_extensions(["openai"])
    models.load_model("tiny-llama")
    client = TestClient(create_app(), base_url="http://127.0.0.1")
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
            },
        },
    }
    body = {
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [tool],
        "tool_choice": "required",
        "max_tokens": 80,
        "seed": 1,
    }
    reply = client.post("/v1/chat/completions", json=body).json()
    call = reply["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    body = {
        "messages": [{"role": "user", "content": "JSON!"}],
        "max_tokens": 40,
        "seed": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    content = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), schema)
    regex = client.post(
        "/v1/completions", json={"prompt": "Code:", "max_tokens": 10, "regex": "[0-9]{3}", "seed": 3}
    ).json()
    assert regex["choices"][0]["text"].isdigit() and len(regex["choices"][0]["text"]) == 3
