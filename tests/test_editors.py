"""Editors' completions on the default pair (Qwen2.5-Coder 1.5B drafted by 0.5B, which have
fill-in-the-middle tokens): exact answers with speculation on and off, the editors' stops,
a client that leaves mid-prefill, and the recorded bodies of llama.vscode, Continue and Tabby
(../shared/clients) answered by `edgespec serve` and read as those clients read them."""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import replace

import httpx
import pytest
from conftest import GpuCosts
from reference import assert_greedy_as_llama
from test_clients import recorded
from test_parallel import runs_in_turns
from test_server import Server

import edgespec
from edgespec import Infill, Request, SamplingParams
from edgespec.bench import editors
from edgespec.bench.editors import Keystroke, sessions
from edgespec.run import PREFILL_CHUNK
from edgespec.server.llama_api import request_of

pytestmark = pytest.mark.slow  # the Qwen pair, behind a server

CTX = 4096
GREEDY = SamplingParams(temperature=0)
FIZZBUZZ = Infill("def fizzbuzz(n):\n", "\n\nfor line in fizzbuzz(15):\n    print(line)\n", "    ")


@pytest.fixture(scope="module")
def engine():
    with edgespec.load("qwen-coder", n_ctx=CTX, progress=False, parallel=2) as e:
        yield e


@pytest.fixture(scope="module")
def server():
    s = Server("--pair", "qwen-coder", "--ctx", str(CTX))
    yield s
    assert s.stop() == 0
    assert not any(" 500 " in line or "failed on the server's side" in line for line in s.lines), "".join(s.lines)


def greedy_request(keystroke: Keystroke, **changes) -> Request:
    """A keystroke's request as llama.vscode sends it, greedy, one answer, no time limit."""
    body = keystroke.body() | {"samplers": ["temperature"], "temperature": 0, "t_max_predict_ms": 0, "n_cmpl": 1}
    return replace(request_of(body, infill=True), **changes)


def nearby(keystroke: Keystroke, above: int = 40, below: int = 12) -> Keystroke:
    """The keystroke with only the lines around the cursor (no other files' chunks): a prompt of a
    few hundred tokens where llama.vscode's is two thousand, for tests that judge the answers
    against Llama's (the reference reads every prompt again)."""
    infill = keystroke.infill
    prefix = "".join(infill.prefix.splitlines(keepends=True)[-above:])
    suffix = "".join(infill.suffix.splitlines(keepends=True)[:below])
    return replace(keystroke, infill=Infill(prefix, suffix, infill.cursor_line))


def healed_prompt(engine, run) -> tuple[list[int], bytes]:
    """The prompt a run read (its layout, healed) and the text it was healed of."""
    tokens = run.layout.tokens
    return tokens[: len(run.prompt)], b"".join(map(engine.target.piece, tokens[len(run.prompt) :]))


def test_greedy_fim_answers_are_the_same_with_speculation_on_and_off(engine):
    """Keystrokes mid-word: the prompt is healed, and every mode's answer is Llama's given the text."""
    drafted, healed = 0, 0
    for session in sessions(2):
        for keystroke in session.keystrokes[3:4]:
            request = greedy_request(nearby(keystroke), max_tokens=24, min_indent=0)
            for mode, gamma in (("off", None), ("copy", 8), ("model", 3), ("auto", "auto")):
                run = engine.start(replace(request, draft_mode=mode, gamma=gamma))
                tokens = [e.token for e in engine.events(run) if not e.done]
                assert run.stats.finish_reason in ("length", "stop"), run.stats.finish_reason
                prompt, owed = healed_prompt(engine, run)
                assert prompt == run.prompt and prompt.count(engine.target.fim.middle) == 1
                assert_greedy_as_llama(f"{session.name} {mode}", engine, prompt, tokens, limit=24, healed=owed)
                drafted, healed = drafted + run.stats.drafted, healed + len(owed)
    assert drafted > 0 and healed > 0  # speculation was compared, on healed prompts


def test_an_infill_decoded_beside_a_chat_is_llamas_and_so_is_the_chat(engine):
    """A chat answer and an editor's completion, their passes decoded together as the server's
    scheduler decodes them, each speculating: both are Llama's answers alone."""
    chat = [{"role": "user", "content": "Write a haiku about the sea."}]
    request = Request(FIZZBUZZ, GREEDY, max_tokens=24, min_indent=0, draft_mode="auto")
    runs = [engine.start(chat, temperature=0, max_tokens=32), engine.start(request)]
    answer, completion = runs_in_turns(engine, runs)
    assert_greedy_as_llama("chat beside an infill", engine, chat, answer, limit=32)
    prompt, owed = healed_prompt(engine, runs[1])
    assert_greedy_as_llama("infill beside a chat", engine, prompt, completion, limit=24, healed=owed)
    assert runs[0].stats.n_tokens and runs[1].stats.n_tokens


def test_a_keystroke_reads_what_it_typed_and_enter_keeps_the_head(engine):
    """Typing on a line reads the new characters' tokens only (and the healed word's again); Enter
    does too, its middle the line before and the new one; while idle, the head at the new line is
    read, and the next keystroke is anchored there."""
    engine.forget()
    keys = sessions(1)[0].keystrokes
    enter = next(i for i, k in enumerate(keys) if k.after_enter)

    def typed(key):  # the target's reads alone (no draft model's: suite time)
        run = engine.start(greedy_request(key, max_tokens=8, draft_mode="off"))
        list(engine.events(run))
        return run

    first = typed(keys[enter - 3])
    assert first.stats.n_prompt_cached == 0 and first.layout.anchor == len(keys[enter - 3].infill.prefix)
    for key in keys[enter - 2 : enter + 1]:
        run = typed(key)
        assert run.stats.n_prompt - run.stats.n_prompt_cached <= 3 and run.layout.head is first.layout.head
    assert run.layout.anchor < len(key.infill.prefix) and b"\n" in b"".join(map(engine.target.piece, run.layout.middle))
    engine.upkeep()  # idle: the accepted suggestion, and the head at the new line
    after = typed(keys[enter + 1])
    assert after.layout.anchor == len(keys[enter + 1].infill.prefix) and after.layout.head is not first.layout.head
    assert after.stats.n_prompt - after.stats.n_prompt_cached <= 3


def test_the_last_suggestion_drafts_the_next_keystroke_and_tab_finds_its_answer_read(engine, monkeypatch):
    """The user types the suggestion's first character: the rest is drafted (one round where the
    target agrees, on costs where a long draft pays: this CPU's measured V(k) may make it several)
    and the answer is the same; Tab (the suggestion accepted) finds its prompt read and its answer
    drafted while the engine was idle."""
    monkeypatch.setattr(engine, "costs", GpuCosts())
    key = sessions(1)[0].keystrokes[5]  # (its head, that of the line typed above, is read there: suite time)
    shown = engine.generate(greedy_request(key, max_tokens=16, draft_mode="copy"))
    assert len(shown.text.split("\n")[0]) > 2, shown.text
    typed = replace(key.infill, cursor_line=key.infill.cursor_line + shown.text[0])
    next_key = engine.generate(greedy_request(replace(key, infill=typed), max_tokens=16, draft_mode="copy"))
    assert next_key.text.split("\n")[0] == shown.text[1:].split("\n")[0]
    assert next_key.stats.accepted_prediction_tokens > 0 and next_key.stats.rounds <= 4, next_key.stats.as_dict()
    engine.upkeep()  # the accepted suggestion is answered while idle
    accepted = Infill.at_cursor(typed.before + next_key.text, typed.suffix, typed.chunks)
    tab = engine.generate(greedy_request(replace(key, infill=accepted), max_tokens=11, draft_mode="copy"))
    assert tab.stats.n_prompt - tab.stats.n_prompt_cached <= 3 and tab.stats.accepted_prediction_tokens > 0


def test_the_answer_ends_at_an_end_of_generation_token_of_fim(engine):
    """Qwen-Coder ends a middle with <|endoftext|>, <|fim_pad|>, <|file_sep|> or <|repo_name|>
    (llama.cpp #9606): each is an end of generation, none is written out as text."""
    target = engine.target
    for token in (151643, 151662, target.fim.file_sep, target.fim.repo):
        assert target.is_eog(token), token
    answer = engine.generate(Request(Infill("x = [1, 2, 3]\ntotal = ", "\nprint(total)\n"), GREEDY, max_tokens=32))
    assert answer.stats.finish_reason in ("stop", "length") and "<|" not in answer.text, answer.text


def test_a_deadline_ends_the_answer_at_its_next_newline(engine):
    whole = engine.generate(Request(FIZZBUZZ, GREEDY, max_tokens=48))
    assert whole.text.count("\n") >= 2, whole.text  # several lines: the deadline has one to cut
    cut = engine.generate(Request(FIZZBUZZ, GREEDY, max_tokens=48, line_deadline_s=0.0))
    assert cut.stats.finish_reason == "deadline"
    assert cut.text == whole.text[: whole.text.index("\n") + 1]


def test_n_indent_ends_the_answer_before_a_line_indented_less(engine):
    whole = engine.generate(Request(FIZZBUZZ, GREEDY, max_tokens=48)).text
    lines = whole.split("\n")
    starts = [len("\n".join(lines[:i])) + 1 for i in range(1, len(lines))]  # where lines 1.. begin
    indents = [len(line) - len(line.lstrip(" ")) for line in lines[1:]]
    assert min(indents[:-1]) == 8 and max(indents) == 12, whole  # if-branches at 8, their bodies at 12
    for min_indent in (8, 12):
        cut = engine.generate(Request(FIZZBUZZ, GREEDY, max_tokens=48, min_indent=min_indent))
        rows = zip(starts, indents, lines[1:], strict=True)
        under = [start for start, indent, line in rows if indent < min_indent and line]
        if under:  # the text ends with the newline before the first line indented less
            assert cut.stats.finish_reason == "indent" and cut.text == whole[: under[0]], min_indent
        else:
            assert cut.stats.finish_reason == "length" and cut.text == whole, min_indent
    assert min_indent == 12 and under  # 8 kept every line, 12 cut one


def test_a_cancelled_run_stops_its_prefill_and_leaves_what_it_read_in_the_cache(engine, monkeypatch):
    long = Infill("import os\n" * 300, "\n", "def main():\n    ", ())
    request = Request(long, GREEDY, max_tokens=8, draft_mode="off")
    cancelled = threading.Event()
    passes, target_eval = [], engine.target.eval

    def eval_then_leave(tokens, **kwargs):  # the client hangs up while the first chunk is read
        passes.append(len(tokens))
        cancelled.set()
        return target_eval(tokens, **kwargs)

    engine.forget()
    monkeypatch.setattr(engine.target, "eval", eval_then_leave)
    stats = list(engine.events(engine.start(request, cancelled=cancelled)))[-1].stats
    monkeypatch.undo()
    assert stats.finish_reason == "cancelled" and stats.n_tokens == 0
    assert passes == [PREFILL_CHUNK] and stats.n_prompt > 3 * PREFILL_CHUNK
    again = engine.generate(request).stats  # the next keystroke's request starts where it stopped
    assert again.n_prompt_cached == PREFILL_CHUNK and again.finish_reason == "length"


def test_fim_on_a_model_without_fim_tokens_says_which_are_missing(self_engine):
    with pytest.raises(
        edgespec.EdgespecError, match=r"no fill-in-the-middle tokens \(prefix, suffix, middle missing\)"
    ):
        self_engine.generate(Request(FIZZBUZZ, GREEDY, max_tokens=4))


def test_bench_fim_class_types_a_session(engine, capsys, monkeypatch):
    """The class's rows and report, on a smaller window of lines than llama.vscode's (the bench's
    figures use its own; here each mode's first prompt would take half a minute to read)."""
    monkeypatch.setattr(editors, "PREFIX_LINES", 48)
    monkeypatch.setattr(editors, "SUFFIX_LINES", 16)
    monkeypatch.setattr(editors, "CHUNK_LINES", 16)
    report = editors.run_fim(engine, ["off", "auto"], repeats=1, log=print, count=1, keystrokes=4)
    assert report["keystrokes"] == 4
    for row in report["modes"].values():
        assert 0 < row["first_p50_ms"] <= row["line_p50_ms"] <= row["whole_p50_ms"] and 0 <= row["right"] <= 1
        assert 0 < row["prompt_read"] <= 3  # a keystroke reads what it typed
    assert report["modes"]["off"]["vs_off_p50"] == 1
    editors.print_rows(report)
    out = capsys.readouterr().out
    assert out.count(": first ") == 8 and re.search(r"^auto +\d+ +\d+ +\d+ +\d+ +\d+ +\d+ +[\d.]+x", out, flags=re.M)


# --- the recorded clients --------------------------------------------------------------


def post(server: Server, path: str, body: dict, timeout: float = 300) -> httpx.Response:
    """A request to llama-server's own endpoints, at the server's root."""
    return httpx.post(server.url.removesuffix("/v1") + path, json=body, timeout=timeout)


def logged(server: Server, since: int, pattern: str) -> str:
    """The first line of the server's log from line `since` on that matches `pattern` (waiting
    for it: the log is read apart)."""
    for _ in range(100):
        if found := [line for line in server.lines[since:] if re.search(pattern, line)]:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} in the log: " + "".join(server.lines[since:]))


def test_llama_vscode_warms_up_then_gets_three_answers(server):
    prep = post(server, "/infill", recorded("llama-vscode-infill-prep.json")["body"])
    assert prep.status_code == 200, prep.text
    assert prep.json()["content"] == "" and prep.json()["timings"]["predicted_n"] == 0
    response = post(server, "/infill", recorded("llama-vscode-infill.json")["body"])
    assert response.status_code == 200, response.text
    answers = response.json()
    # llama.vscode: an array of results when n_cmpl > 1, each read for `content`
    assert isinstance(answers, list) and [a["index"] for a in answers] == [0, 1, 2]
    for answer in answers:
        assert isinstance(answer["content"], str) and answer["truncated"] is False
        assert answer["generation_settings"]["n_ctx"] == CTX and answer["tokens_cached"] > 0
        timings = answer["timings"]
        for key in (
            "prompt_n",
            "prompt_ms",
            "prompt_per_second",
            "predicted_n",
            "predicted_ms",
            "predicted_per_second",
        ):
            assert isinstance(timings[key], (int, float)), key
        assert answer["stop_type"] in ("eos", "limit", "word")
    # the warm-up's chunks were read once: the first answer's prompt starts from them
    assert answers[0]["timings"]["cache_n"] > 0
    assert answers[1]["timings"]["prompt_n"] <= 1  # the next answers re-read nothing


def test_continue_streams_content_and_aborts_as_the_user_types_on(server):
    """Continue reads `content` from each event, and aborts the request once it has what it
    shows (or the user typed on): the server stops that answer."""
    body = recorded("continue-completion.json")["body"]
    root, since = server.url.removesuffix("/v1"), len(server.lines)
    with httpx.stream("POST", root + "/completion", json=body, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        pieces = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                pieces.append(json.loads(line[len("data: ") :]))
            if len(pieces) == 8:
                break  # the abort
    assert all(e["stop"] is False and isinstance(e["content"], str) for e in pieces)
    text = "".join(e["content"] for e in pieces)
    assert text and not any(stop in text for stop in body["stop"])
    with_limit = post(server, "/completion", body | {"n_predict": 6}, timeout=300)  # read to its end
    *rest, last = [
        json.loads(line[len("data: ") :]) for line in with_limit.text.splitlines() if line.startswith("data: ")
    ]
    assert last["stop"] is True and last["stop_type"] == "limit" and last["timings"]["predicted_n"] == 6
    assert "".join(e["content"] for e in rest) == text[: len("".join(e["content"] for e in rest))]
    logged(server, since, r"answered: .* finish cancelled")  # the aborted answer ended there


def test_continues_fim_markup_is_answered_as_the_infill_it_stands_for(server):
    """Continue writes the FIM prompt itself ([PRE]prefix[SUF]suffix[MID]): /completion lays it
    out as /infill does (the cursor line after [MID], healed), so its answer is /infill's, and
    the next keystroke reads its own characters (not the cursor line and the suffix again), the
    suggestion's rest drafted."""
    body = recorded("continue-completion.json")["body"] | {"stream": False, "n_predict": 12, "temperature": 0}
    prefix, rest = body["prompt"].removeprefix("<|fim_prefix|>").split("<|fim_suffix|>")
    suffix = rest.removesuffix("<|fim_middle|>")
    line = prefix.rfind("\n") + 1
    infill = {"input_prefix": prefix[:line], "prompt": prefix[line:], "input_suffix": suffix}
    answer = post(server, "/completion", body).json()
    assert answer["content"] == post(server, "/infill", body | infill).json()["content"], answer
    typed = f"<|fim_prefix|>{prefix}{answer['content'][0]}<|fim_suffix|>{suffix}<|fim_middle|>"  # as suggested
    keystroke = post(server, "/completion", body | {"prompt": typed}).json()
    assert keystroke["timings"]["prompt_n"] <= 4, keystroke["timings"]
    assert keystroke["speculative"]["accepted_prediction_tokens"] > 0  # the suggestion's rest drafted
    repo = "<|repo_name|>x\n<|file_sep|>a.py\n" + body["prompt"]  # repository-level markup: as written
    assert post(server, "/completion", body | {"prompt": repo}).json()["speculative"]["healed_bytes"] == 0


def test_a_prompt_in_fim_markup_is_read_as_its_infill(engine):
    marked = "<|fim_prefix|>def area(r):\n    ret<|fim_suffix|>\n\nprint(area(2))\n<|fim_middle|>"
    infill = Infill.at_cursor("def area(r):\n    ret", "\n\nprint(area(2))\n")
    assert engine.prompt_tokens(marked, raw=True) == engine.prompt_tokens(infill)


def test_tabby_streams_choices_of_a_suffix_completion(server):
    """Tabby's body ends at `if part.` before a suffix of `quantity < quantity:`: an empty middle
    is a right answer too (at its temperature 0.1, about one answer in 500 heals `.` as `.`, then
    ends), so what is judged is the stream's form and that a non-empty answer goes on from `part.`."""
    body = recorded("tabby-completions.json")["body"]
    chunks = list(server.client().completions.create(**body))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    if text:
        assert finishes in (["stop"], ["length"]) and text[0].isalnum(), (finishes, text)
    else:
        assert finishes == ["stop"], finishes


def test_a_completion_that_ends_mid_word_is_healed(server):
    """/completion heals a prompt's last word unless told not to: the answer goes on from the
    user's characters, which it does not return."""
    body = {"prompt": "def fizzbuzz(n):\n    for i in ran", "n_predict": 6, "temperature": 0}
    healed = post(server, "/completion", body).json()
    assert healed["speculative"]["healed_bytes"] == len(" ran") and healed["content"].startswith("ge("), healed
    plain = post(server, "/completion", body | {"heal": False}).json()
    assert plain["speculative"]["healed_bytes"] == 0 and plain["timings"]["prompt_n"] + plain["timings"]["cache_n"] == (
        healed["timings"]["prompt_n"] + healed["timings"]["cache_n"] + 1
    )


def test_n_cmpl_answers_are_the_single_answers_of_the_following_seeds(server):
    body = {"input_prefix": "def area(r):\n", "input_suffix": "\n", "prompt": "    return ", "n_predict": 12}
    body |= {"temperature": 0.9, "seed": 7, "draft_mode": "off"}
    both = post(server, "/infill", body | {"n_cmpl": 2}).json()
    second = post(server, "/infill", body | {"seed": 8}).json()
    assert [a["generation_settings"]["seed"] for a in both] == [7, 8]  # each answer says its own seed
    assert both[1]["content"] == second["content"]


def test_a_client_that_hangs_up_stops_its_answer(server):
    body = {"prompt": "import os\n" * 300, "n_predict": -1}  # (an answer that never ends)
    since = len(server.lines)
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/completion", body, timeout=1.0)
    reply = post(server, "/infill", {"input_prefix": "x = ", "input_suffix": "\n", "n_predict": 4})
    assert reply.status_code == 200
    hung_up = logged(server, since, r"answered: .* finish cancelled")
    assert int(re.search(r"answered: (\d+)\+", hung_up).group(1)) > 800  # this request's, cut short


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/infill", {"input_suffix": ""}, "input_prefix"),
        ("/infill", {"input_prefix": "", "input_suffix": "", "n_cmpl": 7}, "n_cmpl"),
        ("/infill", {"input_prefix": "", "input_suffix": "", "samplers": ["mirostat"]}, "samplers"),
        ("/completion", {"prompt": ""}, "prompt"),
        ("/completion", {"prompt": "x", "n_predict": -2}, "n_predict"),
        ("/v1/completions", {"prompt": "x", "suffix": 3}, "suffix"),
        ("/completion", {"prompt": "x", "heal": "yes"}, "heal"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "heal": True}, "heal"),
    ],
)
def test_bad_editor_requests_get_llama_server_errors(server, path, body, param):
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
