"""edgespec: local, offline speculative decoding on llama.cpp.

import edgespec
with edgespec.load() as engine:                      # the default pair from models.toml
    for event in engine.stream("Write a merge sort in Python", temperature=0, max_tokens=200):
        print(event.text, end="", flush=True)
    print(event.stats.summary())
"""

from .drafters import Draft, Drafter, ModelDrafter
from .engine import Engine, Event, Generation
from .engine_thread import EngineThread
from .errors import EdgespecError
from .loader import PairInfo, load, pairs, pull_models
from .model import Model
from .sampling import SamplingParams
from .stats import Stats
from .tools import ToolCall, ToolChoice

__all__ = [
    "Draft",
    "Drafter",
    "EdgespecError",
    "Engine",
    "EngineThread",
    "Event",
    "Generation",
    "Model",
    "ModelDrafter",
    "PairInfo",
    "SamplingParams",
    "Stats",
    "ToolCall",
    "ToolChoice",
    "load",
    "pairs",
    "pull_models",
]
