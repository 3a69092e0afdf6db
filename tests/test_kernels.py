"""Kernels that work on this CPU: a crash of llama.cpp's repacked (AMX) kernels in the
probe child means loading without repacking, never a segfault of ours.

This machine's kernels may not crash at all, so the fallback is tested with probe
children made to crash (or hang) on purpose; the real thing is tested by running a
batched verify of the real models in a fresh process, which is what died on AMX CPUs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from edgespec import Model, kernels, store
from edgespec.cli import main
from edgespec.errors import EdgespecError
from edgespec.resolve import resolve_model

CRASH = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
HANG = [sys.executable, "-c", "import time; time.sleep(60)"]
TIMED = {"prompt", "verify", "step"}  # the passes a probe times
WORKS = [sys.executable, "-c", 'print(\'{"prompt": 0.4, "verify": 0.15, "step": 0.03}\')']  # a probe that ran

# what crashed on Intel CPUs with AMX: any decode of 2+ tokens, here the prompt and a verify pass
BATCHED = """
import sys, edgespec
model = edgespec.Model(sys.argv[1], n_ctx=256)
model.eval(list(range(100, 124)))
logits = model.eval([model.tokens[-1]] * 16, rows=16)
assert logits.shape == (16, model.n_vocab)
with edgespec.load(target=sys.argv[1], draft=sys.argv[1], n_ctx=256) as engine:
    result = engine.generate("Count to five.", temperature=0, max_tokens=12, draft_mode="model", gamma=4)
    assert result.tokens and result.stats.drafted > 0
print("repack", model.repack)
"""


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-1.5b"])
@pytest.mark.slow
def test_batched_verify_in_a_fresh_process(name):
    path = resolve_model(name)
    done = subprocess.run([sys.executable, "-c", BATCHED, str(path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "repack" in done.stdout


@pytest.fixture
def fresh_store(tmp_path, monkeypatch):
    """An empty store, so the probe runs; the model files stay where they are."""
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    return tmp_path


def fake_probes(monkeypatch, *, on=None, off=None):
    """Probe children that run a given command instead of the real probe (None: the real one);
    returns the list of settings probed."""
    probed = []
    real = kernels.probe_command

    def argv(path, repack, n_threads, n_gpu_layers):
        probed.append(repack)
        return (on if repack else off) or real(path, repack, n_threads, n_gpu_layers)

    monkeypatch.setattr(kernels, "probe_command", argv)
    return probed


def test_crashing_repacked_kernels_load_without_repacking(fresh_store, monkeypatch, smollm2_path, capfd):
    probed = fake_probes(monkeypatch, on=CRASH)
    model = Model(smollm2_path, n_ctx=128)
    assert model.repack is False and probed == [True, False]
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("edgespec:")]
    assert len(lines) == 1 and "crashed (SIGSEGV)" in lines[0] and "weights not repacked" in lines[0], err
    assert model.eval(list(range(100, 120)), rows=20).shape == (20, model.n_vocab)
    model.close()

    again = Model(smollm2_path, n_ctx=128)  # remembered: no second probe, no second notice
    assert again.repack is False and probed == [True, False]
    assert "edgespec:" not in capfd.readouterr().err
    again.close()
    verdict = next(v for k, v in store.read().items() if k.endswith("|repack"))
    assert verdict["crashed"] == "crashed (SIGSEGV)"


def test_a_hanging_probe_counts_as_a_crash(fresh_store, monkeypatch, smollm2_path):
    monkeypatch.setattr(kernels, "PROBE_TIMEOUT_S", 2.0)
    fake_probes(monkeypatch, on=WORKS, off=HANG)
    model = Model(smollm2_path, n_ctx=128)
    assert model.repack is True
    model.close()
    verdict = next(v for k, v in store.read().items() if k.endswith("|repack"))
    assert verdict["crashed"].startswith("hung")


def test_kernels_that_crash_either_way_fail_in_one_line(fresh_store, monkeypatch, smollm2_path, capsys):
    fake_probes(monkeypatch, on=CRASH, off=CRASH)
    with pytest.raises(EdgespecError, match="crash running SmolLM2.*rebuild llama-cpp-python"):
        Model(smollm2_path)
    code = main(["generate", "hi", "--target", str(smollm2_path), "--max-tokens", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "SIGSEGV" in err[0], err
    assert not any(k.endswith("|repack") for k in store.read())  # a rebuild is probed afresh


def test_both_settings_are_probed_and_their_times_kept(fresh_store, monkeypatch, smollm2_path):
    probed = fake_probes(monkeypatch)
    model = Model(smollm2_path, n_ctx=128)
    assert probed == [True, False]
    verdict = next(v for k, v in store.read().items() if k.endswith("|repack"))
    assert verdict.get("crashed") or set(verdict["times"]["on"]) == set(verdict["times"]["off"]) == TIMED
    model.close()


def probe_printing(times: dict) -> list[str]:
    return [sys.executable, "-c", f"print('{json.dumps(times)}')"]


REPACKED = {"prompt": 0.4, "verify": 0.15, "step": 0.03}  # seconds: a 64-token prompt chunk, a verify pass, a step


@pytest.mark.parametrize(
    "as_is, repack",
    [  # a typical request is 16 prompt chunks and 256 steps: repacked, 6.4 + 7.68 = 14.08 s
        ({"prompt": 0.3, "verify": 0.15, "step": 0.03}, False),  # 12.48 s: 11% faster, past the 10% margin
        ({"prompt": 0.38, "verify": 0.15, "step": 0.0285}, True),  # 13.38 s: 5% faster, within it
        ({"prompt": 0.292, "verify": 0.15, "step": 0.0387}, True),  # prefill 27% faster, steps 29% slower (EPYC)
        ({"prompt": 0.28, "verify": 0.1, "step": 0.021}, False),  # all 30% faster (a Xeon with AMX)
    ],
)
def test_where_both_settings_work_the_faster_request_wins(fresh_store, monkeypatch, smollm2_path, as_is, repack):
    fake_probes(monkeypatch, on=probe_printing(REPACKED), off=probe_printing(as_is))
    model = Model(smollm2_path, n_ctx=128)
    assert model.repack is repack
    model.close()


def test_stats_say_which_kernels_ran(capsys, smollm2_path):
    code = main(["generate", "Say hi.", "--pair", "smollm2-self", "--max-tokens", "4", "--temperature", "0"])
    err = capsys.readouterr().err
    assert code == 0 and ("repack on" in err or "repack off" in err), err


MAPPED = """
import sys
from pathlib import Path
from edgespec import Model
path, repack = Path(sys.argv[1]), sys.argv[2] == "on"
with Model(path, n_ctx=256, repack=repack) as model:
    model.eval([1, 2, 3])
    resident, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split(" ", 1)[0]:  # a mapping's first line: its address range, ..., its file
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                resident += int(line.split()[1])
print(resident / 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
@pytest.mark.parametrize("repack", ["on", "off"])
def test_repacked_weights_are_not_also_kept_mapped(smollm2_path, repack):
    """Repacked weights are copies: the file is read, not mapped, so it is not resident twice
    over (the 1.5B pair's server held 0.8 GB more with it mapped); unrepacked, it stays mapped
    (its pages are the weights). In a process of its own: this one maps the file for others."""
    done = subprocess.run([sys.executable, "-c", MAPPED, str(smollm2_path), repack], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    mapped_mib = float(done.stdout.split()[-1])
    assert mapped_mib < 1 if repack == "on" else mapped_mib > 10, mapped_mib
