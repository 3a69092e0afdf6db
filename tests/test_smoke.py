"""Every documented way to run, on SmolLM2, a few tokens each: the CLI's `generate` for
every model source x draft mode x gamma x sampling, `chat` with a target alone, `bench`,
`pull`, `models`, and the library's `load()` variants and `Engine` with any drafter.
Each one answers, or fails with the one-line error the README promises."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from test_cli import assert_one_line_error, run
from test_tui import send

import edgespec
from edgespec import Draft, Drafter, Engine, Model
from edgespec.modes import MODES
from tui.app import ChatApp

FEW = ["--max-tokens", "4", "--ctx", "512"]
PROMPT = "Repeat exactly: red green blue, red green blue, red green blue."


@pytest.fixture(scope="module")
def sources(smollm2_path, requantized_path):
    return {
        "pair": ["--pair", "smollm2-self"],
        "target-alone": ["--target", "smollm2-135m"],
        "paths": ["--target", str(smollm2_path), "--draft", str(requantized_path)],
    }


@pytest.mark.parametrize(
    "sampling", [["--temperature", "0"], ["--temperature", "0.8", "--seed", "3"]], ids=["greedy", "sampled"]
)
@pytest.mark.parametrize("gamma", ["3", "auto"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("source", ["pair", "target-alone", "paths"])
def test_generate_matrix(capsys, sources, source, mode, gamma, sampling):
    argv = ["generate", PROMPT, *sources[source], "--draft-mode", mode, "--gamma", gamma, *sampling, *FEW, "--json"]
    code, out, err = run(capsys, *argv)
    if source == "target-alone" and mode in ("model", "hybrid"):
        assert_one_line_error(code, err, f"draft mode '{mode}' needs a draft model")
        return
    assert code == 0, err
    stats = json.loads(out)["stats"]
    assert 1 <= stats["n_tokens"] <= 4
    # rounds came only from drafters the mode allows and that exist
    allowed = {"off", *mode.sources} - ({"model"} if source == "target-alone" else set())
    assert set(stats["rounds_by_source"]) <= allowed, stats["rounds_by_source"]
    assert stats["mode"] == ("target-only" if mode == "off" else "speculative")


@pytest.mark.parametrize(
    "extra",
    [
        ["--no-draft"],
        ["--raw"],
        ["--stop", "blue"],
        ["--top-k", "0", "--top-p", "1", "--min-p", "0", "--seed", "1"],
        ["--threads", "1", "--gpu-layers", "0", "--offline"],
    ],
)
@pytest.mark.parametrize("source", ["pair", "target-alone"])
def test_generate_streams_with_options(capsys, sources, source, extra):
    code, out, err = run(capsys, "generate", PROMPT, *sources[source], *FEW, *extra)
    assert code == 0, err
    assert re.search(r"\] [0-4] tokens, [\d.]+ tok/s", err.splitlines()[-1]), err  # (raw text may end at once)
    if "--stop" in extra:
        assert "blue" not in out


def test_python_dash_m_and_console_script_help():
    import subprocess
    import sys

    for argv in ([sys.executable, "-m", "edgespec", "--help"], ["edgespec", "--help"]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "generate" in done.stdout and "bench" in done.stdout


@pytest.mark.parametrize("command", ["generate", "chat", "pull", "models", "bench", "serve"])
def test_every_subcommand_has_help(capsys, command):
    with pytest.raises(SystemExit) as exit:
        edgespec.cli.main([command, "--help"])
    assert exit.value.code == 0 and "usage: edgespec " + command in capsys.readouterr().out


def test_pull_and_models(capsys, smollm2_path):
    code, out, _ = run(capsys, "pull", "smollm2-135m", "--offline")
    assert code == 0 and str(smollm2_path) in out
    code, out, _ = run(capsys, "models")
    assert code == 0 and "smollm2-135m" in out and "downloaded" in out


@pytest.mark.parametrize("source", ["pair", "target-alone"])
@pytest.mark.slow
def test_bench_small(capsys, sources, source):
    """Two of the shipped classes (a predicted edit, the schema class and its no-grammar row):
    every mode, the text report and the llama-cpp-python baseline."""
    classes = ["--prompts", "code-edit-pred,json"]
    code, out, err = run(capsys, "bench", *sources[source], *classes, "--max-tokens", "3", "--json")
    assert code == 0, err
    report = json.loads(out)
    modes = set(report["prompts"][0]["modes"])
    # chains: auto with chains of drafts only, against which auto's trees are priced
    assert modes == ({"off", "copy", "auto", "chains"} | ({"model", "hybrid"} if source == "pair" else set()))
    first = report["prompts"][0]
    assert first["best_fixed"] in modes - {"chains"} and first["auto_vs_best_fixed"] > 0
    assert first["auto_vs_chains"] > 0 and first["modes"]["chains"]["tree_rounds"] == 0  # chains: no trees
    assert first["modes"]["auto"]["tree_rounds"] <= sum(first["modes"]["auto"]["rounds_by_source"].values())
    assert all(m["prefill_tokens_per_s"] > 0 for m in first["modes"].values())
    argv = ["bench", *sources[source], *classes, "--max-tokens", "3", "--repeats", "2", "--llama-baseline"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    rows = [line.split()[:2] for line in out.splitlines()]
    assert ["code-edit-pred", "llama"] in rows and ["code-edit-pred", "ceiling"] in rows
    assert ["json", "no-grammar"] in rows and "tokens/answer:" in out  # the schema class, and its price
    assert "V(k) in target steps" in out and "the best fixed mode" in out and "auto with chains only" in out


def test_bench_bad_repeats(capsys):
    assert_one_line_error(*run(capsys, "bench", "--pair", "smollm2-self", "--repeats", "0")[::2], "repeats")


def chat_command_stats(monkeypatch, *argv: str):
    """`edgespec chat ARGV` through the CLI, the app run headless by Textual's autopilot: the
    stats of its answer to one message."""
    answers = []

    async def autopilot(pilot):
        await send(pilot, pilot.app, "Say hello.")
        answers.append(pilot.app.last_stats)
        pilot.app.exit()

    real_run = ChatApp.run
    monkeypatch.setattr(ChatApp, "run", lambda app: real_run(app, headless=True, size=(100, 30), auto_pilot=autopilot))
    assert edgespec.cli.main(["chat", *argv, "--max-tokens", "6", "--temperature", "0"]) == 0
    (stats,) = answers
    return stats


@pytest.mark.parametrize("source", ["target-alone", "pair"])
def test_chat_command_answers(monkeypatch, sources, source):
    stats = chat_command_stats(monkeypatch, *sources[source], "--ctx", "1024")
    assert stats.n_tokens > 0 and stats.mode == "speculative"


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--temperature", "-1"], ["temperature"]),
        (["--max-tokens", "0"], ["max-tokens"]),
        (["--gamma", "0"], ["gamma"]),
        (["--target", "smollm2-135m", "--draft-mode", "model"], ["needs a draft model"]),
    ],
)
def test_chat_bad_settings_fail_before_the_app_starts(capsys, monkeypatch, extra, words):
    monkeypatch.setattr(ChatApp, "run", lambda app: pytest.fail("the app started"))
    assert_one_line_error(*run(capsys, "chat", *extra)[::2], *words)


# --- the library ----------------------------------------------------------------


class RepeatLastDrafter(Drafter):
    """A custom drafter (a subclass of edgespec.Drafter): proposes the last token again."""

    def begin(self, prompt):
        self.begun = len(prompt)

    def accept(self, context):
        self.accepted = len(context)

    def draft(self, context, n, params, rng, stop_below=(), grammar=None):
        return Draft([context[-1]] * n, None, source="model")


def check(generation: edgespec.Generation, max_tokens: int) -> None:
    assert 1 <= generation.stats.n_tokens <= max_tokens and generation.text
    assert generation.finish_reason in ("length", "stop", "stop_string")


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"target": "smollm2-135m"},
        {"target": "smollm2-135m", "draft_mode": "copy", "gamma": 4},
        {"target": "smollm2-135m", "draft": "smollm2-135m", "draft_mode": "hybrid"},
        {"gamma": "auto", "draft_mode": "off"},
    ],
    ids=["pair", "target-alone", "target-copy", "target-draft-hybrid", "off"],
)
def test_load_variants_stream_generate_chat(kwargs):
    pair = "smollm2-self" if "target" not in kwargs else None
    with edgespec.load(pair, n_ctx=512, progress=False, **kwargs) as engine:
        events = list(engine.stream(PROMPT, max_tokens=4, temperature=0))
        assert events[-1].done and all(e.source in ("draft", "target") for e in events[:-1])
        check(engine.generate(PROMPT, max_tokens=4, seed=2), 4)
        check(engine.generate(PROMPT, max_tokens=4, gamma=2, temperature=0), 4)
        check(engine.chat([{"role": "user", "content": "Hi!"}], max_tokens=4), 4)
        check(engine.generate(PROMPT, max_tokens=4, speculative=False), 4)


def test_load_refuses_a_model_mode_without_a_draft_model():
    with pytest.raises(edgespec.EdgespecError, match="needs a draft model"):
        edgespec.load(target="smollm2-135m", draft_mode="model")


@pytest.mark.parametrize("draft_mode", ["auto", "model", "hybrid", "copy"])
@pytest.mark.parametrize("gamma", [None, 3])
def test_engine_with_a_custom_drafter(smollm2, draft_mode, gamma):
    engine = Engine(smollm2, RepeatLastDrafter(), gamma=gamma, draft_mode=draft_mode, owned=[])
    for temperature in (0, 0.8):
        check(engine.generate(PROMPT, max_tokens=6, temperature=temperature, seed=1), 6)
    if draft_mode == "model" and gamma:  # a fixed mode and length draft every round (auto may choose none)
        assert engine.generate(PROMPT, max_tokens=6).stats.rounds_by_source.get("model", 0) > 0


def test_engine_without_a_drafter(smollm2):
    engine = Engine(smollm2, owned=[])
    result = engine.generate(PROMPT, max_tokens=8, temperature=0)
    check(result, 8)
    assert set(result.stats.rounds_by_source) <= {"off", "copy"}
    with pytest.raises(edgespec.EdgespecError, match="needs a draft model"):
        Engine(smollm2, draft_mode="model")


def test_model_class_is_usable_directly(smollm2_path):
    model = Model(smollm2_path, n_ctx=128)
    logits = model.eval(model.tokenize("Hello"))
    assert logits.shape == (model.n_vocab,) and np.isfinite(logits).all()
    model.close()
