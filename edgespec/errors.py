"""The one error type users see: a single sentence naming the problem and the fix."""


class EdgespecError(Exception):
    """Bad input or a failed fetch; the CLI prints it on one line and exits with 2."""
