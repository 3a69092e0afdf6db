"""Drafters: each proposes the next few tokens; the engine verifies them.

Like llama.cpp's common/speculative.cpp, making a draft is split from verifying
it: a drafter begins with the prompt, drafts before a round and accepts what the
round kept; the engine does not care where a draft came from, only that q (if
given) is the distribution each token was drawn from. One module per draft source: the draft
model (model.py), the target's own MTP heads (heads.py), copies from source texts (copy.py),
what a grammar forces (grammar.py), what earlier requests wrote (memory.py).
"""

from .base import Branching, Draft, Drafter
from .copy import Conversation, CopyDrafter
from .grammar import GrammarDrafter
from .heads import HeadsDrafter
from .memory import MemoryDrafter
from .model import ModelDrafter

__all__ = [
    "Branching",
    "Conversation",
    "CopyDrafter",
    "Draft",
    "Drafter",
    "GrammarDrafter",
    "HeadsDrafter",
    "MemoryDrafter",
    "ModelDrafter",
]
