"""Hostile chat templates, as real GGUF files (SmolLM2 re-written with the gguf package):
each ends in the one-line error, quickly, with the program's memory untouched, and the
program keeps working: on the command line, in the library, in the server, in the chat app."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import gguf
import httpx
import pytest
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata, get_field_data
from test_cli import assert_one_line_error, run
from tiny_models import write_tiny

import edgespec
from edgespec import kernels, store
from edgespec.prompts import MAX_CHARS_PER_TOKEN

pytestmark = pytest.mark.slow  # models written with the gguf package

HOSTILE = {
    "huge-string": "{{ 'a' * 10**10 }}",
    "huge-list": "{% set x = [0] * 10**9 %}{{ x | length }}",
    "nested-loops": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "huge-range": "{% for i in range(10**9) %}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "huge-power": "{{ 10 ** (10 ** 8) }}",  # (Jinja reads 10 ** 10 ** 8 as (10 ** 10) ** 8: harmless)
    "content-bomb": "{% for m in messages %}{{ m.content * 100000000 }}{% endfor %}",
    "class-escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals-escape": "{{ cycler.__init__.__globals__.os.system('echo pwned') }}",
    "filter-bomb": "{{ 'x' | center(10**9) }}",
    "lorem-bomb": "{{ lipsum(n=10**7) }}",
    "join-bomb": "{{ (range(99999) | join(' ')) * 100000 }}",
}

TOO_LONG = {"content-bomb"}  # this one fits in the renderer's memory: its prompt is too long


def with_chat_template(source, destination, template: str):
    """A copy of a GGUF with another tokenizer.chat_template (as gguf-new-metadata does)."""
    reader = gguf.GGUFReader(source, "r")
    writer = gguf.GGUFWriter(destination, arch=get_field_data(reader, gguf.Keys.General.ARCHITECTURE))
    new = {gguf.Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(gguf.GGUFValueType.STRING, template)}
    copy_with_new_metadata(reader, writer, new, [])
    return destination


@pytest.fixture(scope="module")
def hostile_models(smollm2_path, tmp_path_factory):
    """A tiny model with SmolLM2's tokenizer (tiny_models.py) under each hostile template: the
    template is the point, and twelve copies of a real model took a minute and a half to write."""
    folder = tmp_path_factory.mktemp("hostile")
    base = write_tiny(folder / "base.gguf", "llama", smollm2_path)
    models = {
        name: write_tiny(folder / f"{name}.gguf", "llama", smollm2_path, chat_template=t) for name, t in HOSTILE.items()
    }
    # which kernels work is found here (and said, on a CPU where some crash), not in the tests: once,
    # for the weights every copy shares
    threads = os.cpu_count() or 1
    kernels.choose_repack(base, threads, 0)
    verdict = store.read()[kernels.verdict_key(base, threads, 0)]
    for path in models.values():
        store.write(kernels.verdict_key(path, threads, 0), verdict)
    return models


@dataclass
class Child:
    """How `edgespec` ran in a process of its own."""

    code: int
    out: str
    err: str
    seconds: float
    peak_mib: float  # its own peak memory (wait4 reports that process's alone, not this one's or others')


def run_child(tmp_path, *args: str) -> Child:
    with open(tmp_path / "out", "w+") as out, open(tmp_path / "err", "w+") as err:
        start = time.monotonic()
        child = subprocess.Popen([sys.executable, "-m", "edgespec", *args], stdout=out, stderr=err, text=True)
        watchdog = threading.Timer(120, child.kill)
        watchdog.start()
        _, status, usage = os.wait4(child.pid, 0)
        watchdog.cancel()
        child.returncode = os.waitstatus_to_exitcode(status)  # (reaped here: Popen must not wait for it)
        out.seek(0), err.seek(0)
        return Child(child.returncode, out.read(), err.read(), time.monotonic() - start, usage.ru_maxrss / 1024)


@pytest.fixture(scope="module")
def benign_peak_mib(smollm2_path, tmp_path_factory) -> float:
    """What the same command takes where the template is the model's own and an answer is made."""
    args = ("generate", "hi", "--target", str(smollm2_path), "--ctx", "512", "--max-tokens", "1")
    done = run_child(tmp_path_factory.mktemp("benign"), *args)
    assert done.code == 0, done.err
    return done.peak_mib


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_template_is_one_line_quickly(tmp_path, hostile_models, benign_peak_mib, name):
    done = run_child(tmp_path, "generate", "hi", "--target", str(hostile_models[name]), "--ctx", "512")
    if name in TOO_LONG:  # rendered, then refused before tokenizing
        assert_one_line_error(done.code, done.err, "context holds 512 tokens", "--ctx")
    else:
        assert_one_line_error(done.code, done.err, "chat template", "--raw")
    assert "pwned" not in done.out + done.err
    assert done.seconds < 15, (
        f"{name} took {done.seconds:.1f} s"
    )  # the renderer is killed after 2 s; the rest: start, load
    # the template's memory was never the program's (it renders in a sandbox process of its own)
    assert done.peak_mib < benign_peak_mib + 200, (done.peak_mib, benign_peak_mib)


def test_a_hostile_template_fails_before_the_model_is_probed_or_timed(capsys, smollm2_path, tmp_path):
    """What fails cheaply fails first: no kernel probe, no calibration for a file whose template is bad."""
    path = with_chat_template(smollm2_path, tmp_path / "never-probed.gguf", HOSTILE["huge-range"])
    capsys.readouterr()  # (the gguf writer's progress)
    code, out, err = run(capsys, "generate", "hi", "--target", str(path), "--ctx", "512")
    assert_one_line_error(code, err, "chat template", "--raw")
    assert not [key for key in store.read() if path.name in key]


def test_the_program_keeps_working_after_hostile_templates(hostile_models, smollm2_path):
    with edgespec.load(target=str(hostile_models["nested-loops"]), n_ctx=512, progress=False) as bad:
        with pytest.raises(edgespec.EdgespecError, match="more than 2 s"):
            bad.generate("hi", max_tokens=4)
        assert bad.generate("plain text still works", raw=True, max_tokens=4, temperature=0).tokens
    with edgespec.load(target=str(smollm2_path), n_ctx=512, progress=False) as good:
        assert good.generate("Say hi.", max_tokens=4, temperature=0).tokens


def test_an_absurdly_long_prompt_is_refused_before_tokenizing(smollm2_path):
    with edgespec.load(target=str(smollm2_path), n_ctx=512, progress=False) as engine:
        huge = "word " * (MAX_CHARS_PER_TOKEN * 512)
        for kwargs in ({"raw": True}, {}):
            start = time.monotonic()
            with pytest.raises(edgespec.EdgespecError, match="context holds 512 tokens"):
                engine.generate(huge, **kwargs)
            assert time.monotonic() - start < 10


def test_the_server_answers_400_and_keeps_serving(hostile_models):
    from test_server import Server

    server = Server("--target", str(hostile_models["nested-loops"]), "--ctx", "512")
    try:
        start = time.monotonic()
        response = server.post("/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 400 and "chat template" in response.json()["error"]["message"]
        assert time.monotonic() - start < 10
        assert httpx.get(server.url.removesuffix("/v1") + "/health").json() == {"status": "ok"}
        completion = server.post("/completions", json={"prompt": "Once upon a time", "max_tokens": 4})
        assert completion.status_code == 200
    finally:
        assert server.stop() == 0


def test_the_chat_app_notifies_and_stays_up(hostile_models):
    from test_tui import notifications, record_notifications, wait_for

    from tui.app import ChatApp

    async def main():
        app = ChatApp(target=str(hostile_models["huge-string"]), n_ctx=512, max_tokens=8)
        async with app.run_test(size=(100, 30), message_hook=record_notifications(app)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None)
            app.query_one("#prompt").value = "hi"
            await pilot.press("enter")
            await wait_for(pilot, lambda: any("chat template" in n.message for n in notifications(app)))
            await wait_for(pilot, lambda: not app.generating)
            assert app.is_running

    asyncio.run(main())
