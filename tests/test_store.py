"""The files the program keeps are written as a database would write them: whole or not at all
(killed at random points mid-write, the next start finds them clean), read entry by entry (a
damaged entry set aside, the others kept), and shared by processes that write at once."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

from edgespec import store
from edgespec.prompt_cache import _read

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a child that writes calibration entries and a prompt-cache file (two versions in turn) until
# killed, saying after each write that it returned
WRITER = """
import ctypes, sys
from pathlib import Path
from edgespec import store
from edgespec.prompt_cache import SavedState, _write
state = Path(sys.argv[1])
print("ready", flush=True)
for i in range(10**6):
    store.write(f"k{i % 8}", {"i": i, "pad": "x" * 50_000})
    data = (ctypes.c_uint8 * 400_000).from_buffer_copy(bytes([i % 2]) * 400_000)
    _write(state, SavedState(0, [i % 2] * 100, len(data), state.parent, data=data))
    print(i, flush=True)
"""


def test_a_damaged_entry_is_set_aside_and_the_others_kept(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    store.write("a", {"on": True})
    store.write("b", [1, 2])
    with open(store.path(), "a") as f:
        f.write('{"key": "c", "value": {"on": tr\n')  # a line a lost write cut short
        f.write("not json at all\n")
    assert store.read() == {"a": {"on": True}, "b": [1, 2]}
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "2 damaged entries" in said and "the other 2 kept" in said
    assert (tmp_path / store.DAMAGED).read_text().splitlines() == ['{"key": "c", "value": {"on": tr', "not json at all"]
    assert store.read() == {"a": {"on": True}, "b": [1, 2]} and capsys.readouterr().err == ""  # set aside once
    store.write("c", 3)
    assert store.read() == {"a": {"on": True}, "b": [1, 2], "c": 3}


def test_the_old_single_object_file_is_read_until_the_first_write(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    (tmp_path / "calibration.json").write_text('{"old": 1}')
    assert store.read() == {"old": 1}
    store.write("new", 2)
    assert store.read() == {"old": 1, "new": 2}


def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    code = "import sys\nfrom edgespec import store\nfor i in range(40): store.write(f'{sys.argv[1]}{i}', i)"
    env = os.environ | {"EDGESPEC_HOME": str(tmp_path)}
    children = [subprocess.Popen([sys.executable, "-c", code, name], env=env) for name in ("x", "y")]
    assert [c.wait(timeout=300) for c in children] == [0, 0]
    os.environ["EDGESPEC_HOME"], before = str(tmp_path), os.environ.get("EDGESPEC_HOME")
    try:
        assert store.read() == {f"{name}{i}": i for name in ("x", "y") for i in range(40)}
    finally:
        os.environ.pop("EDGESPEC_HOME") if before is None else os.environ.__setitem__("EDGESPEC_HOME", before)


def test_killed_at_random_points_mid_write_the_next_start_is_clean(tmp_path, monkeypatch, capsys):
    """SIGKILL at 20 random points of a child writing calibration entries and a prompt-cache file:
    after each, every entry that was there before is there, none is damaged, and the prompt-cache
    file is one of the two versions whole (it verifies)."""
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    seeded = {f"seed{i}": {"n": i} for i in range(20)}
    for key, value in seeded.items():
        store.write(key, value)
    state, rng = tmp_path / "prompt.state", random.Random(5)
    env = os.environ | {"PYTHONPATH": ROOT}
    completed = 0
    for _ in range(20):
        child = subprocess.Popen([sys.executable, "-c", WRITER, str(state)], env=env, stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0.0, 0.4))
        child.send_signal(signal.SIGKILL)
        said = child.stdout.read().split()
        child.wait()
        completed += len(said)
        entries = store.read()
        assert capsys.readouterr().err == ""  # nothing damaged to set aside
        assert {k: entries[k] for k in seeded} == seeded
        assert all(len(entries[k]["pad"]) == 50_000 for k in entries if k.startswith("k"))
        if state.exists():
            kept = _read(state, n_vocab=10)
            assert kept is not None and kept.tokens in ([0] * 100, [1] * 100)
            assert bytes(kept.data) == bytes([kept.tokens[0]]) * 400_000
    assert completed > 0  # some writes were whole before a kill


def test_a_temporary_left_by_a_kill_is_not_read(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    store.write("a", 1)
    (tmp_path / f".{store.path().name}.999.tmp").write_text('{"key": "half')
    assert store.read() == {"a": 1}
