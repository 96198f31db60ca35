"""What the remote backend sends each engine for constrained output and samplers (the engines themselves are in
tests/integration: test_vllm.py against a real vLLM, test_remote_engines.py)."""

from __future__ import annotations

from modules.generation.params import GenerationParams
from modules.loaders.remote import RemoteBackend, _chunk_events


def body(dialect: str, version: tuple[int, ...] = (), **params: object) -> dict:
    backend = RemoteBackend()
    backend.dialect, backend.engine_version, backend.model_id = dialect, version, "m"
    return backend._body([1, 2], GenerationParams(**params), {"prompt_text": "hi"})  # type: ignore[arg-type]


def test_current_vllm_gets_structured_outputs_and_token_ids() -> None:
    schema = {"type": "object"}
    sent = body("vllm", (0, 32, 0), json_schema=schema)
    assert sent["structured_outputs"] == {"json": schema} and sent["return_token_ids"] is True
    assert not any(key.startswith("guided_") or key == "json_schema" for key in sent)
    assert body("vllm", (0, 32, 0), regex="[0-9]+")["structured_outputs"] == {"regex": "[0-9]+"}
    assert body("vllm", (0, 32, 0), grammar='root ::= "a"')["structured_outputs"] == {"grammar": 'root ::= "a"'}
    sent = body("vllm", (0, 32, 0), ban_eos=True, top_k=5, min_tokens=3, logit_bias={7: -1000.0})
    assert sent["ignore_eos"] and sent["top_k"] == 5 and sent["min_tokens"] == 3 and sent["logit_bias"] == {"7": -100.0}
    assert "structured_outputs" not in body("vllm", (0, 32, 0))


def test_older_vllm_gets_the_guided_fields() -> None:
    sent = body("vllm", (0, 9, 2), json_schema={"type": "object"})
    assert sent["guided_json"] == {"type": "object"} and "structured_outputs" not in sent
    assert "return_token_ids" not in sent
    assert body("vllm", (0, 10, 1), regex="x")["guided_regex"] == "x"


def test_trtllm_keeps_its_response_format() -> None:
    assert body("trtllm", json_schema={"type": "object"})["response_format"] == {
        "type": "json",
        "schema": {"type": "object"},
    }
    assert body("trtllm", grammar='root ::= "a"')["response_format"] == {"type": "ebnf", "ebnf": 'root ::= "a"'}


def test_a_chunk_with_token_ids_is_one_event_per_token_with_its_logprob() -> None:
    chunk = {
        "choices": [
            {
                "text": " Paris.",
                "token_ids": [7042, 30],
                "logprobs": {
                    "tokens": [" Paris", "."],
                    "token_logprobs": [-0.1, -0.5],
                    "top_logprobs": [{" Paris": -0.1}, {".": -0.5}],
                },
                "finish_reason": "stop",
            }
        ]
    }
    events, finish = _chunk_events(chunk, "length")
    assert [e.token_id for e in events] == [7042, 30] and finish == "stop"
    assert [e.piece for e in events] == [b" Paris", b"."] and [e.logprob for e in events] == [-0.1, -0.5]
    assert events[1].top_logprobs and events[1].top_logprobs[0].logprob == -0.5
    del chunk["choices"][0]["logprobs"]
    events, _ = _chunk_events(chunk, "length")
    assert [e.piece for e in events] == [b" Paris.", b""] and events[0].logprob is None  # the text on the first


def test_a_vllm_prompt_is_sent_as_the_token_ids_counted_with_the_engines_bos() -> None:
    """vLLM adds BOS to a text prompt on its own: sent as text, a prompt counted without it would be one token
    longer at the engine than here, and a reply sized to the context's end would be refused."""
    from modules.generation.pipeline import encode_prompt

    def tokenizer(bos: bool):  # type: ignore[no-untyped-def]
        backend = RemoteBackend()
        backend.dialect, backend._tokenizer, backend.engine_version, backend.model_id = "vllm", "vllm", (0, 32), "m"
        backend.encode = lambda text, add_special=True: ([1] if add_special and bos else []) + [ord(c) for c in text]  # type: ignore[method-assign]
        backend.decode = lambda ids: "<s>" if ids == [1] else "".join(map(chr, ids))  # type: ignore[method-assign]
        backend._learn_bos()
        return backend

    llama = tokenizer(bos=True)
    assert llama.metadata.add_bos_token and llama.metadata.bos_token == "<s>" and llama.metadata.bos_token_id == 1
    ids = encode_prompt(llama, "hi")
    assert ids == [1, 104, 105]
    assert llama._body(ids, GenerationParams(), {"prompt_text": "hi"})["prompt"] == [1, 104, 105]
    assert encode_prompt(llama, "<s>hi") == [60, 115, 62, 104, 105]  # a template that wrote BOS gets no second one

    smol = tokenizer(bos=False)
    assert not smol.metadata.add_bos_token and encode_prompt(smol, "hi") == [104, 105]
    assert smol._body([104, 105], GenerationParams(), {"prompt_text": "hi"})["prompt"] == [104, 105]
