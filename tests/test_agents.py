"""Agents on `edgespec serve`: Anthropic's Messages API (Claude Code) and OpenAI's Responses
API (Codex, the OpenAI Agents SDK), served by the SmolLM2 pair and read with the official
`anthropic` and `openai` SDKs, raw HTTP and the request bodies recorded from the clients
(../shared/clients); the prompt cache across an agent's requests and across restarts."""

from __future__ import annotations

import json
import secrets

import anthropic
import httpx
import openai
import pytest
from test_clients import recorded
from test_server import Server

from edgespec.cache import cache_dir

pytestmark = pytest.mark.slow  # real agents' clients against a server

CTX = 8192  # SmolLM2's trained context: Claude Code's first request (20k tokens) does not fit it
KEY = "sk-edgespec-test"
GREEDY = {"extra_body": {"temperature": 0}}  # the anthropic SDK sends no sampling settings of its own
HELLO = [{"role": "user", "content": "Say hello in three words."}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "The weather in a city now", "input_schema": CITY}
RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "description": "The weather now", "parameters": CITY}


@pytest.fixture(scope="module")
def server():
    s = Server("--pair", "smollm2-self", "--ctx", str(CTX), "--api-key", KEY, "--temperature", "0")
    yield s
    assert s.stop() == 0
    assert not any(" 500 " in line or "failed on the server's side" in line for line in s.lines), "".join(s.lines)


def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key=KEY, max_retries=0, timeout=600)


def events(response: httpx.Response) -> list[tuple[str, dict]]:
    """A server-sent event stream as (event name, data), its comments (keep-alives) skipped."""
    out = []
    for block in response.text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
        if fields:
            out.append((fields.get("event"), json.loads(fields["data"])))
    return out


def post(server, recording: dict, body: dict) -> httpx.Response:
    """A recorded request as its client sent it (path, headers), with this body and our key."""
    headers = {k: v for k, v in recording["headers"].items() if k.lower() != "content-type"}
    url = server.url.removesuffix("/v1") + recording["path"]
    return httpx.post(url, json=body, headers=headers | {"x-api-key": KEY}, timeout=600)


def trimmed_claude_code(max_tokens: int = 24) -> dict:
    """Claude Code's recorded request with fewer, shorter tools and its agent list cut, so that it
    fits SmolLM2's context (everything else as the client sent it: billing header, thinking, ...)."""
    body = recorded("claude-code-messages.json")["body"]
    tools = [t | {"description": t["description"][:300]} for t in body["tools"] if t["name"] in ("Bash", "Read")]
    messages = [m | {"content": m["content"][:800]} if m["role"] == "system" else m for m in body["messages"]]
    return body | {"tools": tools, "messages": messages, "max_tokens": max_tokens}


# --- Anthropic's Messages API --------------------------------------------------------


def test_messages_whole_and_streamed_agree(server):
    client = claude(server)
    message = client.messages.create(model="x", system="Be brief.", messages=HELLO, max_tokens=24, **GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens") and 0 < message.usage.output_tokens <= 24
    with client.messages.stream(model="x", system="Be brief.", messages=HELLO, max_tokens=24, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == message.content[0].text and final.usage.output_tokens == message.usage.output_tokens
    assert final.usage.cache_read_input_tokens > 0  # the second request reused the first one's prefix
    total = final.usage.input_tokens + final.usage.cache_read_input_tokens
    assert total == message.usage.input_tokens + message.usage.cache_read_input_tokens
    counted = client.messages.count_tokens(model="x", system="Be brief.", messages=HELLO)
    assert counted.input_tokens == total


def test_messages_stop_sequences_and_max_tokens(server):
    client = claude(server)
    sea = [{"role": "user", "content": "Write two sentences about the sea."}]
    whole = client.messages.create(model="x", messages=sea, max_tokens=60, **GREEDY).content[0].text
    stopped = client.messages.create(model="x", messages=sea, max_tokens=60, stop_sequences=["e"], **GREEDY)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "e")
    assert "e" in whole and stopped.content[0].text == whole[: whole.index("e")]  # the text before it, all of it
    capped = client.messages.create(model="x", messages=sea, max_tokens=3, **GREEDY)
    assert capped.stop_reason == "max_tokens" and capped.usage.output_tokens == 3


def test_messages_tool_use_round_trip(server):
    client = claude(server)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "tool", "name": "get_weather"}
    first = client.messages.create(model="x", messages=ask, tools=[WEATHER], tool_choice=forced, max_tokens=60)
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input, dict)
    with client.messages.stream(
        model="x", messages=ask, tools=[WEATHER], tool_choice={"type": "any"}, max_tokens=60
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and [b.name for b in streamed.content if b.type == "tool_use"]
    result = {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18 C, clear"}]}
    history = [*ask, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    answer = client.messages.create(model="x", messages=history, tools=[WEATHER], max_tokens=30, **GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    assert answer.usage.cache_read_input_tokens > 0


def test_messages_structured_output(server):
    person = {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"}}}
    person["required"] = ["name", "born"]
    ask = [{"role": "user", "content": "Ada Lovelace was born in 1815. Who, and when?"}]
    schema = {"format": {"type": "json_schema", "schema": person}}
    message = claude(server).messages.create(model="x", messages=ask, max_tokens=60, output_config=schema, **GREEDY)
    found = json.loads(message.content[0].text)
    assert set(found) == {"name", "born"} and isinstance(found["born"], int)


def test_serve_temperature_is_that_of_requests_that_set_none(server):
    """`serve --temperature 0`: requests without one are greedy (the target alone here, one token a
    pass, so the two answers are computed alike); a request's own temperature wins."""
    client = claude(server)
    sea = [{"role": "user", "content": "Write a sentence about the sea."}]
    alone = {"draft_mode": "off"}
    greedy = {client.messages.create(model="x", messages=sea, max_tokens=16, extra_body=alone).content[0].text}
    greedy.add(client.messages.create(model="x", messages=sea, max_tokens=16, extra_body=alone).content[0].text)
    assert len(greedy) == 1
    hot = [alone | {"temperature": 1.5, "seed": seed} for seed in (1, 2, 3)]
    sampled = {
        client.messages.create(model="x", messages=sea, max_tokens=16, extra_body=b).content[0].text for b in hot
    }
    assert len(sampled) > 1


def test_messages_refusals_come_in_anthropic_shape(server):
    base = server.url.removesuffix("/v1")
    no_limit = httpx.post(f"{base}/v1/messages", json={"messages": HELLO}, headers={"x-api-key": KEY}, timeout=60)
    assert no_limit.status_code == 400 and no_limit.json()["type"] == "error"
    assert no_limit.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in no_limit.text
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    seeing = {"messages": [{"role": "user", "content": [image]}], "max_tokens": 5}
    refused = httpx.post(f"{base}/v1/messages", json=seeing, headers={"x-api-key": KEY}, timeout=60)
    assert refused.status_code == 400 and "'image'" in refused.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
            model="x", messages=HELLO, max_tokens=5
        )
    assert wrong.value.body["error"]["type"] == "authentication_error"


def test_claude_code_first_request_gets_a_context_error_it_understands(server):
    """Claude Code's recorded request (20k tokens of system prompt and tools) in SmolLM2's 8k
    context: a 400 in Anthropic's error JSON, in its words, streamed or not; count_tokens counts it."""
    recording = recorded("claude-code-messages.json")
    for stream in (True, False):
        response = post(server, recording, recording["body"] | {"stream": stream})
        assert response.status_code == 400 and response.json()["type"] == "error", response.text
        message = response.json()["error"]["message"]
        assert (
            message.startswith("prompt is too long: ")
            and f"> {CTX} maximum" in message
            and "--ctx" in message
            and "--parallel 1" in message
        )
    counting = {k: v for k, v in recording["body"].items() if k not in ("max_tokens", "stream")}
    recording = recording | {"path": "/v1/messages/count_tokens?beta=true"}
    assert post(server, recording, counting).json()["input_tokens"] > CTX


def test_claude_code_request_streams_as_claude_code_reads_it(server):
    recording = recorded("claude-code-messages.json")
    response = post(server, recording, trimmed_claude_code())
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    stream = events(response)
    names = [name for name, _ in stream]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    assert all(name == data["type"] for name, data in stream)
    starts = [d["index"] for n, d in stream if n == "content_block_start"]
    assert starts == [d["index"] for n, d in stream if n == "content_block_stop"] == list(range(len(starts)))
    closing = stream[-2][1]
    assert closing["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    assert 0 < closing["usage"]["output_tokens"] <= 24 and "speculative" in closing


def test_an_agent_session_reuses_its_prompt_though_the_billing_header_changes(server):
    """Claude Code's second request: the same system prompt and tools, a new cch= nonce in the
    billing header, the conversation longer by one exchange: ≥ 90% of it read from the cache."""
    recording = recorded("claude-code-messages.json")
    first = post(server, recording, trimmed_claude_code() | {"stream": False}).json()
    body = trimmed_claude_code()
    body["system"] = [{"type": "text", "text": f"{body['system'][0]['text']} cch={secrets.token_hex(3)};"}]
    body["system"] += recorded("claude-code-messages.json")["body"]["system"][1:]
    body["messages"] = [
        *body["messages"],
        {"role": "assistant", "content": first["content"] or [{"type": "text", "text": "Done."}]},
        {"role": "user", "content": "Now list the files here."},
    ]
    usage = post(server, recording, body | {"stream": False}).json()["usage"]
    assert usage["cache_read_input_tokens"] >= 0.9 * (usage["input_tokens"] + usage["cache_read_input_tokens"]), usage


# --- OpenAI's Responses API ----------------------------------------------------------


def test_openai_agents_responses_request_whole_and_streamed(server):
    body = recorded("openai-agents-responses.json")["body"] | {"max_output_tokens": 40, "temperature": 0}
    client = server.client(api_key=KEY)
    response = client.responses.create(**body)
    assert response.id.startswith("resp_") and response.status in ("completed", "incomplete")
    assert response.output and response.usage.output_tokens <= 40
    streamed = list(client.responses.create(**body, stream=True))
    kinds = [e.type for e in streamed]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in streamed] == list(range(1, len(streamed) + 1))
    final = streamed[-1].response
    assert (
        final.output_text
        == response.output_text
        == "".join(e.delta for e in streamed if e.type == "response.output_text.delta")
    )
    assert final.usage.input_tokens_details.cached_tokens > 0
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == len(final.output)


def test_codex_request_is_answered_streamed_and_whole(server):
    """Codex's recorded request (6.4k of SmolLM2's tokens: it fits), streamed as Codex reads it,
    then whole (its prompt read from the cache); its custom, namespace and web_search tools are
    left out with a line in the log."""
    recording = recorded("codex-responses.json")
    response = post(server, recording, recording["body"] | {"max_output_tokens": 16, "temperature": 0})
    assert response.status_code == 200, response.text
    stream = events(response)
    assert stream[0][0] == "response.created" and stream[-1][0] in ("response.completed", "response.incomplete")
    done = [d["item"] for n, d in stream if n == "response.output_item.done"]
    assert done == stream[-1][1]["response"]["output"] and done
    usage = stream[-1][1]["response"]["usage"]
    assert usage["output_tokens"] <= 16 and usage["input_tokens"] > 6000
    assert any("of type namespace left out" in line for line in server.lines)
    whole = post(server, recording, recording["body"] | {"stream": False, "max_output_tokens": 16}).json()
    assert whole["object"] == "response" and whole["output"] and whole["usage"]["input_tokens"] == usage["input_tokens"]
    assert whole["usage"]["input_tokens_details"]["cached_tokens"] >= 0.9 * usage["input_tokens"]


def test_responses_function_call_round_trip_and_previous_response(server):
    client = server.client(api_key=KEY)
    ask = "What is the weather in Paris?"
    first = client.responses.create(
        model="x", input=ask, tools=[RESPONSES_WEATHER], tool_choice="required", max_output_tokens=60
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, clear"}
    history = [{"role": "user", "content": ask}, *[i.model_dump(exclude_none=True) for i in first.output], result]
    stateless = client.responses.create(
        model="x", input=history, tools=[RESPONSES_WEATHER], store=False, max_output_tokens=30, temperature=0
    )
    assert stateless.output and stateless.usage.input_tokens_details.cached_tokens > 0
    continued = client.responses.create(
        model="x", previous_response_id=first.id, input=[result], tools=[RESPONSES_WEATHER], max_output_tokens=30
    )
    assert continued.usage.input_tokens == stateless.usage.input_tokens  # the same conversation
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="x", previous_response_id=stateless.id, input="And Rome?")


def test_responses_auto_agent_loop_gets_the_call_the_model_wrote(server):
    """tool_choice auto; the model (held to it here by text.format, as Qwen2.5-Coder writes it
    unheld) answers with a bare JSON call: the agent gets a function_call item."""
    client = server.client(api_key=KEY)
    call = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": CITY}}
    call["required"] = ["name", "arguments"]
    held = {"format": {"type": "json_schema", "name": "call", "schema": call}}
    response = client.responses.create(
        model="x", input="Weather in Paris?", tools=[RESPONSES_WEATHER], text=held, max_output_tokens=60, temperature=0
    )
    assert [(i.type, i.name) for i in response.output] == [("function_call", "get_weather")], response.output


# --- the prompt cache across restarts -----------------------------------------------


def test_the_prompt_cache_outlives_a_restart():
    """A server keeps its prompt cache on disk when it stops and the next one starts with it: the
    first request after a restart reads its prompt from the cache. A file that does not verify when
    a prompt reads it is set aside, said in the log, and the server answers."""
    system = f"Session {secrets.token_hex(8)}. " + "You answer questions about the sea. " * 60
    ask = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    again = [*ask[:1], {"role": "user", "content": "Hello there"}]
    first = Server("--pair", "smollm2-self", "--ctx", "2048")
    try:
        cold = first.client().chat.completions.create(model="x", messages=ask, max_tokens=4).usage
    finally:
        assert first.stop() == 0
    assert cold.prompt_tokens_details.cached_tokens < 0.5 * cold.prompt_tokens
    assert any("kept on disk" in line for line in first.lines), "".join(first.lines)
    second = Server("--pair", "smollm2-self", "--ctx", "2048")
    try:
        warm = second.client().chat.completions.create(model="x", messages=again, max_tokens=4).usage
    finally:
        assert second.stop() == 0
    assert any("loaded from disk" in line for line in second.lines), "".join(second.lines)
    assert warm.prompt_tokens_details.cached_tokens >= 0.9 * warm.prompt_tokens, warm

    kept = sorted((cache_dir() / "prompts").glob("*/*.state"), key=lambda p: p.stat().st_mtime)
    damaged = kept[-1]
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    third = Server("--pair", "smollm2-self", "--ctx", "2048")
    try:  # (a file's data is checked when a prompt reads it)
        third.client().chat.completions.create(model="x", messages=again, max_tokens=4)
        assert not damaged.exists() and damaged.with_suffix(".damaged").exists()
    finally:
        assert third.stop() == 0
    assert any(f"{damaged.name} does not verify; set aside" in line for line in third.lines), "".join(third.lines)


# --- keep-alives ---------------------------------------------------------------------


def test_silent_streams_get_keepalives_that_clients_skip(monkeypatch):
    """While no chunk is ready (an agent's long prompt being read), a stream gets keep-alives:
    Anthropic's ping event, an SSE comment on the OpenAI APIs; the SDKs read the answers
    through them. (A keep-alive every millisecond here, so every wait has some.)"""
    from starlette.testclient import TestClient

    import edgespec
    from edgespec.server import app as serving

    monkeypatch.setattr(serving, "KEEPALIVE_S", 0.001)
    worker = serving.Worker(lambda: edgespec.load("smollm2-self", n_ctx=1024))
    worker.wait_loaded()
    with TestClient(serving.Api(worker, "smollm2", None, None).app()) as http:
        body = {"messages": HELLO, "max_tokens": 12, "temperature": 0, "stream": True}
        raw = http.post("/v1/messages", json=body).text
        assert "event: ping" in raw and "event: message_stop" in raw
        raw = http.post("/v1/chat/completions", json=body).text
        assert ": keep-alive\n\n" in raw and raw.endswith("data: [DONE]\n\n")

        base = str(http.base_url).rstrip("/")
        client = anthropic.Anthropic(base_url=base, api_key="x", http_client=http, max_retries=0)
        with client.messages.stream(model="x", messages=HELLO, max_tokens=12, **GREEDY) as stream:
            streamed = "".join(stream.text_stream)
        whole = client.messages.create(model="x", messages=HELLO, max_tokens=12, **GREEDY)
        assert streamed == whole.content[0].text
        responses = openai.OpenAI(base_url=f"{base}/v1", api_key="x", http_client=http, max_retries=0)
        events = list(responses.responses.create(model="x", input="Hi", max_output_tokens=12, stream=True))
        assert events[-1].type in ("response.completed", "response.incomplete")
