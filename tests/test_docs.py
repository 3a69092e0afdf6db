"""The commands and examples of the README, of the pages of docs/ and of the package docstring,
run as written (on the default pair, as a newcomer would)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from pages import code_blocks, page, section

import edgespec

README = page("README.md")


@pytest.mark.slow
def test_readme_quick_start_runs_the_main_job():
    first = code_blocks(README, "sh")[0].strip()
    install, command = first.split(" && ", 1)
    assert install == "pip install -e ."  # CI runs the install; here the main job
    done = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "def " in done.stdout and "tok/s" in done.stderr.splitlines()[-1]


def test_readme_test_command_is_what_ci_runs():
    second = code_blocks(README, "sh")[1].strip()
    ci = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    for part in second.split(" && "):
        assert part in ci


@pytest.mark.slow
def test_readme_fast_lane_is_a_real_subset():
    """The README's fast lane collects most of the tests, and leaves the slow ones out."""
    command = code_blocks(README, "sh")[2].strip()
    assert shlex.split(command)[:2] == ["pytest", "-m"]

    def collected(*args: str) -> int:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", *args],
            cwd=Path(__file__).parents[1],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode in (0, 5), done.stdout + done.stderr  # 5: none collected
        found = re.search(r"(\d+)(?:/\d+)? tests? collected", done.stdout)
        return int(found.group(1)) if found else 0

    fast, every = collected(*shlex.split(command)[1:]), collected()
    assert every / 3 < fast < every
    assert collected("-m", "not slow", "tests/test_qwen.py", "tests/test_editors.py") == 0


@pytest.mark.slow
def test_readme_library_example(capsys):
    (example,) = [b for b in code_blocks(README, "python") if "edgespec.load" in b]
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert len(out) > 200 and "tokens" in out
    assert namespace["result"].text and namespace["reply"].text
    assert [call.name for call in namespace["asked"].tool_calls] == ["get_weather"]


@pytest.mark.slow
def test_package_docstring_example(capsys):
    example = "\n".join(line for line in edgespec.__doc__.splitlines()[2:])
    exec(compile(example, "edgespec/__init__.py", "exec"), {})
    assert "def " in capsys.readouterr().out


@pytest.fixture(scope="module")
def default_server():
    """`edgespec serve` on the default pair, on a free port instead of 8080 (never colliding)."""
    from test_server import Server

    server = Server("--pair", "qwen-coder")
    yield server
    assert server.stop() == 0


@pytest.mark.slow
def test_readme_openai_client_section(capsys, default_server):
    """The server section's curl and Python examples, against `edgespec serve` on the default pair."""
    server = section(README, "A server for OpenAI clients")
    (shell,) = code_blocks(server, "sh")
    (python,) = code_blocks(server, "python")
    url = default_server.url
    curl = shell.split("\n", 1)[1].replace("\\\n", " ").replace("http://127.0.0.1:8080/v1", url)
    done = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=300)
    reply = json.loads(done.stdout)
    assert reply["choices"][0]["message"]["content"] and "speculative" in reply
    exec(compile(python.replace("http://127.0.0.1:8080/v1", url), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "surface" in out and "accepted_prediction_tokens" in out and "drafted" in out


@pytest.mark.slow
def test_readme_logprobs_section(capsys, default_server):
    """Scoring labels by log-probability (echo, logprobs, max_tokens 0) on the default pair."""
    (python,) = code_blocks(section(page("server.md"), "Log-probabilities"), "python")
    namespace: dict = {}
    exec(compile(python.replace("http://127.0.0.1:8080/v1", default_server.url), "README.md", "exec"), namespace)
    scores = namespace["scores"]
    assert set(scores) == {"positive", "negative"} and all(s < 0 for s in scores.values())
    assert scores["negative"] > scores["positive"]
    assert "-> negative" in capsys.readouterr().out


@pytest.mark.slow
def test_server_page_ollama_example(capsys, default_server):
    """The `ollama` library's chat, as the server page shows it, on the default pair."""
    (python,) = code_blocks(section(page("server.md"), "Ollama's API"), "python")
    host = default_server.url.removesuffix("/v1")
    exec(compile(python.replace("http://127.0.0.1:8080", host), "server.md", "exec"), {})
    out = capsys.readouterr().out
    assert "printf" in out and "tokens;" in out and "format='gguf'" in out


@pytest.mark.slow
def test_readme_editors_section(default_server):
    """The /infill example, and the side-by-side script (edgespec's servers only: llama-server
    is not built here) on one completion."""
    (shell,) = code_blocks(section(README, "Editors"), "sh")
    base = default_server.url.removesuffix("/v1")
    curl = shell.replace("\\\n", " ").replace("http://127.0.0.1:8080", base)
    done = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=300)
    reply = json.loads(done.stdout)
    assert reply["content"] and reply["stop"] is True and "timings" in reply and "speculative" in reply
    assert "scripts/fim_side_by_side.py --llama-server PATH" in page("benchmarks.md")


@pytest.mark.slow
@pytest.mark.parametrize("sampling", ["llama.vscode's", "greedy"])
def test_fim_side_by_side_script_runs(tmp_path, sampling):
    script = Path(__file__).parents[1] / "scripts" / "fim_side_by_side.py"
    argv = [sys.executable, str(script), "--llama-server", "unused", "--sessions", "1", "--keystrokes", "2"]
    argv += ["--ctx", "1024", "--only", "edgespec", "--out", str(tmp_path)]  # a short layout: suite time
    done = subprocess.run(
        [*argv, *(["--greedy"] if sampling == "greedy" else [])], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"\| edgespec( \| \d+){7} \| \d+% \| [\d.]+ \|", done.stdout), done.stdout
    report = json.loads((tmp_path / "results.json").read_text())
    row = report["servers"]["edgespec"]
    assert 0 <= row["right"] <= 1 and 0 < row["read"] <= 3  # a keystroke reads what it typed
    assert report["sampling"] == sampling


@pytest.mark.slow
def test_concurrent_side_by_side_script_runs():
    """The figures for several requests at once come from this script (edgespec's server only
    here: llama-server is not built)."""
    assert "scripts/concurrent_side_by_side.py --llama-server PATH" in page("benchmarks.md").replace("\n", " ")
    script = Path(__file__).parents[1] / "scripts" / "concurrent_side_by_side.py"
    argv = [sys.executable, str(script), "--llama-server", "unused", "--only", "edgespec", "--repeats", "1"]
    argv += ["--max-tokens", "8", "--ctx", "1024"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=tempfile.gettempdir())
    assert done.returncode == 0, done.stderr
    for case in ("infill during a chat", "2 chats", "4 chats"):
        assert re.search(rf"^{case} +edgespec +[\d.]+ +[\d.]+ +[\d.]+x", done.stdout, re.M), done.stdout


def test_memory_lookup_script_runs():
    """The memory's lookup figures come from this script (on a small index here)."""
    assert "scripts/memory_lookup.py --tokens 10000000" in page("benchmarks.md")
    script = Path(__file__).parents[1] / "scripts" / "memory_lookup.py"
    argv = [sys.executable, str(script), "--tokens", "20000", "--lookups", "200"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tempfile.gettempdir())
    assert done.returncode == 0, done.stderr
    assert re.search(r"^lookup \+ continuations: p50 [\d.]+ ms, p90 [\d.]+ ms", done.stdout, re.M), done.stdout
    assert re.search(r"^a 1,000-token answer inserted in \d+ ms", done.stdout, re.M), done.stdout


@pytest.mark.slow
def test_readme_agents_section(capsys, default_server):
    """The Anthropic and Responses examples run against the default pair; the claude and codex
    commands are the ones scripts/agents-bench.sh runs (it needs npm and minutes: not CI)."""
    agents = section(README, "Agents")
    (shell,) = code_blocks(agents, "sh")
    anthropic_example, responses_example = code_blocks(agents, "python")
    base = default_server.url.removesuffix("/v1")
    for example in (anthropic_example, responses_example):
        exec(compile(example.replace("http://127.0.0.1:8080", base), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert out.startswith("tool_use [ToolUseBlock(") and "get_weather" in out and "cache_read_input_tokens" in out
    assert "drafted" in out
    script = (Path(__file__).parents[1] / "scripts" / "agents-bench.sh").read_text()
    for line in shell.splitlines()[1:]:
        words = shlex.split(line.replace("8080", "$port"))[:-1]  # all but the task
        assert all(w in script for w in words if w.startswith("-") or "=" in w or w in ("claude", "codex")), line


@pytest.mark.slow
def test_readme_recurrent_section_command_runs():
    (command,) = code_blocks(section(page("models.md"), "Recurrent, hybrid"), "sh")
    done = subprocess.run(shlex.split(command.strip()), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "tok/s" in done.stderr.splitlines()[-1]


def test_the_readme_is_short_and_every_link_of_the_docs_resolves():
    """A newcomer's README (install, the quick start, a way to use it per section) stays short;
    the pages of docs/ carry the rest, and every link between them lands on a file and heading."""
    assert len(README.splitlines()) <= 250

    def anchors(text: str) -> set[str]:
        headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M)
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}

    docs = Path(__file__).parents[1] / "docs"
    for source in [docs.parent / "README.md", *docs.glob("*.md")]:
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md|)(?:#([\w-]+))?\)", source.read_text()):
            linked = (source.parent / target).resolve() if target else source
            assert linked.is_file(), f"{source.name} links to {target}, which is not there"
            assert not anchor or anchor in anchors(linked.read_text()), f"{source.name}: no #{anchor} in {target}"
