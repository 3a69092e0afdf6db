"""What real assistants send (request bodies recorded from aider, llm and langchain in
../shared/clients), served by `edgespec serve` on the SmolLM2 pair and read with the
official `openai` client: whole answers without max_tokens, usage, tool calls, and the
prompt cache across alternating conversations."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from test_server import Server

from edgespec.tools import ToolCallParser, ToolChoice

pytestmark = pytest.mark.slow  # real clients against a server

CTX = 2048  # room for aider's 1,684-token prompt (SmolLM2's tokens) and its answer
CLIENTS = Path(__file__).resolve().parents[2] / "shared" / "clients"
if not CLIENTS.is_dir():  # CI's clone sits beside shared/ too; a checkout elsewhere may not
    CLIENTS = Path(__file__).resolve().parents[1] / "shared" / "clients"


def recorded(name: str) -> dict:
    path = CLIENTS / name
    if not path.is_file():
        missing = f"no recorded client request {name} at {CLIENTS}"
        if os.environ.get("CI") == "true":  # CI always has them: a missing one is a broken setup, not a skip
            pytest.fail(missing)
        pytest.skip(missing)
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def server():
    s = Server("--pair", "smollm2-self", "--ctx", str(CTX))
    yield s
    assert s.stop() == 0
    assert not any(" 500 " in line or "failed on the server's side" in line for line in s.lines), "".join(s.lines)


def test_aider_whole_edit_streams_to_its_natural_end(server):
    """Without max_tokens the answer ends where the model stops, or where the context is full
    (SmolLM2 may loop on aider's prompt: which one depends on float near-ties), never earlier."""
    body = recorded("aider-whole-edit.json")
    assert "max_tokens" not in body and body["stream"] is True
    finish = usage = None
    for chunk in server.client().chat.completions.create(**body, stream_options={"include_usage": True}):
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert finish == "stop" or (finish == "length" and usage.total_tokens >= CTX), (finish, usage)


def test_no_max_tokens_means_until_the_context_is_full():
    """Counting never ends: without max_tokens the answer runs past the old 512-token cap (in a
    context just long enough: the answer fills it)."""
    ctx = 768  # (llama.cpp rounds a context up to a multiple of 256)
    s = Server("--pair", "smollm2-self", "--ctx", str(ctx))
    try:
        prompt = ", ".join(str(i) for i in range(1, 41)) + ","
        reply = s.client().completions.create(model="x", prompt=prompt, temperature=0)
    finally:
        assert s.stop() == 0
    assert reply.usage.completion_tokens > 512
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens <= ctx + 1  # the last token needs no cache cell
    assert reply.choices[0].finish_reason == "length" and reply.model_extra["speculative"]["finish_reason"] == "context"


def test_llm_plain_reads_usage(server):
    reply = server.client().chat.completions.create(**recorded("llm-plain.json"))
    assert reply.usage.completion_tokens <= 200 and reply.usage.prompt_tokens > 0
    assert reply.choices[0].message.content


def test_llm_stream_gets_a_usage_chunk(server):
    chunks = list(server.client().chat.completions.create(**recorded("llm-stream.json")))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 150
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_langchain_invoke_honours_max_completion_tokens(server):
    reply = server.client().chat.completions.create(**recorded("langchain-invoke.json"))
    assert 0 < reply.usage.completion_tokens <= 200


def test_langchain_tools_round_trip(server):
    body = recorded("langchain-tools.json")
    client = server.client()
    reply = client.chat.completions.create(**body)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)

    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": "Paris", "celsius": 18})}
    history = [*body["messages"], choice.message.model_dump(exclude_none=True), result]
    final = client.chat.completions.create(
        model="x", messages=history, tools=body["tools"], temperature=0, max_tokens=40
    )
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content


def test_tool_calls_stream_as_deltas(server):
    body = recorded("langchain-tools.json") | {"stream": True}
    chunks = list(server.client().chat.completions.create(**body))
    calls = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments), dict)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_tool_choice_required_and_none(server):
    body = recorded("langchain-tools.json")
    client = server.client()
    required = client.chat.completions.create(**(body | {"tool_choice": "required"}))
    assert required.choices[0].finish_reason == "tool_calls"
    none = client.chat.completions.create(**(body | {"tool_choice": "none"}))
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason != "tool_calls"


@pytest.mark.parametrize(
    "change, word",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_bad_tools_get_a_400(server, change, word):
    response = server.post("/chat/completions", json=recorded("langchain-tools.json") | change)
    assert response.status_code == 400 and word in response.json()["error"]["message"]


def test_alternating_conversations_reuse_their_prompts(server):
    client = server.client()
    aider = recorded("aider-whole-edit.json")
    other = [
        {"role": "system", "content": "You answer questions about the sea. " * 20},
        {"role": "user", "content": "Hi"},
    ]

    def ask(messages):
        return client.chat.completions.create(model="x", messages=messages, temperature=0, max_tokens=8).usage

    ask(aider["messages"])
    ask([{"role": "user", "content": "Hi"}])  # other conversations in between, a short one too
    ask(other)
    follow_up = [*aider["messages"][:-1], {"role": "user", "content": "Also rename x to item. Change nothing else."}]
    usage = ask(follow_up)
    assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens, usage
    again = ask(other)
    assert again.prompt_tokens_details.cached_tokens >= 0.9 * again.prompt_tokens, again


def test_models_report_the_context(server):
    (model,) = server.client().models.list().data
    assert model.model_extra["meta"]["n_ctx"] == model.model_extra["max_model_len"] == CTX
    assert any(f"context {CTX} tokens" in line for line in server.lines)


def test_parser_keeps_bad_json_as_text():
    parser = ToolCallParser()
    shown, calls = parser.feed('Sure. <tool_call>\n{"name": "f", "arguments": {oops}}\n</tool_call> done')
    assert calls == [] and "oops" in shown and shown.startswith("Sure. ")
    forced = ToolCallParser(ToolChoice("function", "f").opening)
    text, calls = forced.feed('{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert text == "" and calls[0].name == "f" and json.loads(calls[0].arguments) == {"x": 1}
    split = ToolCallParser()
    first, _ = split.feed("hello <tool_")
    rest, calls = split.feed('call>{"name": "g", "arguments": {}}</tool_call>')
    assert first == "hello " and rest == "" and calls[0].name == "g"


def test_cache_ram_zero_keeps_only_the_live_prompt():
    s = Server("--pair", "smollm2-self", "--ctx", "1024", "--cache-ram", "0")
    try:
        sea = "You answer questions about the sea. " * 20
        long = [{"role": "system", "content": sea}, {"role": "user", "content": "Hi"}]
        client = s.client()
        for messages in (long, [{"role": "user", "content": "Hi"}]):
            client.chat.completions.create(model="x", messages=messages, temperature=0, max_tokens=4)
        usage = client.chat.completions.create(model="x", messages=long, temperature=0, max_tokens=4).usage
        assert usage.prompt_tokens_details.cached_tokens < 0.5 * usage.prompt_tokens
    finally:
        assert s.stop() == 0


# --- the calls small models write their own way (auto) -----------------------------

WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
LOOSE_FORMS = [
    f"```json\n{WEATHER_CALL}\n```",
    f"```\n{WEATHER_CALL}\n```",
    f"```xml\n<tool_call>\n{WEATHER_CALL}\n</tool_call>\n```",
    WEATHER_CALL,
    f"  {WEATHER_CALL}\n\nI called the weather tool.",
    f"<function_call>{WEATHER_CALL}</function_call>",
    f"<tools>\n{WEATHER_CALL}\n</tools>",
    f"<json>{WEATHER_CALL}</json>",
    '<function=get_weather>{"city": "Paris"}</function>',
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
    f"<tool_call>\n```json\n{WEATHER_CALL}\n```\n</tool_call>",
]


def read_all(text: str, pieces: int, **options) -> tuple[str, list]:
    parser = ToolCallParser(**({"names": ["get_weather", "get_time"]} | options))
    step = max(1, len(text) // pieces)
    shown, calls = "", []
    for i in range(0, len(text), step):
        more, found = parser.feed(text[i : i + step])
        shown, calls = shown + more, calls + found
    rest, found = parser.finish()
    return shown + rest, calls + found


@pytest.mark.parametrize("text", LOOSE_FORMS)
@pytest.mark.parametrize("pieces", [1, 7, 1000])  # whole, in a few pieces, a character at a time
def test_the_calls_small_models_write_are_read_as_calls(text, pieces):
    shown, calls = read_all(text, pieces)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert shown.strip() in ("", "I called the weather tool.")


@pytest.mark.parametrize(
    "text",
    [
        '```json\n{"name": "send_mail", "arguments": {}}\n```',  # not a declared tool
        f"Here is how a call looks: {WEATHER_CALL}",  # not at the start
        '```python\nprint("hi")\n```',
        '{"city": "Paris"}',  # an answer in JSON, not a call
        '{"name": "get_weather", "arguments": {oops}}',
        "<json>just text</json>",
    ],
)
def test_other_text_stays_text(text):
    for pieces in (1, 5, 1000):
        assert read_all(text, pieces) == (text, [])


def test_several_loose_calls_at_the_start_and_parallel_off():
    two = f"```json\n{WEATHER_CALL}\n```\n```json\n" + '{"name": "get_time", "arguments": {}}\n```'
    assert [c.name for c in read_all(two, 9)[1]] == ["get_weather", "get_time"]
    assert [c.name for c in read_all(two, 9, parallel=False)[1]] == ["get_weather"]
    assert read_all(WEATHER_CALL, 3, names=[]) == (WEATHER_CALL, [])  # no tools declared: text


def test_an_auto_mode_agent_loop_gets_the_call_the_model_wrote_in_a_fence(server):
    """The openai-agents request (tool_choice auto, strict tools); the model (held to it here by
    a grammar, as Qwen2.5-Coder writes it unheld) answers with a ```json block: the agent gets a
    tool call, sends the result back, and gets a text answer."""
    body = recorded("openai-agents-chat.json")["body"]
    fenced = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'
    held = {"grammar": f"root ::= {json.dumps(fenced)}"}  # a GBNF literal is written as a JSON string is
    client = server.client()
    first = client.chat.completions.create(**body, temperature=0, extra_body=held)
    (call,) = first.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert first.choices[0].finish_reason == "tool_calls" and not first.choices[0].message.content
    streamed = client.chat.completions.create(**body, temperature=0, stream=True, extra_body=held)
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert [t.function.name for d in deltas for t in d.tool_calls or ()] == ["get_weather"]
    assert not "".join(d.content or "" for d in deltas)
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18, "sky": "clear"}'}
    history = [*body["messages"], first.choices[0].message.model_dump(exclude_none=True), result]
    answer = client.chat.completions.create(**(body | {"messages": history}), temperature=0, max_tokens=24)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")


def test_serve_max_tokens_caps_answers_without_a_limit():
    s = Server("--pair", "smollm2-self", "--ctx", "1024", "--max-tokens", "12")
    try:
        client = s.client()
        counting = ", ".join(str(i) for i in range(1, 30)) + ","
        capped = client.completions.create(model="x", prompt=counting, temperature=0)
        assert capped.usage.completion_tokens == 12 and capped.choices[0].finish_reason == "length"
        asked = client.completions.create(model="x", prompt=counting, temperature=0, max_tokens=20)
        assert asked.usage.completion_tokens == 20  # a request's own limit wins
    finally:
        assert s.stop() == 0


def test_an_answer_that_loops_says_so():
    s = Server("--pair", "smollm2-self", "--ctx", "1024")
    try:
        loop = 'root ::= "Paris" (", Paris")*'
        reply = s.client().completions.create(
            model="x", prompt="Cities:", temperature=0, max_tokens=120, extra_body={"grammar": loop}
        )
        stats = reply.model_extra["speculative"]
        assert stats["repeated_tokens"] >= 100 and 2 <= stats["repeat_period"] <= 8, stats  # ", Paris" in tokens
    finally:
        assert s.stop() == 0
    assert any("repeat one" in line and "looping" in line for line in s.lines), "".join(s.lines)


def test_in_ci_a_missing_recorded_client_fails_instead_of_skipping(monkeypatch, tmp_path):
    monkeypatch.setattr(sys.modules[__name__], "CLIENTS", tmp_path)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no recorded client request aider.json"):
        recorded("aider.json")
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception):
        recorded("aider.json")
