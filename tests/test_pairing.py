"""--draft auto (issue 48): the draft model found for a target among the models downloaded, else
its family's fetched from a hub on loopback, each judged on its tokenizer and size; and
`edgespec models --drafts-for`, which says why each was taken or left."""

from __future__ import annotations

import os
import shlex

import pytest
from fake_hub import FakeHub
from pages import page
from test_cli import run
from test_hub import REPO, WHOLE, ggufs  # noqa: F401  (a fixture)

from edgespec import hub
from edgespec.pairing import MAX_SHARE, find_draft
from edgespec.resolve import resolve_model

TINY = f"hf:{REPO}/{WHOLE}"  # a tiny LFM2 with SmolLM2's tokenizer: 0.15 of SmolLM2's size


@pytest.fixture(scope="module")
def registry_files(smollm2_path):
    """The registry's files this machine has (the cache outside the tests' homes)."""
    names = ("smollm2-135m", "gemma-3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
    return {name: resolve_model(name) for name in names}


@pytest.fixture
def home(tmp_path, monkeypatch, registry_files, ggufs):  # noqa: F811
    """An empty model cache and user registry, a loopback hub serving the tiny model; `have`
    puts registry models in the cache (links to this machine's files)."""
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    models = tmp_path / "home" / "models"
    models.mkdir(parents=True)

    def have(*names: str) -> None:
        for name in names:
            (models / registry_files[name].name).symlink_to(registry_files[name])

    with FakeHub() as fake:
        fake.repos[REPO] = {WHOLE: ggufs[WHOLE]}
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        fake.have = have
        yield fake


def verdicts(choice) -> dict[str, str]:
    return {c.name: ("taken: " if c.taken else "left: ") + c.verdict for c in choice.candidates}


def test_the_smallest_downloaded_model_with_the_targets_tokenizer_is_taken(home, capsys):
    home.have("smollm2-135m", "gemma-3-270m")
    hub.resolve(TINY, progress=False)  # downloaded before
    damaged = hub.cache_dir() / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    damaged.write_bytes(b"not the model")  # a file in the cache that fails its check (its size, before its sha256)
    choice = find_draft("smollm2-135m")
    assert choice.draft == TINY
    found = verdicts(choice)
    assert found[TINY].startswith("taken: shares the tokenizer, 0.15 of the target's size"), found
    assert found["gemma-3-270m"].startswith(f"left: 2.57 of the target's size: too big to pay (at most {MAX_SHARE})")
    damaged_verdict = found["qwen2.5-coder-0.5b"]
    assert damaged_verdict.startswith("left: not usable: ") and "pull qwen2.5-coder-0.5b" in damaged_verdict, found
    code, out, err = run(capsys, "generate", "Hi", "--target", "smollm2-135m", "--draft", "auto", "--max-tokens", "4")
    assert code == 0 and f"draft model: {TINY} (shares the tokenizer" in err, err
    code, out, _ = run(capsys, "models", "--drafts-for", "smollm2-135m")
    assert code == 0 and f"taken {TINY}  14 MiB: shares the tokenizer" in out, out


def test_another_tokenizer_is_left_and_the_family_draft_is_taken_but_never_the_target_itself(home):
    """The Qwen2.5-Coder 0.5B target: SmolLM2 is small enough but speaks another tokenizer; its
    family's draft (models.toml) is the target itself."""
    home.have("qwen2.5-coder-0.5b", "smollm2-135m")
    choice = find_draft("qwen2.5-coder-0.5b", offline=True)
    found = verdicts(choice)
    assert choice.draft is None
    assert found["smollm2-135m"] == "left: another tokenizer: different special tokens (BOS/EOS)", found
    assert found["qwen2.5-coder-0.5b"] == "left: the qwen2.5-coder family's draft model, the target itself", found
    assert "none fits" in choice.summary()


def test_a_family_draft_is_fetched_from_the_hub_where_none_is_downloaded(home, capsys):
    """A family in the user's models.toml: its first draft's repo is missing, its second is fetched."""
    config = os.environ["XDG_CONFIG_HOME"] + "/edgespec"
    os.makedirs(config)
    with open(f"{config}/models.toml", "w") as f:
        f.write('[families.smol]\narchitecture = "llama"\nn_vocab = 49152\n')
        f.write(f'drafts = ["hf:owner/Missing-GGUF", "hf:{REPO}"]\n')
    home.have("smollm2-135m", "gemma-3-270m")
    offline = find_draft("smollm2-135m", offline=True)
    assert offline.draft is None and f"hf:{REPO} is not downloaded" in verdicts(offline)[f"hf:{REPO}"]
    choice = find_draft("smollm2-135m", progress=False)
    found = verdicts(choice)
    assert choice.draft == f"hf:{REPO}", found
    assert "not fetched: no repo owner/Missing-GGUF on the hub" in found["hf:owner/Missing-GGUF"]
    assert found[f"hf:{REPO}"].startswith("taken: the smol family's draft model, shares the tokenizer, 0.15")
    assert hub.cache_dir().joinpath("models", f"{REPO}/{WHOLE}".replace("/", "--")).is_file()


def test_the_readmes_drafts_for_example_is_what_it_prints(home, capsys):
    """The models page's `--drafts-for` example, on a cache of the registry's four models."""
    home.have("smollm2-135m", "gemma-3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
    models = page("models.md")
    start = models.index("$ edgespec models --drafts-for")
    example = models[start : models.index("```", start)]
    command, *printed = example.strip().splitlines()
    argv = shlex.split(command.removeprefix("$ "))
    code, out, err = run(capsys, *argv[1:])
    assert code == 0 and out.splitlines() == printed, err
