"""Models by name: a registry name (models.toml) or a hub name (hf:OWNER/REPO..., hub.py) is
fetched on first use and verified by sha256; anything else is a path to a GGUF file."""

from __future__ import annotations

import os
from pathlib import Path

from . import hub
from .registry import load_registry, pull, verify_cached
from .tokenizer import check_gguf


def pull_models(names: list[str], *, offline: bool = False, progress: bool = True) -> dict[str, Path]:
    """Fetch and verify models, or both models of pairs, by name (a hub name's repo listed
    again, unless offline); return their paths."""
    registry = load_registry()
    models: list[str] = []
    paths = {}
    for name in names:
        if hub.is_hub_name(name):
            paths[name] = hub.pull_name(name, offline=offline, progress=progress)
        elif name in registry.pairs:
            models += [registry.pair(name).target, registry.pair(name).draft]
        else:
            models.append(registry.model(name).name)
    return paths | {m: pull(registry.model(m), offline=offline, progress=progress) for m in dict.fromkeys(models)}


def resolve_model(name_or_path: str | os.PathLike, *, offline: bool = False, progress: bool = True) -> Path:
    """A registry name or a hub name (hf:OWNER/REPO..., see hub.py) is fetched on first use and
    verified by sha256; anything else is taken as a path to a GGUF file."""
    if hub.is_hub_name(name_or_path):
        return hub.resolve(name_or_path, offline=offline, progress=progress)
    registry = load_registry()
    if isinstance(name_or_path, str) and name_or_path in registry.models:
        entry = registry.model(name_or_path)
        pull(entry, offline=offline, progress=progress)
        return verify_cached(entry)
    path = Path(name_or_path).expanduser()
    if not path.exists() and isinstance(name_or_path, str) and os.sep not in name_or_path and "." not in path.suffix:
        registry.model(name_or_path)  # neither a file nor a known name: say which names exist
    return check_gguf(path)
