"""The one error type users see: a single sentence naming the problem and the fix."""


class EdgespecError(Exception):
    """Bad input or a failed fetch; the CLI prints it on one line and exits with 2."""


class PromptExceedsContext(EdgespecError):
    """A prompt longer than the context holds. size: its size ("20771 tokens", or characters
    where it was refused before tokenizing); n_ctx: the context's tokens."""

    def __init__(self, size: str, n_ctx: int) -> None:
        super().__init__(
            f"the prompt is {size} but the context holds {n_ctx} tokens; shorten the prompt or raise --ctx"
        )
        self.size, self.n_ctx = size, n_ctx
