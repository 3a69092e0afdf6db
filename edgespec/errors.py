"""The one error type users see: a single sentence naming the problem and the fix."""


class EdgespecError(Exception):
    """Bad input or a failed fetch; the CLI prints it on one line and exits with 2."""


class EngineFault(EdgespecError):
    """The engine or llama.cpp failed on a request that was good (a refused decode or cut, a state
    not saved): not the request's fault, so a server answers 500 and logs it; the library and the
    command line say it in one line as any EdgespecError."""


class PromptExceedsContext(EdgespecError):
    """A prompt longer than the context holds. size: its size ("20771 tokens", or characters
    where it was refused before tokenizing); n_ctx: the context's tokens."""

    def __init__(self, size: str, n_ctx: int, n_seq: int = 1) -> None:
        """n_seq: requests answered at once, each with n_ctx tokens of its own (a server's --parallel)."""
        each = f" for each of {n_seq} requests at once" if n_seq > 1 else ""
        fix = "raise --ctx (or lower --parallel, which shares the memory among fewer)" if n_seq > 1 else "raise --ctx"
        super().__init__(
            f"the prompt is {size} but the context holds {n_ctx} tokens{each}; shorten the prompt or {fix}"
        )
        self.size, self.n_ctx, self.n_seq = size, n_ctx, n_seq
