"""Chat templates from GGUF files: untrusted code, rendered where it can do no harm.

A chat template is Jinja code shipped inside a downloaded model. Jinja's sandbox
(ImmutableSandboxedEnvironment) stops attribute escapes, but not resource bombs: a
template can build a 10 GB string, loop for hours or recurse without end. So templates
render in the sandbox worker (sandbox.py), capped in memory and killed after
RENDER_SECONDS; whatever a template does, the caller gets one EdgespecError.
"""

from __future__ import annotations

from .errors import EdgespecError
from .sandbox import sandbox

Message = dict[str, str]

RENDER_SECONDS = 2.0  # a template that takes longer is killed
FIX = "send the prompt as plain text with --raw (or fix the model's template)"


def render(
    template: str,
    messages: list[Message],
    *,
    bos_token: str = "",
    eos_token: str = "",
    max_chars: int,
    tools: list[dict] | None = None,
) -> str:
    """The prompt text for `messages` (and `tools`, for a template that takes them), ending
    where the assistant's answer begins. A text longer than max_chars is refused (see
    prompts.MAX_CHARS_PER_TOKEN)."""
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise EdgespecError("each chat message must be a dict with string 'role' and 'content'")
    request = dict(
        kind="render",
        template=template,
        messages=messages,
        tools=tools,
        bos_token=bos_token,
        eos_token=eos_token,
        max_chars=max_chars,
    )
    answer = sandbox.answer(request, RENDER_SECONDS, what="the model's chat template", fix=FIX)
    if "too_long" in answer:
        raise PromptTooLong(answer["too_long"])
    return answer["text"]


SAMPLE = [{"role": "user", "content": "hi"}]  # the shortest of conversations: a template's own cost
SAMPLE_MAX_CHARS = 1 << 20


def validate_template(template: str) -> None:
    """Render a short conversation, so that a template that escapes, hangs or exhausts memory
    fails (EdgespecError) before a model is loaded and timed, not at the first request."""
    try:
        render(template, SAMPLE, max_chars=SAMPLE_MAX_CHARS)
    except PromptTooLong:
        pass  # a template that only blows up the user's text: refused per request, with its size


class PromptTooLong(Exception):
    """The rendered prompt has more characters than the context could hold tokens."""

    def __init__(self, n_chars: int) -> None:
        super().__init__(n_chars)
        self.n_chars = n_chars
