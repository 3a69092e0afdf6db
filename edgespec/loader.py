"""edgespec.load(): models by registry name, hub name or path (resolve.py), fetched and verified,
into an Engine, with the draft model found for the target where asked (pairing.py)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from .calibration import choose_flash_attn
from .chat import validate_template
from .drafters import HeadsDrafter, ModelDrafter
from .engine import Engine
from .errors import EdgespecError
from .heads import Heads, has_heads
from .memory import DEFAULT_MEMORY_MB, Memory, memory_wanted, vocabulary_id
from .model import KV_MEMORY_SHARE, MAX_SNAPSHOTS, Model
from .modes import DraftMode, Gamma, check_mode
from .modes import draft_mode as parse_mode
from .pairing import HEADS, find_draft
from .prompt_cache import DEFAULT_CACHE_RAM_MIB, PromptCache
from .registry import cached_path, load_registry
from .resolve import resolve_model
from .tokenizer import compatibility_problem, header_chat_template

AUTO_DRAFT = "auto"  # draft=: the draft model found for the target (pairing.py)
MAX_PARALLEL = 256  # requests at once: llama.cpp's limit on a context's sequences (LLAMA_MAX_SEQ)


@dataclass(frozen=True)
class PairInfo:
    name: str
    target: str
    draft: str
    description: str
    downloaded: bool  # both models are in the cache
    default: bool


def pairs() -> list[PairInfo]:
    """The target/draft pairs of models.toml (built-in and the user's)."""
    registry = load_registry()
    return [
        PairInfo(
            p.name,
            p.target,
            p.draft,
            p.description,
            all(cached_path(registry.model(m)).is_file() for m in (p.target, p.draft)),
            p.name == registry.default_pair,
        )
        for p in registry.pairs.values()
    ]


def load(
    pair: str | None = None,
    *,
    target: str | os.PathLike | None = None,
    draft: str | os.PathLike | None = None,
    gamma: Gamma | int | str | None = None,
    draft_mode: DraftMode | str = DraftMode.AUTO,
    n_ctx: int | None = None,
    n_threads: int | None = None,
    n_gpu_layers: int = 0,
    cache_ram: int = DEFAULT_CACHE_RAM_MIB,
    cache_reuse: int = 0,
    offline: bool = False,
    progress: bool = True,
    check_template: bool = False,
    parallel: int = 1,
    memory: bool | None = None,
    memory_mb: int = DEFAULT_MEMORY_MB,
    memory_source: str = "library",
) -> Engine:
    """Load a target model and (optionally) a draft model into an Engine.

    pair: a pair name from models.toml (default: its default_pair) — or give
    target (and draft) as registry names, hub names (hf:OWNER/REPO[:QUANT] or
    hf:OWNER/REPO/FILE.gguf, see hub.py) or .gguf paths, and draft="auto" for the best draft
    this target can have (pairing.py: said on stderr with progress), draft="heads" for its own
    MTP heads (heads.py); a target whose file has MTP heads drafts with them unless a draft
    model is given; without either only the free copy drafter is there. gamma (an int, or
    "auto"; None: the pair's, else auto) and draft_mode (auto, model, copy, hybrid, off; model and
    hybrid draft with the heads where they are the drafter) are the engine's defaults;
    auto measures this machine's costs at first use and chooses per round.
    n_ctx: the context in tokens; None: the target's trained context, capped so that both
    KV caches take at most a quarter of this machine's memory (the draft gets the same size, its
    keys and values in q8_0: Model's compact_cache).
    Flash attention is on or off, whichever this machine runs faster (measured at load, once a day).
    n_gpu_layers offloads layers on Metal/CUDA builds. cache_ram: MiB for the KV
    states of earlier prompts (prompt_cache.py: in RAM while in use, written to disk by the
    engine's idle work), so alternating conversations each pay only for their new part; 0
    keeps only the live one. cache_reuse: as llama-server's --cache-reuse, a prompt's cached runs of
    at least this many tokens after what changed are shifted into place, not read again (an
    editor's ring of snippets that dropped its oldest: kv_cache.Cache.shift_runs); such an answer
    is not exactly the target's for the prompt sent (the shifted cells were read after the text
    dropped), so 0, the default, keeps none. check_template: render the target's chat
    template once (in the sandbox) before the models are loaded and timed, so that a hostile
    one fails at once (the command line does, for chat prompts); otherwise it fails per request
    and raw text still works. parallel: requests the engine answers at once (a sequence each in
    both models' contexts, sharing their n_ctx cells; see sequences.py). memory: draft from
    what earlier requests on this machine read and wrote, and keep each request's prompt and
    answer there (memory.py: one file per tokenizer in the cache folder, at most memory_mb MiB,
    the oldest forgotten first); None: yes, unless $EDGESPEC_MEMORY is "off"; memory_source:
    what `edgespec memory` counts them under.
    Raises EdgespecError with a one-sentence reason for bad input."""
    gamma = Gamma.of(gamma) if gamma is not None else None
    if pair is not None and target is not None:
        raise EdgespecError("give either a pair or a target (and draft), not both")
    if target is None:
        if draft is not None:
            raise EdgespecError("a draft model needs a target; give --target too")
        registry = load_registry()
        entry = registry.pair(pair or registry.default_pair)
        target, draft = entry.target, entry.draft
        if gamma is None and "gamma" in entry.settings:
            gamma = Gamma.of(entry.settings["gamma"])
    if draft == AUTO_DRAFT:
        choice = find_draft(target, offline=offline, progress=progress)
        if progress:
            print(choice.summary(), file=sys.stderr, flush=True)
        draft = choice.draft
    if memory is None:
        memory = memory_wanted()
    if memory and memory_mb < 1:
        raise EdgespecError(
            f"the memory's size must be at least 1 MiB, got {memory_mb}; or switch it off (--no-memory)"
        )
    if not 1 <= parallel <= MAX_PARALLEL:
        raise EdgespecError(f"parallel must be 1..{MAX_PARALLEL} requests at once, got {parallel}")
    if cache_reuse < 0:
        raise EdgespecError(f"cache reuse is a number of tokens, 0 for none; got {cache_reuse}")
    draft_mode = parse_mode(draft_mode)  # (whether it needs a draft is known once the target's file is)

    paths = [resolve_model(m, offline=offline, progress=progress) for m in (target, draft) if m not in (None, HEADS)]
    heads = has_heads(paths[0]) if draft in (None, HEADS) else False
    if draft == HEADS and not heads:
        raise EdgespecError(f"{paths[0].name} has no MTP heads of its own; give a draft model or --draft auto")
    draft_mode = check_mode(draft_mode, has_model=draft is not None or heads)
    if check_template and (template := header_chat_template(paths[0])) is not None:  # what fails cheaply fails first
        validate_template(template)
    models: list[Model] = []
    try:
        share = KV_MEMORY_SHARE / len(paths)  # the draft's cache is usually the smaller: half each is safe
        for path in paths:
            size = models[0].n_ctx if models else n_ctx  # the draft follows the target
            # a draft model decodes a token a pass: llama.cpp's snapshots of the last pass cannot cut its drafts back
            snapshots = 0 if models else MAX_SNAPSHOTS
            models.append(
                Model(
                    path,
                    n_ctx=size,
                    n_threads=n_threads,
                    n_gpu_layers=n_gpu_layers,
                    kv_memory_share=share,
                    snapshots=snapshots,
                    n_seq=parallel,
                    load_mtp=heads and not models,
                    compact_cache=bool(models),  # a draft's q8_0 cache: its rounding never reaches an answer
                )
            )
        drafter = None
        if len(models) == 2:
            if problem := compatibility_problem(models[0], models[1]):
                raise EdgespecError(problem)
            drafter = ModelDrafter(models[1], target_vocab=models[0].n_vocab)
        for model in models:  # measured once per machine; the same for every run, so outputs agree
            choose_flash_attn(model)
        if heads:
            models[0].hidden.export()
            drafter = HeadsDrafter(Heads(models[0]))
        for model in models if cache_reuse else ():
            if not model.can_shift:
                name = model.path.name
                raise EdgespecError(f"{name}'s cache cannot be shifted (a recurrent state); drop --cache-reuse")
            model.cache.reuse = cache_reuse
        if cache_ram > 0:
            cache = PromptCache(cache_ram << 20)
            for model in models:
                model.prompt_cache = cache
        remembered = None
        if memory:
            name, vocabulary = models[0].path.name, vocabulary_id(models[0])
            try:
                remembered = Memory(vocabulary, cap_mb=memory_mb, source=memory_source, model=name)
            except OSError as e:  # its folder not writable, say: the answers need it not
                print(f"edgespec: the memory cannot be used ({e}); going on without it", file=sys.stderr)
    except BaseException:
        for model in models:
            model.close()
        raise
    return Engine(models[0], drafter, gamma=gamma or Gamma(), draft_mode=draft_mode, owned=models, memory=remembered)
