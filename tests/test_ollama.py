"""Ollama's API on `edgespec serve`, judged by the official `ollama` Python library (unmodified)
against a server on loopback (SmolLM2 drafting for itself): chat and generate, whole and
streamed as NDJSON, JSON formats, a tool round trip, the model endpoints and Ollama's errors."""

from __future__ import annotations

import hashlib
import json

import httpx
import ollama
import pytest
from pydantic import BaseModel
from reference import reference_for
from test_server import CTX, HELLO, Server

from edgespec.resolve import resolve_model

GREEDY = {"temperature": 0, "num_predict": 16}


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    assert s.stop() == 0
    assert not any(" 500 " in line or "failed on the server's side" in line for line in s.lines), "".join(s.lines)


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url.removesuffix("/v1"), timeout=300)


def llama_says(smollm2, prompt, *, raw: bool, limit: int) -> str:
    """Llama's greedy answer to a prompt (text, or a conversation in the file's template), as text."""
    reference = reference_for(smollm2)
    return reference.llm.detokenize(reference.greedy(reference.prompt(prompt, raw), limit)).decode()


def test_chat_whole_and_streamed_is_llamas_greedy_answer(client, smollm2):
    whole = client.chat(model="smollm2", messages=HELLO, options=GREEDY)
    assert whole.message.role == "assistant" and whole.message.content == llama_says(
        smollm2, HELLO, raw=False, limit=16
    )
    assert whole.done and whole.done_reason in ("stop", "length") and whole.eval_count > 0
    assert whole.prompt_eval_count > 0 and whole.total_duration >= whole.eval_duration > 0
    parts = list(client.chat(model="smollm2", messages=HELLO, options=GREEDY, stream=True))
    assert len(parts) > 2 and not any(p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count


def test_generate_raw_templated_and_a_load_request(client, server, smollm2):
    text = "The capital of France is"
    raw = client.generate(model="smollm2", prompt=text, raw=True, options=GREEDY | {"num_predict": 8})
    # (Ollama's /api/generate does not heal the prompt: llama-server's /completion does)
    assert raw.response == llama_says(smollm2, text, raw=True, limit=8) and raw.done_reason == "length"
    templated = client.generate(model="smollm2", prompt=HELLO[0]["content"], options=GREEDY)
    assert templated.response == llama_says(smollm2, HELLO, raw=False, limit=16)
    streamed = "".join(
        p.response for p in client.generate(model="smollm2", prompt=text, raw=True, options=GREEDY, stream=True)
    )
    assert streamed.startswith(raw.response)
    assert client.generate(model="smollm2", prompt="").done_reason == "load"  # Ollama's way to load a model
    with httpx.stream("POST", server.url.removesuffix("/v1") + "/api/chat", json={"messages": HELLO}, timeout=60) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] and all(not line["done"] for line in lines[:-1])
    assert lines[-1]["speculative"]["n_tokens"] == lines[-1]["eval_count"]  # and what speculation did


class Person(BaseModel):
    name: str
    born: int


def test_json_format_and_schema(client):
    ask = [{"role": "user", "content": "Ada Lovelace was born in 1815. Give her name and birth year as JSON."}]
    held = client.chat(model="smollm2", messages=ask, format=Person.model_json_schema(), options={"temperature": 0})
    assert Person.model_validate_json(held.message.content).born == 1815
    loose = client.generate(model="smollm2", prompt=ask[0]["content"], format="json", options={"temperature": 0})
    assert loose.done_reason == "stop" and isinstance(json.loads(loose.response), dict)


def get_weather(city: str) -> str:
    """Get the weather in a city.

    Args:
      city: The city
    """
    return "18 C, clear"


def test_a_tool_round_trip(client):
    """The model's call (held to the call's JSON by `format`, as Qwen2.5-Coder writes it unheld)
    comes back as Ollama's tool_calls with object arguments; the call and its result in the
    history are read back, and the answer goes on."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    call = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": city}}
    call["required"] = ["name", "arguments"]
    first = client.chat(model="smollm2", messages=ask, tools=[get_weather], format=call, options={"temperature": 0})
    (made,) = first.message.tool_calls
    assert made.function.name == "get_weather" and isinstance(made.function.arguments["city"], str)
    result = {"role": "tool", "content": get_weather(**made.function.arguments), "tool_name": "get_weather"}
    answer = client.chat(model="smollm2", messages=[*ask, first.message, result], tools=[get_weather], options=GREEDY)
    assert answer.done and (answer.message.content or answer.message.tool_calls)
    uncalled = {"role": "assistant", "content": first.message.content or ""}
    without = client.chat(
        model="smollm2", messages=[*ask, uncalled, result], tools=[get_weather], options=GREEDY | {"num_predict": 1}
    )
    assert answer.prompt_eval_count > without.prompt_eval_count  # the call was read into the prompt


def test_model_endpoints(client, smollm2):
    path = resolve_model("smollm2-135m")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    (listed,) = client.list().models
    assert listed.digest == digest and listed.size == path.stat().st_size
    assert listed.details.format == "gguf" and listed.details.family == "llama"
    assert listed.details.quantization_level == "Q4_1" and listed.details.parameter_size == "135M"
    (running,) = client.ps().models
    assert running.digest == digest and running.context_length == CTX
    shown = client.show(listed.model)
    template = reference_for(smollm2).llm.metadata["tokenizer.chat_template"]
    assert shown.template == template and "completion" in shown.capabilities and "insert" not in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "llama"


@pytest.mark.parametrize(
    "ask, words",
    [
        ({"think": True}, "'think': this model does not think"),
        ({"options": {"mirostat": 2}}, "'mirostat' is not supported"),
        ({"options": {"num_predict": -5}}, "num_predict"),
        ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "reads text only"),
    ],
)
def test_refusals_come_as_ollama_errors(client, ask, words):
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(**({"model": "smollm2", "messages": HELLO} | ask))
    assert refused.value.status_code == 400 and words in refused.value.error


def test_version(client, server):
    version = httpx.get(server.url.removesuffix("/v1") + "/api/version", timeout=30).json()["version"]
    assert tuple(int(v) for v in version.split(".")) >= (0, 5, 0)
