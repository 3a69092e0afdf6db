"""Chat templates from GGUF files, rendered in a sandbox.

A chat template is Jinja code shipped inside a downloaded model: untrusted input.
ImmutableSandboxedEnvironment blocks attribute access to Python internals and
mutation of the objects we pass in.
"""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import EdgespecError

Message = dict[str, str]


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render(template: str, messages: list[Message], *, bos_token: str = "", eos_token: str = "") -> str:
    """The prompt text for `messages`, ending where the assistant's answer begins."""
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise EdgespecError("each chat message must be a dict with string 'role' and 'content'")
    try:
        return _compile(template).render(
            messages=messages, add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token
        )
    except jinja2.TemplateError as e:
        raise EdgespecError(
            f"the model's chat template failed ({e}); send the prompt as plain text with --raw"
        ) from None
