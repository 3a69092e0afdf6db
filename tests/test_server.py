"""`edgespec serve` for real: a server process on a free loopback port (SmolLM2 pair),
talked to with the official `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
from reference import assert_greedy_as_llama, reference_for

import edgespec
from edgespec import Request, Stats
from edgespec.cli import DEFAULT_PARALLEL
from edgespec.modes import DraftMode, Gamma
from edgespec.request import Defaults
from edgespec.run import Event
from edgespec.server.answers import Answer, Job
from edgespec.server.llama_api import request_of

CTX = 1024
HELLO = [{"role": "user", "content": "Say hello in three words."}]


START_S = 300  # a server that has not said its address by then has failed (its log is shown)


class Server:
    """`edgespec serve` in a process of its own, on a free port (the SmolLM2 pair unless
    told otherwise)."""

    def __init__(self, *extra: str) -> None:
        models = [] if {"--pair", "--target"} & set(extra) else ["--pair", "smollm2-self", "--ctx", str(CTX)]
        argv = [sys.executable, "-m", "edgespec", "serve", *models, "--port", "0"]
        self.process = subprocess.Popen([*argv, *extra], stderr=subprocess.PIPE, text=True, bufsize=1)
        self.lines: list[str] = []
        started = threading.Event()

        def read_log() -> None:
            for line in self.process.stderr:
                self.lines.append(line)
                if not started.is_set() and (match := re.search(r"OpenAI API at (\S+)", line)):
                    self.url = match.group(1)
                    started.set()
            started.set()  # the server ended: wait no longer

        threading.Thread(target=read_log, daemon=True).start()
        if not started.wait(START_S) or not hasattr(self, "url"):
            self.process.kill()
            ended = f"ended with {self.process.wait()}" if started.is_set() else f"did not start within {START_S} s"
            raise AssertionError(f"the server {ended}: " + "".join(self.lines))

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=kwargs.pop("api_key", "unused"), max_retries=0, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, timeout=60, **kwargs)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGINT)  # Ctrl+C
        return self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    assert s.stop() == 0 and "edgespec serve: stopped" in "".join(s.lines)


@pytest.fixture(scope="module")
def engine(smollm2_path):
    """The same pair in this process, loaded as the server loads it (the same flash-attention
    and kernel choices): what the server's answers must equal."""
    with edgespec.load("smollm2-self", n_ctx=CTX) as e:
        yield e


def test_a_servers_defaults_fill_only_what_a_request_leaves_unset():
    """Request.settled: the engine's draft mode and γ, serve's --max-tokens and --temperature
    where the request (an API body without them) left them unset; a request's own win."""
    defaults = Defaults(DraftMode.COPY, Gamma(3), max_tokens=7, temperature=0.0)
    unset = Request("hi", sets_temperature=False).settled(defaults)
    assert (unset.sampling.temperature, unset.max_tokens, unset.draft_mode, unset.gamma) == (0.0, 7, "copy", Gamma(3))
    own = Request.of("hi", temperature=1.2, max_tokens=3, draft_mode="off", gamma=2).settled(defaults)
    assert (own.sampling.temperature, own.max_tokens, own.draft_mode, own.gamma) == (1.2, 3, "off", Gamma(2))
    assert Request("hi").settled(Defaults()).sampling.temperature == edgespec.SamplingParams().temperature
    # llama.vscode's samplers leave temperature out: its chain is at temperature 1, not the server's
    chain = request_of({"prompt": "x", "samplers": ["top_k", "top_p"]}, infill=False).settled(defaults)
    assert chain.sampling.temperature == 1.0
    assert request_of({"prompt": "x"}, infill=False).settled(defaults).sampling.temperature == 0.0


def test_a_streamed_response_plans_its_first_token_and_a_whole_one_does_not():
    """What a client shows as it comes waits on its first token (Request.streamed); a whole
    answer, an editor's suggestion among them, only on its last."""
    body = {"prompt": "x", "stream": True}
    assert Job(request_of(body, infill=False), stream=True).request.streamed
    assert not Job(request_of(body, infill=False), stream=False).request.streamed


def test_chat_equals_the_library_answer(server, engine):
    reply = server.client().chat.completions.create(model="smollm2", messages=HELLO, temperature=0, max_tokens=24)
    direct = engine.chat(HELLO, temperature=0, max_tokens=24)
    served = engine.target.tokenize(reply.choices[0].message.content, add_special=False)
    assert_greedy_as_llama("library", engine, HELLO, direct.tokens, limit=24)
    assert_greedy_as_llama("server", engine, HELLO, served, limit=24)
    assert reply.usage.completion_tokens == len(served)
    assert reply.usage.prompt_tokens == direct.stats.n_prompt
    assert reply.choices[0].finish_reason in ("stop", "length")
    spec = reply.model_extra["speculative"]
    assert {"drafted", "accepted", "acceptance_rate", "tokens_per_round", "tokens_per_s", "rounds_by_source"} <= set(
        spec
    )


def test_streaming_with_usage(server):
    chunks = list(
        server.client().chat.completions.create(
            model="smollm2",
            messages=HELLO,
            temperature=0,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = server.client().chat.completions.create(model="smollm2", messages=HELLO, temperature=0, max_tokens=16)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens_details.cached_tokens > 0  # the second request reused the prefix's KV cache
    assert "speculative" in last.model_extra


def test_completions_models_and_health(server):
    done = server.client().completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert done.object == "text_completion" and done.choices[0].text and done.usage.completion_tokens <= 8
    streamed = server.client().completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["smollm2-135m"]
    assert httpx.get(server.url.removesuffix("/v1") + "/health").json() == {"status": "ok"}


def test_llama_servers_completion_and_infill_on_a_model_without_fim_tokens(server, engine):
    root = server.url.removesuffix("/v1")
    native = httpx.post(
        root + "/completion", json={"prompt": "The capital of France is", "n_predict": 8, "temperature": 0}, timeout=60
    )
    assert native.status_code == 200 and native.json()["stop"] is True
    # (/completion heals a prompt's last word: " is" goes back, and the answer writes it first)
    expected = engine.generate("The capital of France is", raw=True, heal=True, temperature=0, max_tokens=8)
    assert expected.stats.healed_bytes == len(" is")
    assert native.json()["content"] == expected.text and native.json()["timings"]["predicted_n"] == 8
    for path, body in [
        ("/infill", {"input_prefix": "def f():\n", "input_suffix": "\n"}),
        ("/completion", {"prompt": 1}),
    ]:
        refused = httpx.post(root + path, json=body, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == 400
    infill = httpx.post(root + "/infill", json={"input_prefix": "def f():\n", "input_suffix": "\n"}, timeout=60).json()
    assert "no fill-in-the-middle tokens (prefix, suffix, middle missing)" in infill["error"]["message"]
    suffix = server.post("/completions", json={"prompt": "def f():\n", "suffix": "\n"})
    assert suffix.status_code == 400 and "fill-in-the-middle" in suffix.json()["error"]["message"]


def test_llama_servers_n_probs_are_llamas_own_softmax(server, engine):
    """n_probs on /completion: each token's log-probability and its likeliest alternatives as
    llama-server's completion_probabilities, Llama's log-softmax along the same tokens (one-token
    passes, as Llama generates); a stream's chunks carry their own tokens'; post_sampling_probs,
    which the engine cannot give, is refused by name."""
    root = server.url.removesuffix("/v1")
    text = "Three colours of the rainbow are"
    body = {"prompt": text, "n_predict": 8, "temperature": 0, "n_probs": 3, "heal": False, "draft_mode": "off"}
    whole = httpx.post(root + "/completion", json=body, timeout=60).json()
    probs = whole["completion_probabilities"]
    assert len(probs) == whole["tokens_predicted"] == 8
    assert b"".join(bytes(p["bytes"]) for p in probs).decode() == whole["content"]
    llm, prompt = reference_for(engine.target).llm, reference_for(engine.target).prompt(text, raw=True)
    llm.reset()
    llm.eval(prompt)
    for p in probs[:-1]:
        llm.eval([p["id"]])
    rows = Llama.logits_to_logprobs(np.array(llm.scores[len(prompt) - 1 : len(prompt) - 1 + len(probs)]))
    for served, row in zip(probs, rows, strict=True):
        top = served["top_logprobs"]
        assert len(top) == 3 and top[0]["id"] == served["id"] and top[0]["logprob"] == served["logprob"]  # greedy
        assert abs(served["logprob"] - row[served["id"]]) < 1e-3
        assert np.allclose([a["logprob"] for a in top], np.sort(row)[::-1][:3], atol=1e-3)
        assert bytes(served["bytes"]) == llm.detokenize([served["id"]])
    with httpx.stream("POST", root + "/completion", json=body | {"stream": True}, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    streamed = [p for e in events if not e["stop"] for p in e["completion_probabilities"]]
    assert streamed == probs and "completion_probabilities" not in events[-1]  # (as llama-server's last event)
    plain = httpx.post(root + "/completion", json=body | {"n_probs": 0}, timeout=60).json()
    assert "completion_probabilities" not in plain and plain["content"] == whole["content"]
    for field, value, words in [("post_sampling_probs", True, "post_sampling_probs"), ("n_probs", 99, "0..20")]:
        refused = httpx.post(root + "/completion", json=body | {field: value}, timeout=60)
        assert refused.status_code == 400 and words in refused.json()["error"]["message"], refused.text


def test_llama_servers_tokenize_detokenize_apply_template_and_props(server, engine):
    """The small endpoints clients call beside /completion, against llama-cpp-python's own
    tokenizer and chat formatter."""
    root = server.url.removesuffix("/v1")
    llm = reference_for(engine.target).llm
    text = "Déjà vu: <|im_end|> and 🦙 tokens"

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(root + path, json=body, timeout=60)

    tokens = post("/tokenize", {"content": text}).json()["tokens"]
    assert tokens == llm.tokenize(text.encode(), add_bos=False, special=True)
    assert post("/tokenize", {"content": text, "parse_special": False}).json()["tokens"] == llm.tokenize(
        text.encode(), add_bos=False, special=False
    )
    with_bos = post("/tokenize", {"content": [text, 42, "x"], "add_special": True}).json()["tokens"]
    assert with_bos == llm.tokenize(text.encode(), add_bos=True, special=True) + [42] + llm.tokenize(
        b"x", add_bos=False, special=True
    )
    pieces = post("/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tokens
    assert any(isinstance(p["piece"], list) for p in pieces)  # the llama's bytes come apart: not whole UTF-8
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert joined == text.encode()
    assert post("/detokenize", {"tokens": tokens}).json()["content"] == llm.detokenize(tokens, special=True).decode()
    assert post("/detokenize", {"tokens": tokens}).json()["content"] == text

    messages = [{"role": "system", "content": "Be brief."}, *HELLO]
    template = llm.metadata["tokenizer.chat_template"]
    eos = llm.detokenize([llm.token_eos()], special=True).decode()
    expected = Jinja2ChatFormatter(template, eos_token=eos, bos_token="")(messages=messages).prompt
    assert post("/apply-template", {"messages": messages}).json()["prompt"] == expected

    props = httpx.get(root + "/props", timeout=60).json()
    assert props["chat_template"] == template and props["total_slots"] == DEFAULT_PARALLEL
    assert props["default_generation_settings"]["n_ctx"] == CTX and props["model_path"].endswith(".gguf")

    for path, body, words in [
        ("/detokenize", {"tokens": [10**9]}, "token id 1000000000 is not in the model's vocabulary"),
        ("/tokenize", {"content": {"a": 1}}, "'content' must be a string"),
        ("/apply-template", {"messages": "hi"}, "messages"),
    ]:
        refused = post(path, body)
        assert refused.status_code == 400 and words in refused.json()["error"]["message"], refused.text


@pytest.mark.slow
def test_a_full_context_ends_with_length_and_says_so(server):
    counting = ", ".join(str(i) for i in range(1, 200)) + ","  # ~890 tokens; the model keeps counting
    done = server.client().completions.create(model="m", prompt=counting, max_tokens=CTX, temperature=0)
    assert done.choices[0].finish_reason == "length"
    # every token but the last entered the context: the last is sampled, never evaluated
    assert done.usage.prompt_tokens + done.usage.completion_tokens <= CTX + 1
    assert done.model_extra["speculative"]["finish_reason"] == "context"
    deadline = time.monotonic() + 5  # the log line may reach our reader thread just after the response
    while "the context window is full" not in "".join(server.lines):
        assert time.monotonic() < deadline, "no log line about the full context"
        time.sleep(0.05)
    again = server.client().completions.create(model="m", prompt="The capital of France is", max_tokens=4)
    assert again.choices[0].text  # and the server goes on


def test_stop_strings_and_seeds(server):
    client = server.client()
    counting = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    full = client.chat.completions.create(model="m", messages=counting, temperature=0, max_tokens=60).choices[0]
    assert "4" in full.message.content
    stop = full.message.content[full.message.content.index("4") :][:3]
    cut = client.chat.completions.create(model="m", messages=counting, temperature=0, max_tokens=60, stop=[stop])
    assert cut.choices[0].message.content == full.message.content[: full.message.content.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    story = [{"role": "user", "content": "Tell me a very short story."}]
    first, second = (
        client.chat.completions.create(model="m", messages=story, temperature=1.0, seed=7, max_tokens=30)
        for _ in range(2)
    )
    assert first.choices[0].message.content == second.choices[0].message.content


def test_prediction_is_used_and_counted(server, engine):
    client = server.client()
    code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    ask = [{"role": "user", "content": f"Repeat this code exactly:\n{code}"}]
    # (30 tokens: past the rename, short of the answer's end, where SmolLM2 without flash attention is
    # near a tie between ending and going on, and a verify pass may go on where Llama ends)
    plain = client.chat.completions.create(model="m", messages=ask, temperature=0, max_tokens=30)
    predicted = client.chat.completions.create(
        model="m",
        messages=ask,
        temperature=0,
        max_tokens=30,
        prediction={"type": "content", "content": code.replace("sub(a, b)", "subtract(a, b)")},  # wrong in one name
        extra_body={"draft_mode": "copy", "gamma": 8},  # draft whenever there is a copy (auto may wait)
    )
    plain_tokens, predicted_tokens = (
        engine.target.tokenize(reply.choices[0].message.content, add_special=False) for reply in (plain, predicted)
    )
    assert_greedy_as_llama("server", engine, ask, plain_tokens, limit=30)
    assert_greedy_as_llama("server prediction", engine, ask, predicted_tokens, limit=30)
    details, speculative = predicted.usage.completion_tokens_details, predicted.model_extra["speculative"]
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens > 0  # at `subtract`
    drafted = speculative["drafted_by_source"]["prediction"]
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == drafted
    assert predicted.model_extra["speculative"]["rounds_by_source"].get("prediction", 0) > 0


@pytest.mark.slow
def test_eight_concurrent_clients(server, engine):
    prompts = [[{"role": "user", "content": f"Name a fruit that starts with the letter {c}."}] for c in "ABCDEFGH"]
    answers: dict[int, list] = {i: [] for i in range(8)}

    def client_thread(i: int) -> None:
        client = server.client(timeout=120)
        for _ in range(3):
            reply = client.chat.completions.create(model="m", messages=prompts[i], temperature=0, max_tokens=12)
            answers[i].append(reply.choices[0].message.content)

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i in range(8):
        assert len(answers[i]) == 3 and len(set(answers[i])) == 1, answers[i]
        served = engine.target.tokenize(answers[i][0], add_special=False)
        assert_greedy_as_llama(f"concurrent {i}", engine, prompts[i], served, limit=12)


def test_a_client_that_drops_mid_stream_frees_the_engine(server):
    story = {"messages": [{"role": "user", "content": "Write a long story about a dragon."}], "max_tokens": 900}
    with httpx.stream("POST", server.url + "/chat/completions", json=story | {"stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    time.sleep(0.5)  # the connection is closed: the server notices and stops at the round boundary
    reply = server.client().chat.completions.create(model="m", messages=HELLO, temperature=0, max_tokens=8)
    assert reply.choices[0].message.content
    answered = [line for line in server.lines if "answered:" in line]
    dropped = answered[-2]  # the dragon story, logged when it ended
    assert int(re.search(r"\d+\+(\d+) tokens", dropped).group(1)) < 900, dropped


BAD_REQUESTS = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"content": "hi"}]}, 400, "messages[0]"),
    ({"messages": HELLO, "temperature": "hot"}, 400, "temperature"),
    ({"messages": HELLO, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": HELLO, "top_p": 0}, 400, None),
    ({"messages": HELLO, "n": 0}, 400, "n"),
    ({"messages": HELLO, "n": 5}, 400, "n"),
    ({"messages": HELLO, "stop": [1, 2]}, 400, "stop"),
    ({"messages": HELLO, "draft_mode": "telepathy"}, 400, "draft_mode"),
    ({"messages": HELLO, "gamma": 0}, 400, "gamma"),
    ({"messages": HELLO, "prediction": "text"}, 400, "prediction"),
    ({"messages": HELLO, "logprobs": "yes"}, 400, "logprobs"),
    ({"messages": HELLO, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"messages": HELLO, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    ({"messages": HELLO, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": HELLO, "functions": [{"name": "f"}]}, 400, "functions"),
    ({"messages": [{"role": "user", "content": "word " * 3000}]}, 400, None),
]


@pytest.mark.parametrize("body, status, param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = server.post("/chat/completions", **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if "word " in str(body):  # the prompt is longer than the context: the code OpenAI's clients act on
        assert error["code"] == "context_length_exceeded" and "--ctx" in error["message"]
    assert server.post("/chat/completions", json={"messages": HELLO, "max_tokens": 2}).status_code == 200


def test_too_large_a_body_gets_413(server):
    response = server.post("/chat/completions", content=b"x" * (9 << 20))
    assert response.status_code == 413 and response.json()["error"]["message"]
    assert not [line for line in server.lines if "Traceback" in line or " 500 " in line]


def test_api_key_is_required_everywhere():
    server = Server("--api-key", "s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").models.list()
        assert httpx.get(server.url.removesuffix("/v1") + "/health").status_code == 401
        reply = server.client(api_key="s3cret").chat.completions.create(model="m", messages=HELLO, max_tokens=4)
        assert reply.choices[0].message.content
    finally:
        assert server.stop() == 0


def test_a_port_in_use_is_one_line(server, capsys):
    from edgespec.cli import main

    port = server.url.split(":")[-1].split("/")[0]
    assert main(["serve", "--pair", "smollm2-self", "--port", port]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot listen" in err[0] and "--port" in err[0]


def test_serve_help_and_server_log_is_clean(server):
    assert "Traceback" not in "".join(server.lines)
    done = subprocess.run([sys.executable, "-m", "edgespec", "serve", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--api-key" in done.stdout and "127.0.0.1" in done.stdout


RECALL = {
    "type": "object",
    "properties": {"company": {"type": "string", "maxLength": 40}, "units": {"type": "integer"}},
    "required": ["company", "units"],
}


def test_structured_output_through_the_openai_client(server):
    """response_format json_schema and json_object (OpenAI), and llama-server's json_schema
    and grammar fields: each answer matches; a bad schema or grammar is a 400."""
    import json

    import jsonschema

    client = server.client()
    ask = [
        {"role": "user", "content": "As a JSON object with keys company and units: Northwind recalled 48,000 kettles."}
    ]
    formats = {
        "json_schema": {"type": "json_schema", "json_schema": {"name": "recall", "schema": RECALL, "strict": True}},
        "json_object": {"type": "json_object"},
    }
    for name, response_format in formats.items():
        answer = client.chat.completions.create(
            model="x", messages=ask, temperature=0, max_tokens=120, response_format=response_format
        )
        assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content  # a whole object
        value = json.loads(answer.choices[0].message.content)
        assert isinstance(value, dict)
        if name == "json_schema":
            jsonschema.validate(value, RECALL)
    extra = client.chat.completions.create(
        model="x", messages=ask, temperature=0, max_tokens=120, extra_body={"json_schema": RECALL}
    )
    jsonschema.validate(json.loads(extra.choices[0].message.content), RECALL)
    yes_no = client.completions.create(
        model="x", prompt="Is water wet? Answer:", max_tokens=5, extra_body={"grammar": 'root ::= " yes" | " no"'}
    )
    assert yes_no.choices[0].text in (" yes", " no")
    for bad in ({"grammar": "root ::= ("}, {"json_schema": {"$ref": "https://example.com/x"}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="x", messages=ask, max_tokens=5, extra_body=bad)
        assert "\n" not in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="x", messages=ask, max_tokens=5, response_format={"type": "json_schema", "json_schema": {}}
        )


def test_answers_that_were_all_sent_before_they_are_read_stay_apart():
    """Short answers of one job (n_cmpl, an editor's empty completions) may all be in the queue
    before the handler reads the first: each answer's pieces end at its None, never reading the
    next answer's Stats as an event."""

    async def read() -> list[str]:
        job = Job(Request("hi"), count=3, events=[asyncio.Queue() for _ in range(3)])
        for index, text in enumerate(("a", "", "c")):
            stats = Stats("target-only", "auto")
            run = SimpleNamespace(stats=stats)  # (what Answer reads of a Run)
            for item in (run, Event(text, 1, "target", stats), Event("", None, None, stats), None):
                job.events[index].put_nowait(item)
        texts, answer = [], Answer(job, await job.events[0].get())
        while answer is not None:
            texts.append((await answer.whole()).text)
            answer = await answer.following()
        return texts

    assert asyncio.run(read()) == ["a", "", "c"]


BAD_COMPLETIONS = [
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 5}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize("body, param", BAD_COMPLETIONS)
def test_bad_completion_fields_are_named(server, body, param):
    response = server.post("/completions", json={"prompt": "def fib(n):", "max_tokens": 4} | body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_chat_logprobs_are_the_librarys_whole_and_streamed(server, engine):
    """The values equal the library's (tests/test_logprobs.py holds those to llama-cpp-python's
    own); greedy, every chosen token heads its top list; a stream carries the same."""
    client = server.client()
    ask = dict(model="m", messages=HELLO, temperature=0, max_tokens=16, logprobs=True, top_logprobs=5)
    reply = client.chat.completions.create(**ask)
    content = reply.choices[0].logprobs.content
    direct = engine.generate(Request.of(HELLO, temperature=0, max_tokens=16, logprobs=5))
    assert "".join(t.token for t in content) == reply.choices[0].message.content == direct.text
    for served, mine in zip(content, direct.logprobs, strict=True):
        assert abs(served.logprob - mine.logprob) < 1e-4 and served.bytes == list(mine.piece)
        assert len(served.top_logprobs) == 5 and served.top_logprobs[0].logprob == served.logprob
        assert [round(a.logprob, 4) for a in served.top_logprobs] == [round(a.logprob, 4) for a in mine.top]
    streamed = [
        t
        for chunk in client.chat.completions.create(**ask, stream=True)
        for c in chunk.choices
        if c.logprobs
        for t in c.logprobs.content
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    plain = client.chat.completions.create(model="m", messages=HELLO, temperature=0, max_tokens=16)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == direct.text


def test_echo_scores_the_prompt_as_an_evaluation_harness_asks(server, engine):
    """lm-evaluation-harness's local-completions: echo, logprobs, max_tokens 0."""
    prompt = "The capital of France is Paris"
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    choice = server.post("/completions", json=body).json()["choices"][0]
    scored = engine.generate(Request(prompt, raw=True, max_tokens=0, logprobs=1, prompt_logprobs=True))
    logprobs = choice["logprobs"]
    assert choice["text"] == prompt and "".join(logprobs["tokens"]) == prompt
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert len(logprobs["token_logprobs"]) == len(scored.prompt_logprobs) == scored.stats.n_prompt
    assert all(
        abs(a - b.logprob) < 1e-4
        for a, b in zip(logprobs["token_logprobs"][1:], scored.prompt_logprobs[1:], strict=True)
    )
    assert logprobs["text_offset"] == [
        sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(scored.prompt_logprobs))
    ]
    echoed = server.client().completions.create(model="m", prompt=prompt, echo=True, max_tokens=3, temperature=0)
    assert echoed.choices[0].text.startswith(prompt) and len(echoed.choices[0].text) > len(prompt)


def test_n_answers_are_the_single_answers_of_the_following_seeds(server):
    """Answer i of a seeded request with n answers is the single answer to seed + i (README)."""
    client = server.client()
    ask = dict(model="m", prompt="Once upon a time", temperature=1.0, max_tokens=12)
    many = client.completions.create(**ask, n=3, seed=11)
    singles = [client.completions.create(**ask, seed=11 + i).choices[0] for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [c.text for c in singles]
    assert many.usage.completion_tokens == sum(
        client.completions.create(**ask, seed=11 + i).usage.completion_tokens for i in range(3)
    )
    chat = client.chat.completions.create(model="m", messages=HELLO, temperature=1.0, max_tokens=8, n=2, seed=3)
    alone = client.chat.completions.create(model="m", messages=HELLO, temperature=1.0, max_tokens=8, seed=4)
    assert chat.choices[1].message.content == alone.choices[0].message.content
    streamed = client.chat.completions.create(
        model="m", messages=HELLO, temperature=1.0, max_tokens=8, n=2, seed=3, stream=True
    )
    texts = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in chat.choices]


def test_best_of_returns_the_answer_of_the_highest_logprob_per_token(server):
    client = server.client()
    ask = dict(model="m", prompt="Once upon a time", temperature=1.0, max_tokens=12)
    best = client.completions.create(**ask, best_of=3, seed=5)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    singles = [client.completions.create(**ask, seed=5 + i, logprobs=0).choices[0] for i in range(3)]
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in singles]
    assert best.choices[0].text == singles[means.index(max(means))].text
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in singles)


def test_metrics_parse_and_move_with_a_request(server):
    from prometheus_client.parser import text_string_to_metric_families

    assert httpx.get(server.url.removesuffix("/v1") + "/metrics").status_code == 404  # off unless asked for
    metered = Server("--metrics")
    try:

        def read() -> dict:
            response = httpx.get(metered.url.removesuffix("/v1") + "/metrics")
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
            families = text_string_to_metric_families(response.text)
            return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}

        before = read()
        assert before[("llamacpp:tokens_predicted_total", ())] == 0
        body = {"prompt": "def fib(n):", "max_tokens": 16, "temperature": 0, "draft_mode": "model", "gamma": 4}
        reply = metered.post("/completions", json=body).json()
        after = read()
        assert after[("llamacpp:tokens_predicted_total", ())] == reply["usage"]["completion_tokens"]
        assert after[("llamacpp:prompt_tokens_total", ())] == reply["usage"]["prompt_tokens"]
        assert after[("edgespec:answers_total", ())] == 1
        drafted = after[("edgespec:draft_tokens_total", (("source", "model"),))]
        assert drafted == after[("llamacpp:spec_decode_num_draft_tokens_total", ())] > 0
        assert after[("llamacpp:kv_cache_tokens", ())] > 0 and after[("llamacpp:requests_processing", ())] == 0
        assert after[("process_resident_memory_bytes", ())] > 100 << 20  # (a model and its cache are in it)
        places = {dict(labels)["where"] for name, labels in after if name == "edgespec:prompt_cache_bytes"}
        assert places == {"ram", "disk"}
    finally:
        assert metered.stop() == 0
