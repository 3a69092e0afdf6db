"""The concurrent bench's requests (edgespec/bench/concurrency.py) against `edgespec serve` and
llama-server over HTTP, side by side on this machine: an /infill sent once a chat answer has
streamed INFILL_AFTER tokens (its latency against the same /infill on the idle server), and 2
and 4 chats sent together (the time until all are answered against the same chats one after
another, and the tokens per second of all of them). Greedy; chats streamed through the OpenAI
API; medians over the repeats.

    python scripts/concurrent_side_by_side.py --llama-server PATH/TO/llama-server [--repeats 2] [--max-tokens 128]
        [--only edgespec,"edgespec off",llama-server]

Servers: edgespec --parallel 4 (auto, the default pair), the same with speculation off, and
llama-server -np 4 on the target with the same context per request. One server runs at a time,
the order alternating from repeat to repeat.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from fim_side_by_side import start, stop

from edgespec.bench.concurrency import CHATS, INFILL, INFILL_AFTER, INFILL_TOKENS, medians, print_rows
from edgespec.loader import resolve_model
from edgespec.registry import load_registry

PARALLEL = 4


def servers(args: argparse.Namespace) -> dict[str, list[str]]:
    registry = load_registry()
    target = resolve_model(registry.pair(registry.default_pair).target)
    edgespec = [sys.executable, "-m", "edgespec", "serve", "--ctx", str(args.ctx), "--parallel", str(PARALLEL)]
    llama = [args.llama_server, "-m", str(target), "-c", str(args.ctx * PARALLEL), "-np", str(PARALLEL)]
    return {"edgespec": edgespec, "edgespec off": [*edgespec, "--draft-mode", "off"], "llama-server": llama}


class Answer:
    """One request's answer: when it was sent and ended, and its streamed tokens."""

    def __init__(self) -> None:
        self.sent = self.done = 0.0
        self.tokens = 0

    @property
    def latency(self) -> float:
        return self.done - self.sent


def chat(url: str, text: str, max_tokens: int, answer: Answer) -> None:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0}
    answer.sent = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body | {"stream": True}, timeout=600) as r:
        for line in r.iter_lines():
            choices = json.loads(line[6:])["choices"] if line.startswith("data: {") else []
            if choices and choices[0]["delta"].get("content"):
                answer.tokens += 1
    answer.done = time.perf_counter()


def infill(url: str, answer: Answer) -> None:
    body = {
        "input_prefix": INFILL.prefix,
        "input_suffix": INFILL.suffix,
        "n_predict": INFILL_TOKENS,
        "temperature": 0,
        "samplers": ["temperature"],
    }
    answer.sent = time.perf_counter()
    reply = httpx.post(url + "/infill", json=body, timeout=600).json()
    answer.tokens = reply.get("tokens_predicted", 0)
    answer.done = time.perf_counter()


def together(jobs: list) -> float:
    threads = [threading.Thread(target=job) for job in jobs]
    start_s = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start_s


def cases(url: str, max_tokens: int) -> dict[str, dict]:
    rows = {}
    alone = Answer()
    infill(url, alone)
    first, during = Answer(), Answer()

    def infill_after_chat_begins() -> None:
        while first.tokens < INFILL_AFTER and not first.done:
            time.sleep(0.01)
        infill(url, during)

    together([lambda: chat(url, CHATS[0], max(max_tokens, 4 * INFILL_AFTER), first), infill_after_chat_begins])
    rows["infill during a chat"] = {"alone_s": alone.latency, "together_s": during.latency}
    for n in (2, PARALLEL):
        apart = [Answer() for _ in range(n)]
        for text, answer in zip(CHATS, apart, strict=False):
            chat(url, text, max_tokens, answer)
        answers = [Answer() for _ in range(n)]
        seconds = together([lambda t=t, a=a: chat(url, t, max_tokens, a) for t, a in zip(CHATS, answers, strict=False)])
        rows[f"{n} chats"] = {
            "apart_s": sum(a.latency for a in apart),
            "together_s": seconds,
            "latency_s": float(np.median([a.latency for a in answers])),
            "tokens_per_s": sum(a.tokens for a in answers) / seconds,
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ctx", type=int, default=4096, help="context per request (default 4096)")
    parser.add_argument("--log", default="concurrent_side_by_side.log")
    parser.add_argument("--only", help="comma-separated server names (default: all)")
    args = parser.parse_args()
    commands = servers(args)
    if args.only:
        commands = {name: commands[name] for name in args.only.split(",")}
    runs: dict[str, list[dict]] = {name: [] for name in commands}
    for r in range(args.repeats):
        for name in list(commands)[:: -1 if r % 2 else 1]:
            process, url = start(commands[name], Path(args.log))
            try:
                cases(url, 8)  # warm-up: first decodes allocate
                runs[name].append(cases(url, args.max_tokens))
            finally:
                stop(process)
            print(f"{r + 1}/{args.repeats} {name}: {json.dumps(runs[name][-1])}", flush=True)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    machine = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line), "?")
    print(f"{machine}, greedy, chats of up to {args.max_tokens} tokens, medians of {args.repeats}")
    report = {"repeats": args.repeats, "modes": {name: {} for name in runs}}
    for name, repeats in runs.items():
        for case in repeats[0]:
            report["modes"][name][case] = medians([run[case] for run in repeats])
    print_rows(report, column="server")


if __name__ == "__main__":
    main()
