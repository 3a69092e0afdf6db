"""`edgespec serve`, the server's wing: HTTP in front of one Engine.

- app.py: the Worker (the engine on its EngineThread, up to --parallel requests answered at
  once by the scheduler, ../scheduler.py) and the HTTP API (Starlette, uvicorn);
- answers.py: what every API shares (a Job, its answer read as Pieces, ApiError, Dialect);
- the dialects, each a Dialect: openai_api.py (chat completions, completions),
  anthropic_api.py (Messages), responses_api.py (OpenAI's Responses), llama_api.py
  (llama-server's /completion and /infill, editors' code completion); api_body.py, the
  fields they read alike;
- metrics.py: /metrics and the load /health reports.

The library's API stays Engine (one request at a time, as `generate`, the chat app and Python
users drive it); the scheduler and the EngineThread stay beside it, as the chat app and the
concurrent bench run them too.
"""
