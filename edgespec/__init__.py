"""edgespec: local, offline speculative decoding on llama.cpp.

import edgespec
with edgespec.load() as engine:                      # the default pair from models.toml
    for event in engine.stream("Write a merge sort in Python", temperature=0, max_tokens=200):
        print(event.text, end="", flush=True)
    print(event.stats.summary())
"""

from importlib import import_module

# names are imported on first use, so that `from edgespec import Stats` (a shell reading
# statistics, a test) does not start llama.cpp
_MODULES = {
    "Draft": "drafters",
    "Drafter": "drafters",
    "ModelDrafter": "drafters",
    "Engine": "engine",
    "Event": "engine",
    "Generation": "engine",
    "EngineThread": "engine_thread",
    "EdgespecError": "errors",
    "EngineFault": "errors",
    "Chunk": "fim",
    "Infill": "fim",
    "PairInfo": "loader",
    "load": "loader",
    "pairs": "loader",
    "pull_models": "resolve",
    "TokenLogprob": "logprobs",
    "Memory": "memory",
    "Model": "model",
    "DraftMode": "modes",
    "Gamma": "modes",
    "Source": "modes",
    "Request": "request",
    "Law": "sampling",
    "Penalties": "sampling",
    "SamplingParams": "sampling",
    "Stats": "stats",
    "ToolCall": "tools",
    "ToolChoice": "tools",
}
__all__ = sorted(_MODULES)


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'edgespec' has no attribute '{name}'")
    value = getattr(import_module(f".{_MODULES[name]}", __name__), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
