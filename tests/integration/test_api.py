"""The OpenAI-compatible API, driven with the official openai client against a live server and the real model."""

from __future__ import annotations

import base64
import itertools
import json
import math
import struct

import httpx
import jsonschema
import openai
import pytest

SYSTEM = {"role": "system", "content": "You are a helpful AI assistant."}
CAPITAL = [SYSTEM, {"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(shared_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=shared_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_list_and_get(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in ids and "all-MiniLM-L6-v2" in ids
    assert client.models.retrieve("SmolLM2-135M-Instruct.Q4_1.gguf").id == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"


def test_chat_answers_and_echoes_the_model_name(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="gpt-4o", messages=CAPITAL, temperature=0, max_tokens=30)
    assert reply.model == "gpt-4o" and reply.object == "chat.completion"
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    usage = reply.usage
    assert usage.prompt_tokens > 10 and 0 < usage.completion_tokens <= 30
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streaming_matches_the_plain_reply_and_reports_usage(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model="m", messages=CAPITAL, temperature=0, max_tokens=30)
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=CAPITAL,
            temperature=0,
            max_tokens=30,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # in pieces; not counted finer: a server whose event loop runs late sends what has come since as one chunk
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2, "the reply must stream in pieces"


def test_n_choices_with_a_seed_are_reproducible(client: openai.OpenAI) -> None:
    kwargs = {
        "model": "m",
        "messages": [{"role": "user", "content": "Name an animal."}],
        "max_tokens": 12,
        "n": 3,
        "seed": 42,
        "temperature": 1.0,
    }
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in second.choices]
    assert len(set(texts)) > 1, "each choice gets its own seed"
    other = client.chat.completions.create(**{**kwargs, "seed": 7, "n": 1})
    assert other.choices[0].message.content != texts[0]


def test_streaming_n_interleaves_by_index(client: openai.OpenAI) -> None:
    kwargs = {
        "model": "m",
        "messages": [{"role": "user", "content": "Tell me a fact."}],
        "max_tokens": 24,
        "n": 2,
        "seed": 5,
        "temperature": 0.8,
    }
    plain = client.chat.completions.create(**kwargs)
    texts = {0: "", 1: ""}
    order = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.content:  # not the role chunks, which come for every choice first
                order.append(choice.index)
    assert texts == {c.index: c.message.content for c in plain.choices}
    switches = sum(1 for a, b in itertools.pairwise(order) if a != b)
    # one stream after the other switches once; a late event loop merges what has come into a chunk per choice
    assert switches >= 2, f"the two streams should interleave, got {order}"


def test_stop_strings(client: openai.OpenAI) -> None:
    full = (
        client.chat.completions.create(model="m", messages=CAPITAL, temperature=0, max_tokens=30)
        .choices[0]
        .message.content
    )
    cut = client.chat.completions.create(model="m", messages=CAPITAL, temperature=0, max_tokens=30, stop=["Paris"])
    assert cut.choices[0].message.content == full[: full.index("Paris")]
    assert cut.choices[0].finish_reason == "stop"
    length = client.chat.completions.create(model="m", messages=CAPITAL, temperature=0, max_tokens=3)
    assert length.choices[0].finish_reason == "length" and length.usage.completion_tokens == 3


def test_chat_logprobs_shape(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="m", messages=CAPITAL, temperature=0, max_tokens=10, logprobs=True, top_logprobs=3
    )
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens
    assert "".join(e.token for e in entries) == reply.choices[0].message.content
    for entry in entries:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
        assert sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1.0001


def test_json_object_and_json_schema_outputs_parse(client: openai.OpenAI) -> None:
    person = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        },
        max_tokens=80,
        temperature=0.7,
        seed=3,
    )
    value = json.loads(person.choices[0].message.content)
    jsonschema.validate(value, PERSON_SCHEMA)
    anything = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": 'A JSON object with the keys "city" and "country" for Paris, please.'}],
        response_format={"type": "json_object"},
        max_tokens=400,
        temperature=0,
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_invalid_schema_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="m",
            messages=CAPITAL,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        )
    assert info.value.body["param"] == "response_format.json_schema.schema"


def test_required_tool_call(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_tokens=80,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


def test_named_tool_call_streams_as_deltas(client: openai.OpenAI) -> None:
    second_tool = {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
        },
    }
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Time in Tokyo?"}],
        tools=[WEATHER_TOOL, second_tool],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    name, arguments, finish, pieces = "", "", None, 0
    for chunk in stream:
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            pieces += 1
            name += delta.function.name or ""
            arguments += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    assert name == "get_time" and pieces >= 2
    assert finish == "stop"  # as OpenAI: a function named in tool_choice ends with "stop", not "tool_calls"
    assert "zone" in json.loads(arguments)


def test_tool_choice_none_and_a_tool_result_turn(client: openai.OpenAI, shared_server) -> None:
    none = client.chat.completions.create(
        model="m", messages=CAPITAL, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=20, temperature=0
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    turn = dict(
        model="m",
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
        ],
        tools=[WEATHER_TOOL],
        max_tokens=30,
        temperature=0,
    )
    prompt = httpx.post(shared_server.url + "/v1/internal/chat-prompt", json=turn, timeout=60).json()["prompt"]
    assert "Sunny, 21 C" in prompt and "get_weather" in prompt  # the call and its result reach the model
    for tool_choice in ("auto", "required"):
        follow_up = client.chat.completions.create(**turn, tool_choice=tool_choice)  # type: ignore[call-overload]
        choice = follow_up.choices[0]
        if tool_choice == "required":
            assert choice.message.tool_calls, "tool_choice required gave no tool call"
        if choice.message.tool_calls:  # the small model may ask again: then as a well-formed, fresh call
            assert choice.finish_reason == "tool_calls" and not choice.message.content
            for call in choice.message.tool_calls:
                assert call.type == "function" and call.id and call.id != "call_1"
                assert call.function.name == "get_weather"
                jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
        else:
            assert choice.finish_reason in ("stop", "length") and choice.message.content.strip()
    answer = client.chat.completions.create(**{**turn, "tool_choice": "none", "max_tokens": 40})  # type: ignore[call-overload]
    assert answer.choices[0].message.tool_calls is None
    assert "21" in answer.choices[0].message.content  # the tool's result reached the reply


def test_legacy_completions_echo_logprobs_and_best_of(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model="m", prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2, echo=True
    )
    choice = reply.choices[0]
    assert choice.text.startswith("The capital of France is") and "Paris" in choice.text
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    # best_of: the n choices returned are the best_of candidates with the highest total logprob, best first.
    # Candidate i is sampled with seed + i, so n=best_of with the same seed shows every candidate and its logprob.
    # Which seed samples its candidates out of order depends on the CPU's numerics: take the first that does (of
    # four candidates, the best two come first in order 1 time in 12), so that returning them unsorted must fail.
    for seed in range(1, 7):
        sample = dict(model="m", prompt="Once upon a time", max_tokens=8, seed=seed, temperature=1.0)
        every = client.completions.create(**sample, n=4, best_of=4, logprobs=0)  # type: ignore[call-overload]
        candidates = sorted(((sum(c.logprobs.token_logprobs), c.text) for c in every.choices), reverse=True)
        if [text for _, text in candidates[:2]] != [c.text for c in every.choices[:2]]:
            break
    assert len({text for _, text in candidates}) == 4  # four different candidates to choose from
    plain = client.completions.create(**sample, n=2, best_of=4)  # type: ignore[call-overload]
    assert [c.index for c in plain.choices] == [0, 1]
    assert [c.text for c in plain.choices] == [text for _, text in candidates[:2]]
    assert [c.text for c in plain.choices] != [c.text for c in every.choices[:2]]  # a choice was made
    batch = client.completions.create(model="m", prompt=["One", "Two"], max_tokens=3, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="def f(", suffix="return 1", max_tokens=5)
    assert info.value.body["param"] == "suffix"
    with pytest.raises(openai.BadRequestError) as info:  # chat-only fields mean nothing to a raw prompt
        client.completions.create(model="m", prompt="Hi", max_tokens=5, extra_body={"character": "Assistant"})
    assert info.value.body["param"] == "character"
    default = client.completions.create(
        model="m", prompt="Once upon a time", max_tokens=None, extra_body={"ban_eos": True}
    )
    assert default.usage.completion_tokens == 16  # null max_tokens means OpenAI's default, 16


def test_sillytavern_text_completion_body(shared_server) -> None:
    """The body SillyTavern sends in Text Completion mode for text-generation-webui: its names are honoured."""
    url = shared_server.url + "/v1"
    paris = httpx.post(url + "/internal/encode", json={"text": " Paris"}).json()["tokens"][0]
    body = {
        "prompt": "The capital of France is",
        "model": "SmolLM2",
        "max_new_tokens": 12,
        "max_tokens": 12,
        "temperature": 0,
        "top_p": 1,
        "typical_p": 1,
        "min_p": 0,
        "repetition_penalty": 1,
        "frequency_penalty": 0,
        "presence_penalty": 0,
        "top_k": 0,
        "min_length": 0,
        "min_tokens": 0,
        "num_beams": 1,
        "length_penalty": 1,
        "early_stopping": False,
        "add_bos_token": True,
        "smoothing_factor": 0,
        "smoothing_curve": 1,
        "dry_allowed_length": 2,
        "dry_multiplier": 0,
        "dry_base": 1.75,
        "dry_sequence_breakers": '["\\n", ":", "\\"", "*"]',
        "dry_penalty_last_n": 0,
        "max_tokens_second": 0,
        "sampler_priority": ["temperature", "top_k", "top_p"],
        "stopping_strings": ["\nUser:"],
        "stop": ["\nUser:"],
        "truncation_length": 8192,
        "ban_eos_token": True,
        "skip_special_tokens": True,
        "top_a": 0,
        "tfs": 1,
        "epsilon_cutoff": 0,
        "eta_cutoff": 0,
        "mirostat_mode": 0,
        "mirostat_tau": 5,
        "mirostat_eta": 0.1,
        "custom_token_bans": str(paris),
        "banned_strings": [],
        "api_type": "ooba",
        "api_server": url,
        "xtc_threshold": 0.1,
        "xtc_probability": 0,
        "repetition_penalty_range": 0,
        "no_repeat_ngram_size": 0,
        "temperature_last": True,
        "do_sample": True,
        "seed": -1,
        "grammar_string": "",
        "stream": False,
    }
    reply = httpx.post(url + "/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["usage"]["completion_tokens"] == 12  # ban_eos_token: no early end
    assert not data["choices"][0]["text"].startswith(" Paris")  # custom_token_bans: the greedy answer is banned
    plain = httpx.post(url + "/completions", json={**body, "custom_token_bans": ""}, timeout=120).json()
    assert plain["choices"][0]["text"].startswith(" Paris")


def test_legacy_streaming_completion(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="m", prompt="Paris is", max_tokens=10, temperature=0)
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(model="m", prompt="Paris is", max_tokens=10, temperature=0, stream=True)
        if c.choices
    )
    assert text == plain.choices[0].text


def test_embeddings_float_base64_and_meaning(client: openai.OpenAI) -> None:
    result = client.embeddings.create(model="text-embedding-3-small", input=["a cat", "a kitten", "a truck"])
    vectors = [d.embedding for d in result.data]
    assert len(vectors) == 3 and len(vectors[0]) == 384 and result.usage.prompt_tokens > 0

    def cosine(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True))

    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])
    raw = httpx.post(str(client.base_url) + "embeddings", json={"input": "a cat", "encoding_format": "base64"}).json()
    decoded = struct.unpack("<384f", base64.b64decode(raw["data"][0]["embedding"]))
    assert max(abs(x - y) for x, y in zip(decoded, vectors[0], strict=True)) < 1e-6
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="m", input=[[1, 2, 3]])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature"),
        ({"messages": []}, "messages"),
        ({}, "messages"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "preset": "Nope"}, "preset"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_a": 0.5}, "top_a"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
            "messages[0].content",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "mode": "chat", "character": "../../etc/passwd"},
            "character",
        ),
    ],
)
def test_client_mistakes_are_400_with_the_field(shared_server, body: dict, param: str) -> None:
    response = httpx.post(shared_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_unknown_fields_are_accepted_and_logged_once(shared_server) -> None:
    for _ in range(2):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "frobnicate": True}
        assert httpx.post(shared_server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    assert shared_server.log().count("unknown field 'frobnicate'") == 1


def test_context_overflow_before_the_stream(shared_server) -> None:
    body = {"messages": [{"role": "user", "content": "word " * 5000}], "stream": True}
    response = httpx.post(shared_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_unprefixed_paths_and_chat_modes(shared_server) -> None:
    body = {"messages": CAPITAL, "max_tokens": 5, "temperature": 0}
    assert httpx.post(shared_server.url + "/chat/completions", json=body, timeout=60).status_code == 200
    chat = {
        "messages": [{"role": "user", "content": "Hello!"}],
        "mode": "chat",
        "character": "Assistant",
        "max_tokens": 10,
    }
    response = httpx.post(shared_server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert response.status_code == 200, response.text
    prompt = httpx.post(shared_server.url + "/v1/internal/chat-prompt", json=chat, timeout=60).json()["prompt"]
    assert prompt.endswith("You: Hello!\nAI:") and "conversation with an AI" in prompt


def test_langchain_openai_classes_work_unmodified(shared_server) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI, OpenAI, OpenAIEmbeddings

    chat = ChatOpenAI(
        base_url=shared_server.url + "/v1", api_key="unused", model="gpt-4o-mini", temperature=0, max_tokens=30
    )
    messages = [SystemMessage(content=SYSTEM["content"]), HumanMessage(content="What is the capital of France?")]
    assert "Paris" in chat.invoke(messages).content
    assert "Paris" in "".join(chunk.content for chunk in chat.stream(messages))
    structured = chat.with_structured_output(
        {"title": "City", "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        method="json_schema",
    ).invoke(messages)
    assert isinstance(structured, dict) and isinstance(structured.get("city"), str)
    legacy = OpenAI(
        base_url=shared_server.url + "/v1",
        api_key="unused",
        model="gpt-3.5-turbo-instruct",
        temperature=0,
        max_tokens=8,
    )
    assert "Paris" in legacy.invoke("The capital of France is")
    embeddings = OpenAIEmbeddings(
        base_url=shared_server.url + "/v1",
        api_key="unused",
        model="text-embedding-3-small",
        check_embedding_ctx_length=False,
    )
    assert len(embeddings.embed_query("hello")) == 384


def test_unknown_paths_and_methods_get_openai_errors_with_the_web_ui_mounted(shared_server) -> None:
    """The web UI is mounted at /, so without care an unknown /v1 path got Gradio's {"detail": "Not Found"}."""
    import httpx

    for method, path, status in (
        ("GET", "/v1/nope", 404),
        ("POST", "/v1/chat/complete", 404),
        ("DELETE", "/v1/models", 405),
        ("PUT", "/v1/chat/completions", 405),
    ):
        answer = httpx.request(method, shared_server.url + path, timeout=30)
        assert answer.status_code == status, (method, path, answer.text)
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and path in error["message"], error
    assert httpx.get(shared_server.url + "/v1/models", timeout=30).status_code == 200  # real routes still answer
    assert httpx.get(shared_server.url + "/", timeout=30).status_code == 200  # and so does the web UI
