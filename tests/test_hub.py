"""Models by their hub name (hf:OWNER/REPO[:QUANT] or hf:OWNER/REPO/FILE.gguf): edgespec and
huggingface-hub itself against a hub on loopback (fake_hub.py) serving tiny random-weight GGUFs
(tiny_models.py): the file llama-server would choose, a split fetched whole, bytes that do not
match the hub's sha256 refused, a dropped connection and a killed pull resumed, one-line
errors, and a second run that makes no network call."""

from __future__ import annotations

import hashlib
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
from fake_hub import FakeHub
from pages import code_blocks, page, section
from test_cli import assert_one_line_error, run
from tiny_models import write_tiny

from edgespec import Model, hub
from edgespec.errors import EdgespecError
from edgespec.hub import HubFile, HubName

REPO = "owner/Tiny-GGUF"
WHOLE = "Tiny-Q4_K_M.gguf"
SPLIT = ["Tiny-Q8_0-00001-of-00002.gguf", "Tiny-Q8_0-00002-of-00002.gguf"]
CUT = (3 << 20) + 12345  # bytes sent before a connection breaks or stalls


def resumed_from(fake: FakeHub) -> list[int | None]:
    """Where each GET of the whole file started (None: from its start)."""
    gets = [s.range for s in fake.served if s.method == "GET" and s.path.endswith(WHOLE)]
    return [int(r.removeprefix("bytes=").removesuffix("-")) if r else None for r in gets]


@pytest.fixture(scope="module")
def ggufs(smollm2_path, tmp_path_factory) -> dict[str, bytes]:
    """The repo's files: a tiny LFM2 (SmolLM2's tokenizer), whole and split in two parts."""
    folder = tmp_path_factory.mktemp("hub-files")
    write_tiny(folder / WHOLE, "lfm2", smollm2_path)
    write_tiny(folder / "Tiny-Q8_0.gguf", "lfm2", smollm2_path, seed=1, split_tensors=20)
    return {name: (folder / name).read_bytes() for name in [WHOLE, *SPLIT]}


@pytest.fixture
def fake(ggufs, tmp_path, monkeypatch):
    """A hub on loopback, huggingface-hub and edgespec pointed at it, an empty model cache."""
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with FakeHub() as served:
        served.repos[REPO] = {"README.md": b"# Tiny", **ggufs, "mmproj-Tiny-F16.gguf": b"a projector, not a model"}
        served.repos["owner/Docs"] = {"README.md": b"no GGUF here"}
        served.gated.add("owner/Gated-GGUF")
        monkeypatch.setenv("HF_ENDPOINT", served.url)
        yield served


def cached(name: str):
    return hub.cache_dir() / "models" / f"{REPO}/{name}".replace("/", "--")


def files(*names: str) -> list[HubFile]:
    return [HubFile(name, 1, "0" * 64) for name in names]


def chosen(name: str, listing: list[HubFile]) -> list[str]:
    return [entry.hf["file"] for entry in hub.choose(HubName.parse(name), listing)]


def test_the_file_is_chosen_as_llama_server_chooses_it():
    listing = files("README.md", "mmproj-m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-IQ2_XS.gguf")
    assert chosen("hf:o/r", listing) == ["m-Q4_K_M.gguf"]  # not the projector named like it
    assert chosen("hf:o/r", files("m-Q2_K.gguf", "m-Q8_0.gguf")) == ["m-Q8_0.gguf"]  # then Q8_0
    assert chosen("hf:o/r", files("m-Q2_K.gguf", "m-Q3_K.gguf")) == ["m-Q2_K.gguf"]  # then the first
    assert chosen("hf:o/r:iq2_xs", listing) == ["m-IQ2_XS.gguf"]  # a quant named, in any case
    assert chosen("hf:o/r/m-Q8_0.gguf", listing) == ["m-Q8_0.gguf"]
    split = files("big/m-Q8_0-00002-of-00003.gguf", "big/m-Q8_0-00001-of-00003.gguf", "big/m-Q8_0-00003-of-00003.gguf")
    assert chosen("hf:o/r:Q8_0", split) == [f"big/m-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    with pytest.raises(EdgespecError, match="has no Q5_K_S file; it has IQ2_XS, Q4_K_M, Q8_0$"):
        hub.choose(HubName.parse("hf:o/r:Q5_K_S"), listing)
    with pytest.raises(EdgespecError, match="lacks big/m-Q8_0-00003-of-00003.gguf"):
        hub.choose(HubName.parse("hf:o/r:Q8_0"), split[:2])
    with pytest.raises(EdgespecError, match="no GGUF model file"):
        hub.choose(HubName.parse("hf:o/r"), files("README.md", "mmproj-F16.gguf"))
    with pytest.raises(EdgespecError, match="cannot be verified"):
        hub.choose(HubName.parse("hf:o/r"), [HubFile("m-Q4_K_M.gguf", 1, None)])
    for bad in ("hf:", "hf:owner", "hf:owner/repo/notes.txt", "hf:o/r/m.gguf:Q8_0", "hf:../r", "hf:o/r/../../m.gguf"):
        with pytest.raises(EdgespecError, match="is not a hub model name"):
            HubName.parse(bad)


def test_a_model_runs_by_its_hub_name_and_a_second_run_needs_no_network(fake, capsys):
    code, out, err = run(capsys, "generate", "Hello", "--target", f"hf:{REPO}", "--ctx", "256", "--max-tokens", "4")
    assert code == 0, err
    assert hashlib.sha256(cached(WHOLE).read_bytes()).hexdigest() == hashlib.sha256(fake.repos[REPO][WHOLE]).hexdigest()
    assert not [p for p in cached(WHOLE).parent.iterdir() if p.name.startswith(".fetch-")]  # no work left over
    requests = len(fake.served)
    code, out, err = run(capsys, "generate", "Hello", "--target", f"hf:{REPO}", "--ctx", "256", "--max-tokens", "4")
    assert code == 0 and len(fake.served) == requests, err  # cached and verified: the hub is not asked
    assert run(capsys, "models")[1].count(f"hf:{REPO}/{WHOLE}") == 1
    os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"  # the network down: the cached model still runs
    assert run(capsys, "generate", "Hi", "--target", f"hf:{REPO}:q4_k_m", "--ctx", "256", "--max-tokens", "2")[0] == 0
    assert_one_line_error(*run(capsys, "generate", "Hi", "--target", f"hf:{REPO}:Q8_0")[::2], "127.0.0.1 unreachable")
    code, _, err = run(capsys, "generate", "Hi", "--target", f"hf:{REPO}:Q8_0", "--offline")
    assert_one_line_error(code, err, f"hf:{REPO}:Q8_0 is not downloaded", "edgespec pull")


def test_a_split_model_is_fetched_whole_and_loads_from_its_first_part(fake):
    path = hub.resolve(f"hf:{REPO}:Q8_0", progress=False)
    assert path == cached(SPLIT[0]) and cached(SPLIT[1]).read_bytes() == fake.repos[REPO][SPLIT[1]]
    model = Model(path, n_ctx=128)  # llama.cpp reads the second part beside it
    try:
        assert model.eval(model.tokenize("Hello")).shape == (model.n_vocab,)
    finally:
        model.close()


def test_bytes_that_do_not_match_the_hubs_sha256_are_never_kept(fake, capsys):
    fake.wrong_sha.add((REPO, WHOLE))
    code, _, err = run(capsys, "pull", f"hf:{REPO}")
    # (the progress bar before it)
    assert_one_line_error(code, err.splitlines()[-1], f"could not fetch 'hf:{REPO}/{WHOLE}'", "has sha256", "discarded")
    assert not [p for p in (hub.cache_dir() / "models").iterdir() if p.suffix == ".gguf" or p.name.startswith(".")]


def test_a_dropped_connection_resumes_where_it_broke(fake):
    fake.drop_after[REPO, WHOLE] = CUT
    assert hub.resolve(f"hf:{REPO}", progress=False).read_bytes() == fake.repos[REPO][WHOLE]
    starts = resumed_from(fake)
    assert len(starts) == 2 and starts[0] is None and 0 < starts[1] <= CUT, starts


def test_a_killed_pull_resumes(fake, tmp_path):
    """`edgespec pull` killed mid-file (SIGKILL): the next pull asks only for the rest."""
    fake.stall_after[REPO, WHOLE] = CUT
    env = os.environ | {"EDGESPEC_HOME": str(tmp_path / "home"), "HF_ENDPOINT": fake.url}
    pulling = subprocess.Popen(
        [sys.executable, "-m", "edgespec", "pull", f"hf:{REPO}"], env=env, stderr=subprocess.PIPE
    )
    partial = cached(WHOLE).with_name(f".fetch-{cached(WHOLE).name}") / cached(WHOLE).name
    try:
        assert fake.stalled.wait(60), pulling.stderr.read() if pulling.poll() is not None else "no GET stalled"
        deadline = time.monotonic() + 30
        while (not partial.exists() or partial.stat().st_size < CUT // 2) and time.monotonic() < deadline:
            time.sleep(0.05)  # what was sent reaches the file
    finally:
        pulling.send_signal(signal.SIGKILL)
        pulling.wait()
    del fake.stall_after[REPO, WHOLE]
    fake.release.set()
    assert not cached(WHOLE).exists()
    assert hub.pull_name(f"hf:{REPO}", progress=False).read_bytes() == fake.repos[REPO][WHOLE]
    starts = resumed_from(fake)
    assert len(starts) == 2 and starts[0] is None and 0 < starts[1] <= CUT, starts


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("hf:owner/Missing", ["no repo owner/Missing on the hub"]),
        ("hf:owner/Docs", ["hf:owner/Docs has no GGUF model file"]),
        ("hf:owner/Gated-GGUF", ["hf:owner/Gated-GGUF is gated", "HF_TOKEN"]),
        (f"hf:{REPO}:Q5_K_S", [f"hf:{REPO} has no Q5_K_S file; it has Q4_K_M, Q8_0"]),
        (f"hf:{REPO}/Other.gguf", [f"hf:{REPO} has no file Other.gguf"]),
        ("hf:owner", ["is not a hub model name"]),
    ],
)
def test_a_bad_hub_name_is_one_line(fake, capsys, name, words):
    assert_one_line_error(*run(capsys, "generate", "Hi", "--target", name)[::2], *words)
    assert not (hub.cache_dir() / "models").exists() or not any((hub.cache_dir() / "models").glob("*.gguf"))


def test_the_readmes_hub_command_runs_as_written(fake, capsys, ggufs):
    """The models page's hub command, its repo served by the loopback hub (the tiny model as its Q4_K_M)."""
    (shell,) = code_blocks(section(page("models.md"), "Models and pairs"), "sh")
    argv = shlex.split(shell.strip())
    assert argv[:2] == ["edgespec", "generate"]
    repo = HubName.parse(argv[argv.index("--target") + 1]).repo
    fake.repos[repo] = {"model-q8_0.gguf": b"a Q8_0 never fetched", "model-q4_k_m.gguf": ggufs[WHOLE]}
    code, out, err = run(capsys, *argv[1:], "--max-tokens", "8")
    assert code == 0 and out.strip(), err
    assert [s.path for s in fake.served if s.method == "GET" and "/resolve/" in s.path] == [
        f"/{repo}/resolve/main/model-q4_k_m.gguf"
    ]


@pytest.mark.parametrize("raised", [OSError("connection reset"), AttributeError("a bug of ours")])
def test_a_listing_that_fails_on_the_network_says_so_and_a_bug_surfaces(fake, monkeypatch, raised):
    """The hub library's and its HTTP client's failures are the network's: one line naming the
    repo; anything else (our own AttributeError) is raised as it is, not taken for the network."""
    from huggingface_hub import HfApi

    def failing(*args, **kwargs):
        raise raised

    monkeypatch.setattr(HfApi, "list_repo_tree", failing)
    if isinstance(raised, OSError):
        with pytest.raises(EdgespecError, match=f"could not list {REPO} .*connection reset.*check your network"):
            hub.list_repo(REPO)
    else:
        with pytest.raises(AttributeError, match="a bug of ours"):
            hub.list_repo(REPO)
