"""Drafters: each proposes the next few tokens; the engine verifies them.

Like llama.cpp's common/speculative.cpp, making a draft is split from verifying
it: a drafter begins with the prompt, drafts before a round and accepts what the
round kept; the engine does not care where a draft came from, only that q (if
given) is the distribution each token was drawn from. One module per draft source: the draft
model (draft_model.py), the target's own MTP heads (mtp_heads.py), copies from source texts
(copy.py), what a grammar forces (forced.py), what earlier requests wrote (recall.py).
"""

from .base import Branching, Draft, Drafter
from .copy import Conversation, CopyDrafter
from .draft_model import ModelDrafter
from .forced import GrammarDrafter
from .mtp_heads import HeadsDrafter
from .recall import MemoryDrafter

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
