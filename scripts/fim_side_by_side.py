"""The FIM bench's typing sessions (edgespec/bench/editors.py) against `edgespec serve` and
llama-server's /infill, side by side on this machine. Every keystroke sends llama.vscode's
request (Keystroke.body: three answers, its samplers, n_indent, t_max_predict_ms; seeded, and
streamed to time the first token), the typist's gaps are slept through (each server's idle time),
and each session begins with its first request read untimed (n_predict 0, an editor's warm-up).
Per server: the p50 and p90 of the time to the first token, to the first answer's first line and to
all three answers, of all answers after Enter, how often that first line is the rest of the real
line, and the prompt tokens a keystroke read.

    python scripts/fim_side_by_side.py --llama-server PATH/TO/llama-server [--sessions 2] [--lines 2] [--greedy]

Servers: edgespec (auto, the default pair) and edgespec with speculation off; llama-server plain
and with --cache-reuse 256 (what llama.vscode's README recommends), with its default slots (4, one
unified cache: n_cmpl's answers side by side). One server runs at a time (edgespec works while
idle: a server beside the one measured would take its CPU), started for each session, the order
alternating from session to session. The prompt states that edgespec keeps on disk between runs
are removed before each start (a session read by an earlier run would be answered from them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from edgespec.bench.editors import ENTER_PAUSE_S, KEY_S, Keystroke, Session, percentiles, sessions
from edgespec.cache import cache_dir
from edgespec.loader import resolve_model
from edgespec.registry import load_registry


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each server's command line, its port still to be added."""
    registry = load_registry()
    target = resolve_model(registry.pair(registry.default_pair).target)
    edgespec = [sys.executable, "-m", "edgespec", "serve", "--ctx", str(args.ctx), "--threads", str(args.threads)]
    llama = [args.llama_server, "-m", str(target), "-c", str(args.ctx), "-t", str(args.threads)]
    return {
        "edgespec": edgespec,
        "edgespec off": [*edgespec, "--draft-mode", "off"],
        "llama-server": llama,
        "llama-server --cache-reuse 256": [*llama, "--cache-reuse", "256"],
    }


def start(command: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    shutil.rmtree(cache_dir() / "prompts", ignore_errors=True)
    port = free_port()
    process = subprocess.Popen([*command, "--port", str(port)], stdout=log.open("a"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"{command[0]} exited; see {log}")
        time.sleep(0.5)
    raise SystemExit(f"{command[0]} did not start; see {log}")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait(timeout=60)
    shutil.rmtree(cache_dir() / "prompts", ignore_errors=True)


GREEDY = {"samplers": ["temperature"], "temperature": 0}  # --greedy: the layouts' own answers, no draw


def keystroke(url: str, key: Keystroke, sampling: dict) -> dict:
    """One keystroke's request (`sampling` in place of llama.vscode's), streamed: seconds to the first
    token, to the first answer's first line and to the end; whether that line is the rest of the real
    line; the prompt tokens read."""
    texts: dict[int, str] = {}
    first = line = None
    read = 0
    start = time.perf_counter()
    with httpx.stream("POST", url + "/infill", json=key.body() | sampling, timeout=600) as response:
        response.raise_for_status()
        for raw in response.iter_lines():
            if not raw.startswith("data: "):
                continue
            event = json.loads(raw[6:])
            index, content = event.get("index", 0), event.get("content") or ""
            texts[index] = texts.get(index, "") + content
            if index == 0:
                now = time.perf_counter() - start
                first = first or (now if content else None)
                if line is None and ("\n" in texts[0] or event.get("stop")):
                    line = now
                read = event.get("timings", {}).get("prompt_n", read)
    whole = time.perf_counter() - start
    answer = texts.get(0, "")
    return {
        "first_s": first or whole,
        "line_s": line or whole,
        "whole_s": whole,
        "right": key.right(answer),
        "after_enter": key.after_enter,
        "read": read,
        "answer": answer,
    }


def type_session(url: str, session: Session, name: str, sampling: dict) -> list[dict]:
    warm_up = session.keystrokes[0].body() | {"n_predict": 0, "stream": False}
    httpx.post(url + "/infill", json=warm_up, timeout=1200).raise_for_status()
    runs, keys = [], session.keystrokes
    for key, following in zip(keys, [*keys[1:], None], strict=True):
        done = keystroke(url, key, sampling) | {"session": session.name, "cursor_line": key.infill.cursor_line}
        runs.append(done)
        typed = key.infill.cursor_line.strip()[-20:]
        print(
            f"{session.name:<18} {name:<32} {typed!r:>24} first {done['first_s'] * 1000:6.0f} line"
            f" {done['line_s'] * 1000:6.0f} all {done['whole_s'] * 1000:6.0f} ms read {done['read']}"
            f" right {done['right']}",
            file=sys.stderr,
            flush=True,
        )
        pause = ENTER_PAUSE_S if following is not None and following.after_enter else KEY_S - done["whole_s"]
        time.sleep(max(0.0, pause))
    return runs


def summary(runs: list[dict]) -> dict:
    row = {}
    for name in ("first", "line", "whole"):
        row |= percentiles(name, (r[f"{name}_s"] for r in runs))
    row |= percentiles("enter_whole", [r["whole_s"] for r in runs if r["after_enter"]] or [0.0])
    return row | {
        "right": sum(r["right"] for r in runs) / len(runs),
        "read": sum(r["read"] for r in runs) / len(runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--lines", type=int, default=2, help="lines typed per session")
    parser.add_argument("--keystrokes", type=int, help="only the first N keystrokes of each session")
    parser.add_argument("--greedy", action="store_true", help="greedy answers in place of llama.vscode's samplers")
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--only", help="comma-separated server names (default: all)")
    parser.add_argument("--out", type=Path, default=Path("fim-side-by-side"), help="folder for logs and results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = {k: v for k, v in servers(args).items() if not args.only or k in args.only.split(",")}
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    for i, session in enumerate(sessions(args.sessions, lines=args.lines)):
        session = Session(session.name, session.keystrokes[: args.keystrokes])
        for name in list(chosen) if i % 2 == 0 else list(chosen)[::-1]:
            process, url = start(chosen[name], args.out / f"{name.replace(' ', '_')}.log")
            try:
                runs[name] += type_session(url, session, name, GREEDY if args.greedy else {})
            finally:
                stop(process)
    machine = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((line.split(":", 1)[1].strip() for line in machine.splitlines() if "Model name" in line), "?")
    report = {"machine": model_name, "sessions": args.sessions, "threads": args.threads, "ctx": args.ctx}
    report["sampling"] = "greedy" if args.greedy else "llama.vscode's"
    report["servers"] = {name: summary(r) for name, r in runs.items() if r}
    (args.out / "results.json").write_text(json.dumps(report | {"runs": runs}, indent=2))
    keys = len(next(iter(runs.values())))
    print(
        f"{keys} keystrokes in {args.sessions} typing sessions, {report['sampling']} sampling, {model_name},"
        f" {args.threads} threads"
    )
    print("ms from the request to the first token, the first answer's first line, and all answers")
    print("| server | first p50 | p90 | first line p50 | p90 | all p50 | p90 | all after Enter p90 | right | read |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, s in report["servers"].items():
        times = ("first_p50", "first_p90", "line_p50", "line_p90", "whole_p50", "whole_p90", "enter_whole_p90")
        cells = [f"{s[t + '_ms']:.0f}" for t in times] + [f"{s['right']:.0%}", f"{s['read']:.1f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
