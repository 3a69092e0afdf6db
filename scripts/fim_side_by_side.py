"""The FIM bench's completions against `edgespec serve` and llama-server's /infill, side by side
on this machine: each case as llama.vscode sends it (FimCase.body: greedy, one answer,
streamed), after the request of the keystroke before it (n_predict 0, as the last request left
the server's cache); per server the p50 and p90 of the time to the first token and to the
last, and how often the answer's first line is the span cut out.

    python scripts/fim_side_by_side.py --llama-server PATH/TO/llama-server [--cases 12] [--ctx 4096]

Servers: edgespec with speculation off and auto (the default pair), llama-server alone, with
the pair's draft model (-md) and with n-gram drafting (--spec-type ngram-simple), each with
one slot. All run at once and take turns case by case, the order alternating, so that each
meets the machine in the same state; only the one answering computes. The prompt states that
edgespec keeps on disk between runs are removed before and after (a case's prompt read by an
earlier run would be answered from them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from edgespec.cache import cache_dir
from edgespec.fim_bench import FimCase, cases
from edgespec.loader import resolve_model
from edgespec.registry import load_registry


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each server's command line, its port still to be added."""
    registry = load_registry()
    pair = registry.pair(registry.default_pair)
    target, draft = resolve_model(pair.target), resolve_model(pair.draft)
    edgespec = [sys.executable, "-m", "edgespec", "serve", "--ctx", str(args.ctx), "--threads", str(args.threads)]
    llama = [args.llama_server, "-m", str(target), "-c", str(args.ctx), "-t", str(args.threads), "-np", "1"]
    return {
        "edgespec off": [*edgespec, "--draft-mode", "off"],
        "edgespec auto": edgespec,
        "llama-server": llama,
        "llama-server -md": [*llama, "-md", str(draft), "-td", str(args.threads)],
        "llama-server ngram": [*llama, "--spec-type", "ngram-simple"],
    }


def start(command: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([*command, "--port", str(port)], stdout=log.open("w"), stderr=subprocess.STDOUT)
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


def complete(url: str, case: FimCase) -> dict:
    """The keystroke before (untimed), then the case, streamed: seconds to the first text and
    to the end, and whether the first line is the span."""
    before = case.body() | {"prompt": case.keystroke_before.cursor_line, "n_predict": 0, "stream": False}
    httpx.post(url + "/infill", json=before, timeout=600).raise_for_status()
    text, first, start = [], None, time.perf_counter()
    with httpx.stream("POST", url + "/infill", json=case.body(), timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and (content := json.loads(line[6:]).get("content")):
                first = first or time.perf_counter() - start
                text.append(content)
    last = time.perf_counter() - start
    answer = "".join(text)
    return {"first_s": first or last, "last_s": last, "exact": case.exact(answer), "answer": answer}


def summary(runs: list[dict]) -> dict:
    first, last = (np.array([r[key] for r in runs]) * 1000 for key in ("first_s", "last_s"))
    return {
        "first_p50_ms": float(np.percentile(first, 50)),
        "first_p90_ms": float(np.percentile(first, 90)),
        "last_p50_ms": float(np.percentile(last, 50)),
        "last_p90_ms": float(np.percentile(last, 90)),
        "exact": sum(r["exact"] for r in runs) / len(runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    parser.add_argument("--cases", type=int, default=12)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--only", help="comma-separated server names (default: all)")
    parser.add_argument("--out", type=Path, default=Path("fim-side-by-side"), help="folder for logs and results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = {k: v for k, v in servers(args).items() if not args.only or k in args.only.split(",")}
    running = {}
    saved_prompts = cache_dir() / "prompts"
    shutil.rmtree(saved_prompts, ignore_errors=True)
    try:
        for name, command in chosen.items():
            running[name] = start(command, args.out / f"{name.replace(' ', '_')}.log")
        runs: dict[str, list[dict]] = {name: [] for name in running}
        for i, case in enumerate(cases(args.cases)):
            for name in list(running) if i % 2 == 0 else list(running)[::-1]:
                done = complete(running[name][1], case) | {"case": case.name}
                runs[name].append(done)
                print(
                    f"{case.name:<18} {name:<20} first {done['first_s'] * 1000:6.0f} ms  last"
                    f" {done['last_s'] * 1000:6.0f} ms  exact {done['exact']}",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for process, _ in running.values():
            process.terminate()
            process.wait(timeout=30)
        shutil.rmtree(saved_prompts, ignore_errors=True)
    machine = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((line.split(":", 1)[1].strip() for line in machine.splitlines() if "Model name" in line), "?")
    report = {"machine": model_name or platform.processor(), "cases": args.cases, "threads": args.threads}
    report["servers"] = {name: summary(r) for name, r in runs.items()}
    (args.out / "results.json").write_text(json.dumps(report | {"runs": runs}, indent=2))
    print(f"{args.cases} completions, {model_name}, {args.threads} threads; ms from the request")
    print("| server | first p50 | first p90 | last p50 | last p90 | exact |\n|---|---|---|---|---|---|")
    for name, s in report["servers"].items():
        print(
            f"| {name} | {s['first_p50_ms']:.0f} | {s['first_p90_ms']:.0f} | {s['last_p50_ms']:.0f}"
            f" | {s['last_p90_ms']:.0f} | {s['exact']:.0%} |"
        )


if __name__ == "__main__":
    main()
