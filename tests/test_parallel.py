"""Several requests at once: each run in a sequence of its own in both models' contexts, the
runs taken a step at a time in turn (as the server's EngineThread takes them); each answer is
Llama's alone."""

import asyncio
import json
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from time import perf_counter

import httpx
import numpy as np
import pytest
from conftest import TINY_TEMPERATURE, tiny_pair
from reference import assert_greedy_as_llama, chi_square_pvalue, law_after, reference_for
from test_server import HELLO, Server

import edgespec
from edgespec import EdgespecError, Engine, EngineFault, EngineThread, Request
from edgespec.cost_curve import CostCurve
from edgespec.drafters import ModelDrafter
from edgespec.engine_thread import REST_S
from edgespec.model import Model
from edgespec.passes import Pass
from edgespec.run import PREFILL_CHUNK
from edgespec.scheduler import Scheduler, Task
from edgespec.server.answers import Answer, Job
from edgespec.server.app import Worker

CTX = 1024
RUNS = 2000  # seeded answers in the chi-square test


@pytest.fixture(scope="module")
def twin_engine(smollm2_path, requantized_path):
    """SmolLM2 drafted by its re-quantization, two sequences in each context."""
    target = Model(smollm2_path, n_ctx=CTX, flash_attn=True, n_seq=2)
    draft = Model(requantized_path, n_ctx=CTX, n_seq=2)
    with Engine(target, ModelDrafter(draft, target.n_vocab), gamma=4, draft_mode="model", owned=[target, draft]) as e:
        yield e


def in_turns(engine, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy answers to raw prompts, as the server's scheduler runs them: their tokens."""
    return runs_in_turns(engine, [engine.start(p, raw=True, temperature=0, max_tokens=max_tokens) for p in prompts])


def runs_in_turns(engine, runs, failed: dict[int, Exception] | None = None) -> list[list[int]]:
    """Started runs taken as the server's scheduler takes them: each to its next target pass, then
    their passes decoded together, until all end; their tokens. failed: where a run's error is
    kept (by its index; the others go on), else it is raised."""
    running = dict(enumerate(engine.steps(run) for run in runs))
    answers: list[list[int]] = [[] for _ in runs]
    while running:
        passes = []
        for i, steps in list(running.items()):
            try:
                for step in steps:
                    if isinstance(step, Pass):
                        passes.append(step)
                        break
                    if not step.done:
                        answers[i].append(step.token)
                else:
                    del running[i]
            except EdgespecError as e:
                if failed is None:
                    raise
                failed[i] = e
                del running[i]
        engine.decode(passes)
    return answers


def refused_where(marker: int):
    """Model.decode, but every pass that holds token `marker` has its last token replaced by one
    outside the vocabulary: a pass llama.cpp refuses (llama_decode's check of its batch)."""
    decode = Model.decode

    def refusing(self, passes):
        for one in passes:
            if marker in one.tokens:
                one.tokens = [*one.tokens[:-1], self.n_vocab + 7]
        decode(self, passes)

    return refusing


ZANZIBAR = "Tell me about Zanzibar"  # its last token is in no other prompt or answer here


def test_a_pass_llama_cpp_refuses_fails_its_own_run_alone(monkeypatch):
    """Three runs' passes decoded together, one of which llama.cpp refuses: the batch is decoded
    again pass by pass, so that run alone ends (an EngineFault), the two beside it answer as Llama
    does, and its sequence answers the next request as Llama does."""
    with edgespec.load("smollm2-self", n_ctx=CTX, parallel=3, progress=False) as engine:
        marker = engine.target.tokenize(ZANZIBAR, add_special=False)[-1]
        monkeypatch.setattr(Model, "decode", refused_where(marker))
        prompts = ["The capital of France is", ZANZIBAR, "def fibonacci(n):\n"]
        runs = [engine.start(p, raw=True, temperature=0, max_tokens=16) for p in prompts]
        failed: dict[int, Exception] = {}
        answers = runs_in_turns(engine, runs, failed)
        assert list(failed) == [1] and isinstance(failed[1], EngineFault), failed
        for i in (0, 2):
            assert_greedy_as_llama(f"beside a refused pass: {prompts[i]!r}", engine, prompts[i], answers[i], raw=True)
        assert not engine.sequences.held
        monkeypatch.undo()
        again = runs_in_turns(engine, [engine.start(ZANZIBAR, raw=True, temperature=0, max_tokens=16)])[0]
        assert_greedy_as_llama("after its refused pass", engine, ZANZIBAR, again, raw=True, limit=16)


def test_a_refused_pass_under_four_streams_ends_that_stream_alone(monkeypatch):
    """Four streams at once through the server (in this process), one of whose passes llama.cpp
    refuses: that stream ends with an error event saying the server failed (not a 4xx, not a
    silent close), the other three answer as Llama does, and /metrics counts the fault."""
    from starlette.testclient import TestClient

    from edgespec.server.app import Api

    worker = Worker(lambda: edgespec.load("smollm2-self", n_ctx=CTX, parallel=4, progress=False), 4)
    engine = worker.wait_loaded()
    reference = reference_for(engine.target)
    monkeypatch.setattr(Model, "decode", refused_where(engine.target.tokenize(ZANZIBAR, add_special=False)[-1]))
    prompts = ["The capital of France is", ZANZIBAR, "def fibonacci(n):\n", "Once upon a time"]
    with TestClient(Api(worker, "smollm2", None, None, metrics=True).app()) as http:

        def stream(prompt: str) -> list[dict]:
            body = {"model": "m", "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}
            reply = http.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            return [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]

        with ThreadPoolExecutor(4) as pool:
            events = list(pool.map(stream, prompts))
        metrics = http.get("/metrics").text
    for prompt, chunks in zip(prompts, events, strict=True):
        if prompt == ZANZIBAR:
            (error,) = [c["error"] for c in chunks if "error" in c]
            assert error["type"] == "server_error" and "the server failed" in error["message"], error
            continue
        assert not any("error" in c for c in chunks), chunks
        text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        expected = reference.llm.detokenize(reference.greedy(reference.prompt(prompt, raw=True), 16)).decode()
        assert text == expected, (prompt, text, expected)
    assert 'edgespec:faults_total{where="request"} 1.0' in metrics


DIALECTS = {  # path, body, and how its stream's error event reads
    "openai": ("/v1/chat/completions", {"messages": [{"role": "user", "content": ZANZIBAR}]}, '"type":"server_error"'),
    "anthropic": ("/v1/messages", {"messages": [{"role": "user", "content": ZANZIBAR}]}, '"type":"api_error"'),
    "responses": ("/v1/responses", {"input": ZANZIBAR}, '"code":"server_error"'),
    "llama.cpp": ("/completion", {"prompt": ZANZIBAR}, '"type":"server_error"'),
}


def test_a_stream_that_fails_midway_ends_with_its_apis_error_event(monkeypatch):
    """A pass llama.cpp refuses once the stream has begun: each API's stream ends with its own
    error event saying the server failed (never a silent close, never a client error); the
    request before the stream began, refused the same way, is a 500 saying so."""
    from starlette.testclient import TestClient

    from edgespec.server.app import Api

    worker = Worker(lambda: edgespec.load("smollm2-self", n_ctx=CTX, progress=False))
    engine = worker.wait_loaded()
    monkeypatch.setattr(Model, "decode", refused_where(engine.target.tokenize(" Zanzibar", add_special=False)[-1]))
    with TestClient(Api(worker, "smollm2", None, None).app()) as http:
        for name, (path, body, error) in DIALECTS.items():
            reply = http.post(path, json=body | {"model": "m", "max_tokens": 8, "n_predict": 8, "stream": True})
            assert reply.status_code == 200, (name, reply.text)
            last = [line for line in reply.text.splitlines() if line.startswith("data: ")][-1]
            assert error in last and "the server failed on this request" in last, (name, reply.text[-500:])
        whole = http.post("/v1/chat/completions", json=DIALECTS["openai"][1] | {"max_tokens": 8})
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "server_error", whole.text
    assert "not because of it" in whole.json()["error"]["message"]


def test_two_answers_taken_in_turns_are_each_llamas(twin_engine):
    prompts = ["The capital of France is", "def fibonacci(n):\n"]
    answers = in_turns(twin_engine, prompts, 24)
    for prompt, tokens in zip(prompts, answers, strict=True):
        assert_greedy_as_llama(f"in turns: {prompt!r}", twin_engine, prompt, tokens, raw=True, limit=24)
    assert not twin_engine.sequences.held  # each run gave its sequence back


def test_the_draft_models_steps_of_two_runs_are_decoded_together(twin_engine, monkeypatch):
    """The draft model's passes are handed out as the target's are: two runs drafting with it have
    their draft steps decoded in one llama_decode, and a long prompt's draft prefill is read a
    PREFILL_CHUNK at a time (the other run's steps go on between); both answers are Llama's."""
    draft, decoded = twin_engine.draft_model, []
    decode = draft.decode
    monkeypatch.setattr(draft, "decode", lambda passes: (decoded.append(passes), decode(passes)))
    prompts = [" ".join(f"cherry{i}" for i in range(200)), "def fibonacci(n):\n"]
    assert len(twin_engine.target.tokenize(prompts[0])) > 2 * PREFILL_CHUNK
    answers = in_turns(twin_engine, prompts, 16)
    assert any(len({one.seq for one in passes}) == 2 for passes in decoded), "no draft step decoded together"
    assert max(len(one.tokens) for passes in decoded for one in passes) <= PREFILL_CHUNK
    for prompt, tokens in zip(prompts, answers, strict=True):
        assert_greedy_as_llama(f"drafts together: {prompt[:12]!r}", twin_engine, prompt, tokens, raw=True, limit=16)


def test_a_run_beyond_the_sequences_is_refused_until_one_ends(twin_engine):
    streams = [twin_engine.stream(p, raw=True, max_tokens=8) for p in ("One", "Two", "Three")]
    next(streams[0]), next(streams[1])
    with pytest.raises(EdgespecError, match="parallel=3"):
        next(streams[2])
    streams[0].close()  # a closed stream gives its sequence back
    third = twin_engine.stream("Three", raw=True, max_tokens=8)
    assert next(third).token is not None
    third.close(), streams[1].close()
    assert not twin_engine.sequences.held


def test_each_sequence_has_a_whole_context_and_its_answers_stay_llamas(twin_engine):
    """Two 600-token prompts each keep their whole cache (a sequence has n_ctx cells of its own),
    and answers read beside them, in passes of more than 32 tokens and after a cut back, are
    Llama's (llama.cpp's unified cache, where sequences share cells, moves them by up to 1.4)."""
    target = twin_engine.target
    first = " ".join(f"apple{i}" for i in range(200))
    second = " ".join(f"pear{i}" for i in range(200))
    assert all(600 < len(target.tokenize(t)) < CTX - 64 for t in (first, second))
    in_turns(twin_engine, [first, second], 4)
    assert min(len(target.sequence_tokens(s)) for s in range(2)) > 600
    prompts = [first[:300] + " banana cherry plum", "A list of forty fruits, one per line, in alphabetical order:\n"]
    assert len(target.tokenize(prompts[1])) < 32 < len(target.tokenize(prompts[0]))
    for prompt, tokens in zip(prompts, in_turns(twin_engine, prompts, 16), strict=True):
        assert_greedy_as_llama(f"beside a neighbour: {prompt[-20:]!r}", twin_engine, prompt, tokens, raw=True, limit=16)


def test_a_sequences_logits_do_not_depend_on_its_neighbours(twin_engine):
    """Passes of 51 tokens in both sequences, one cut back and read on: each sequence's next
    logits are Llama's on its tokens alone, as read in the same passes."""
    target, llm = twin_engine.target, reference_for(twin_engine.target).llm
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(100, 1000, 24)]
    reads = {seq: [shared + [int(t) for t in rng.integers(100, 1000, 27)]] for seq in (0, 1)}
    for seq in (0, 1):
        target.use(seq)
        target.cache.truncate(0)
        target.eval(reads[seq][0])
    target.use(0)
    target.cache.cut(24)
    reads[0] = [shared, [int(t) for t in rng.integers(100, 1000, 13)]]
    target.eval(reads[0][1])
    for seq in (0, 1):
        target.use(seq)
        ours = np.array(target.eval([1]))
        llm.reset()
        for tokens in [*reads[seq], [1]]:
            llm.eval(tokens)
        assert np.abs(ours - llm.scores[llm.n_tokens - 1]).max() < 1e-3, f"sequence {seq} reads its neighbour's cells"
        target.cache.truncate(0)


def test_a_prompt_start_another_sequence_holds_is_copied_not_read_again(twin_engine):
    """A run on a long system prompt is mid-answer in one sequence; a request on the same system
    prompt (an agent's sub-agent, or its next turn beside a side request) starts in the other:
    the shared start is copied from its neighbour, only its own part is read, and both answers
    are Llama's."""
    system = {"role": "system", "content": "You are a careful assistant who answers in one short sentence. " * 12}
    chats = [[system, {"role": "user", "content": f"Name a {thing}."}] for thing in ("colour", "fruit")]
    first = twin_engine.start(chats[0], temperature=0, max_tokens=12)
    steps, first_tokens = twin_engine.steps(first), []
    for step in steps:  # to its first token: its prompt is in its sequence
        if isinstance(step, Pass):
            twin_engine.decode([step])
        else:
            first_tokens.append(step.token)
            break
    second = twin_engine.start(chats[1], temperature=0, max_tokens=12)
    (second_tokens,) = runs_in_turns(twin_engine, [second])
    assert second.sequence != first.sequence
    assert second.stats.n_prompt_cached > len(twin_engine.target.tokenize(system["content"])) > 100
    for step in steps:
        if isinstance(step, Pass):
            twin_engine.decode([step])
        elif not step.done:
            first_tokens.append(step.token)
    for chat, tokens in zip(chats, [first_tokens, second_tokens], strict=True):
        assert_greedy_as_llama(f"copied prefix: {chat[1]['content']}", twin_engine, chat, tokens, limit=12)
    assert not twin_engine.sequences.held


def test_two_requests_sent_together_on_one_new_prompt_read_it_once(twin_engine):
    """Two chats on one long system prompt that no sequence holds yet, started in the same step
    (an agent's side request sent with its main one): the second waits while the first reads the
    shared start, then copies it; both answers are Llama's."""
    system = {"role": "system", "content": "You are a terse assistant; reply with a single word. " * 14}
    chats = [[system, {"role": "user", "content": f"Name a {thing}."}] for thing in ("metal", "river")]
    runs = [twin_engine.start(chat, temperature=0, max_tokens=8) for chat in chats]
    answers = runs_in_turns(twin_engine, runs)
    assert runs[0].stats.n_prompt_cached < 10  # (the chat template's opening, held from earlier chats)
    assert runs[1].stats.n_prompt_cached > len(twin_engine.target.tokenize(system["content"])) > 150
    for chat, tokens in zip(chats, answers, strict=True):
        assert_greedy_as_llama(f"read once: {chat[1]['content']}", twin_engine, chat, tokens, limit=8)


def test_a_run_whose_reader_makes_no_progress_reads_its_prompt_itself(twin_engine):
    """A library caller's run stopped at its first prompt pass (not decoded) is waited for one
    step, not for ever: the other run reads the prompt itself."""
    prompt = "The history of the printing press, told in ten short chapters. " * 12
    stalled = twin_engine.start(prompt, raw=True, temperature=0, max_tokens=4)
    stalled_steps = twin_engine.steps(stalled)
    assert isinstance(next(stalled_steps), Pass)  # it holds a sequence and reads the prompt: never decoded
    reader = twin_engine.start(prompt, raw=True, temperature=0, max_tokens=4)
    tokens, steps = [], 0
    for step in twin_engine.steps(reader):
        steps += 1
        assert steps < 100, "it waits for a run that makes no progress"
        if isinstance(step, Pass):
            twin_engine.decode([step])
        elif not step.done:
            tokens.append(step.token)
    stalled_steps.close()
    assert reader.stats.n_prompt_cached == 0
    assert_greedy_as_llama("read itself", twin_engine, prompt, tokens, raw=True, limit=4)
    assert not twin_engine.sequences.held and not twin_engine.sequences.reading


def test_answers_to_one_prompt_made_side_by_side_copy_its_prompt_and_are_each_llamas(
    twin_engine, smollm2_path, requantized_path
):
    """Where the machine's costs say so (Engine.answers_together; told so here), a job's three
    answers (n_cmpl 3) are made side by side by the server's worker: the later two wait for the
    first to read the prompt, copy it from its sequence, and are decoded in the same steps as the
    first; each is Llama's greedy answer."""
    target = Model(smollm2_path, n_ctx=CTX, flash_attn=True, n_seq=3)
    draft = Model(requantized_path, n_ctx=CTX, n_seq=3)
    engine = Engine(target, ModelDrafter(draft, target.n_vocab), gamma=4, draft_mode="model", owned=[target, draft])
    engine.answers_together = lambda count: True
    decode, decoded = engine.decode, []
    engine.decode = lambda passes: (decoded.append({p.seq for p in passes}), decode(passes))
    prompt = "A list of the planets of the solar system, with one fact about each, one per line:\n" * 16

    async def answers() -> list:
        job = Job(Request.of(prompt, raw=True, temperature=0, max_tokens=16), count=3)
        worker.submit(job)
        answer, runs = Answer(job, await job.events[0].get()), []
        while answer is not None:
            await answer.whole()
            runs.append(answer.run)
            answer = await answer.following()
        return runs

    worker = Worker(lambda: engine, parallel=3)
    try:
        runs = asyncio.run(answers())
    finally:
        worker.stop()
    assert len(runs) == 3 and len({run.sequence for run in runs}) == 3
    assert any(len(seqs) == 3 for seqs in decoded), decoded  # a step of all three at once
    n_prompt = len(twin_engine.target.tokenize(prompt))
    assert n_prompt > PREFILL_CHUNK  # read in several passes: the others wait for them all
    assert [run.stats.n_prompt_cached for run in runs[1:]] == [n_prompt - 1] * 2  # copied, not read again
    for index, run in enumerate(runs):
        answer = run.seq[len(run.prompt) :]
        assert_greedy_as_llama(f"side by side, answer {index}", twin_engine, prompt, answer, raw=True, limit=16)


def test_answers_to_one_prompt_go_side_by_side_only_with_a_sequence_each(twin_engine, monkeypatch):
    """On a flat curve (a GPU's) an engine of two sequences makes two answers side by side, not three."""
    monkeypatch.setattr(twin_engine.costs, "curve", lambda model, *sizes: CostCurve({1: 1.0, 2: 1.02, 4: 1.05}))
    assert twin_engine.answers_together(2)
    assert not twin_engine.answers_together(1) and not twin_engine.answers_together(3)


ANIMAL = "<|im_start|>user\nName an animal.<|im_end|>\n<|im_start|>assistant\nSure! My favourite animal is the"


@pytest.fixture(scope="module")
def tiny_twin(smollm2_path, tmp_path_factory):
    """conftest.tiny_pair with two sequences in each context."""
    with tiny_pair(tmp_path_factory.mktemp("tiny-twin"), smollm2_path, n_seq=2) as engine:
        yield engine


def test_a_sampled_answers_law_is_unchanged_by_a_neighbour(tiny_twin):
    """The first token of seeded answers, each pass of theirs (the draft model's steps, the
    target's verify pass) decoded in the same llama_decode as another request's pass of that
    model, follows the target's law (chi-square against Llama's), through drafts accepted and
    resampled (a tiny pair: the law is the point, not the model)."""
    twin_engine = tiny_twin
    params = dict(temperature=TINY_TEMPERATURE, top_k=20, top_p=1.0, min_p=0.0)
    p = law_after(twin_engine, ANIMAL, width=5, **params)
    counts, sources, rng = np.zeros(len(p)), set(), np.random.default_rng(7)
    neighbour = twin_engine.steps(twin_engine.start("Once upon a time", raw=True, max_tokens=64))

    def neighbours_next_pass(model: Model) -> Pass:
        """The neighbour's next pass of `model` (its others decoded alone; a new neighbour where one has ended)."""
        nonlocal neighbour
        while True:
            beside = next((s for s in neighbour if isinstance(s, Pass)), None)
            if beside is None:
                neighbour = twin_engine.steps(twin_engine.start("Once upon a time", raw=True, max_tokens=64))
            elif beside.model is model:
                return beside
            else:
                twin_engine.decode([beside])

    for _ in range(RUNS):
        seed = int(rng.integers(2**32))
        steps = twin_engine.steps(twin_engine.start(ANIMAL, raw=True, max_tokens=8, seed=seed, **params))
        while isinstance(step := next(steps), Pass):
            twin_engine.decode([step, neighbours_next_pass(step.model)])
            assert step.beside, "the passes were decoded apart"
        steps.close()
        counts[step.token] += 1
        sources.add(step.source)
    neighbour.close()
    assert sources == {"draft", "target"}, sources
    assert chi_square_pvalue(counts, p, RUNS) > 0.01


def answered_lines(server, n: int) -> list[str]:
    """The server's first n "answered:" log lines, waited for (a stream's line follows its last chunk)."""
    deadline = time.monotonic() + 30
    while len(answered := [line for line in server.lines if "answered:" in line]) < n:
        assert time.monotonic() < deadline, answered
        time.sleep(0.05)
    assert len(answered) == n, answered
    return answered


def test_a_short_chat_is_answered_while_a_long_one_streams():
    """With --parallel 2 a request's wait does not depend on the length of another's answer, and
    /metrics counts both as processing."""
    server = Server("--parallel", "2", "--metrics")
    try:
        story = {"messages": [{"role": "user", "content": "Write a long story about a dragon."}], "max_tokens": 400}
        story |= {"stream": True, "temperature": 0}
        with httpx.stream("POST", server.url + "/chat/completions", json=story, timeout=120) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the story has begun
            metrics = httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=60).text
            reply = server.client().chat.completions.create(model="m", messages=HELLO, temperature=0, max_tokens=8)
            after = [line for line in lines if line.startswith("data: ")]
        assert reply.choices[0].message.content and len(after) > 8  # the story went on after the reply
        processing = re.search(r"^llamacpp:requests_processing (\S+)", metrics, re.M)
        assert processing is not None and float(processing.group(1)) == 1
        answered = answered_lines(server, 2)
        short = reply.usage.completion_tokens
        assert re.search(rf"\d+\+{short} tokens", answered[0]), answered  # it ended first
    finally:
        assert server.stop() == 0


def test_a_client_that_hangs_up_mid_batch_frees_its_sequence_for_the_next():
    """--parallel 2, both sequences streaming: a third request is deferred (/metrics says so) until
    one client hangs up; it then takes that sequence and is answered while the other stream goes on."""
    server = Server("--parallel", "2", "--metrics")
    story = {"messages": [{"role": "user", "content": "Write a long story about a dragon."}], "max_tokens": 400}
    story |= {"stream": True, "temperature": 0}
    url, replies = server.url + "/chat/completions", []

    def metric(name: str) -> float:
        text = httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=60).text
        return float(re.search(rf"^llamacpp:{name} (\S+)", text, re.M).group(1))

    try:
        with httpx.stream("POST", url, json=story, timeout=120) as kept:
            kept_lines = kept.iter_lines()
            assert next(kept_lines).startswith("data: ")
            with httpx.stream("POST", url, json=story | {"seed": 2}, timeout=120) as left:
                left_lines = left.iter_lines()  # (kept: a generator dropped closes the stream)
                assert next(left_lines).startswith("data: ")
                third = threading.Thread(
                    target=lambda: replies.append(
                        server.client().chat.completions.create(model="m", messages=HELLO, temperature=0, max_tokens=8)
                    )
                )
                third.start()
                deadline = time.monotonic() + 60
                while metric("requests_deferred") < 1:  # the third waits: no sequence is free
                    assert time.monotonic() < deadline and third.is_alive(), "the third was not deferred"
                    time.sleep(0.05)
            third.join(timeout=120)  # the other client has hung up: its sequence answers the third
            after = [line for line in kept_lines if line.startswith("data: ")]
        assert replies and replies[0].choices[0].message.content
        assert len(after) > 8  # the kept stream went on after the third was answered
        answered = answered_lines(server, 3)
        assert "finish cancelled" in answered[0], answered
    finally:
        assert server.stop() == 0


# --- the engine thread keeps serving ------------------------------------------------------


class Decoder:
    """An engine's stand-in for the EngineThread: decodes by failing once, works idle by failing once."""

    def __init__(self) -> None:
        self.decode_fails = self.idle_fails = True

    def decode(self, passes: list[Pass]) -> None:
        if self.decode_fails:
            self.decode_fails = False
            raise RuntimeError("a bug in a decode")
        for one in passes:
            one.logits = np.zeros(1)

    def idle_step(self) -> bool:
        if self.idle_fails:
            self.idle_fails = False
            raise RuntimeError("a bug in idle work")
        return False

    def idle_due(self) -> float | None:
        return None


def two_passes(name: str):
    """A task of two target passes: its name, or the first pass's error."""
    for _ in range(2):
        one = Pass(seq=0, tokens=[1])
        yield one
        one.result()
    return name


def test_a_task_an_interactive_one_holds_up_reads_its_decoded_pass_before_the_next_decode():
    """A chat's pass is decoded, then an editor's completion comes and takes the decodes alone: the
    chat first reads what its pass decoded (llama.cpp's logits are a view the next decode overwrites:
    read after it, they were another pass's, or freed memory), then waits with its next pass held."""
    decodes = [0]

    def decode(passes: list[Pass]) -> None:
        decodes[0] += 1
        for one in passes:
            one.logits = np.array([decodes[0]])  # valid until the next decode

    def task(name: str, passes: int):
        for _ in range(passes):
            one = Pass(seq=0, tokens=[1])
            yield one
            assert one.result()[0] == decodes[0], f"{name} read its pass after another decode"
        return name

    scheduler = Scheduler(decode, parallel=2)
    chat = Task(Future(), task, ("chat", 3))
    scheduler.add(chat)
    scheduler.step()  # the chat's first pass, decoded
    infill = Task(Future(), task, ("infill", 2), interactive=True)
    scheduler.add(infill)
    while scheduler.running or scheduler.waiting:
        scheduler.step()
    assert infill.future.result() == "infill" and chat.future.result() == "chat"


def test_tasks_waiting_for_a_turn_start_when_the_running_ones_end():
    """One task at a time: every one queued behind the first is answered, none waits for a
    request that never comes (the last of 8 clients' requests once hung 120 s in CI)."""
    thread = EngineThread(parallel=1)
    thread.engine = Decoder()
    thread.engine.decode_fails = thread.engine.idle_fails = False
    futures = [thread.start(two_passes, f"task {i}") for i in range(4)]
    assert [f.result(timeout=10) for f in futures] == [f"task {i}" for i in range(4)]
    thread.close()


def test_idle_work_that_waits_for_time_is_done_when_it_is_due():
    """Idle work due later (a saved prompt state written once unused for a while): with nothing
    queued, the thread wakes when it is due and does it, rather than sleep until the next request."""

    class Later(Decoder):
        def __init__(self) -> None:
            self.decode_fails = self.idle_fails = False
            self.due_at, self.done = perf_counter() + 0.5, threading.Event()

        def idle_step(self) -> bool:
            if self.done.is_set() or perf_counter() < self.due_at:
                return False
            self.done.set()
            return True

        def idle_due(self) -> float | None:
            return None if self.done.is_set() else max(0.0, self.due_at - perf_counter())

    thread = EngineThread(parallel=1)
    thread.engine = Later()
    assert thread.start(two_passes, "job").result(timeout=10) == "job"
    assert thread.engine.done.wait(timeout=10)
    thread.close()


def test_a_failing_decode_or_idle_work_fails_its_step_alone_and_the_thread_goes_on():
    """A bug in a decode or in idle work: the tasks in that step fail with it, the thread goes on."""
    thread = EngineThread(parallel=2)
    thread.engine = Decoder()
    with pytest.raises(RuntimeError, match="a bug in a decode"):
        thread.start(two_passes, "first").result(timeout=10)
    time.sleep(3 * REST_S)  # idle now: the idle work fails
    assert not thread.engine.idle_fails
    assert thread.start(two_passes, "after").result(timeout=10) == "after"
    thread.close()


def test_sequences_split_the_default_context_and_a_longer_prompt_names_the_flags(smollm2_path):
    """As llama-server's slots split its context, sequences split the default one (the 1.5B
    pair's server of four held 6.3 GB when each had all of it); a prompt longer than a
    sequence's share is refused naming --ctx and --parallel."""
    with Model(smollm2_path) as alone, Model(smollm2_path, n_seq=2) as two:
        assert alone.n_ctx == alone.n_ctx_train == 8192 and two.n_ctx == 4096
    with edgespec.load("smollm2-self", parallel=2, progress=False) as engine:
        with pytest.raises(EdgespecError) as refused:
            engine.start("word " * 5000, raw=True, max_tokens=1)
    assert "holds 4096 tokens for each of 2 requests at once" in str(refused.value)
    assert "--ctx" in str(refused.value) and "--parallel" in str(refused.value)
