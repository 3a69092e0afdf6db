"""edgespec chat: a Textual app that shows speculative decoding live.

It reaches the engine only through edgespec's public API."""
