"""``coli serve``: an OpenAI- and Anthropic-compatible HTTP API over one persistent engine.

Modules, one job each: ``config`` (settings), ``app`` (routes, key gate, body limit, CORS, error envelopes),
``validation`` (request bodies → :class:`~.validation.GenerationSpec`), ``generation`` (one request's life:
slot, submit, events → text), ``scheduler`` (KV slots + bounded FIFO queue), ``engine_host`` (load, watch,
restart the engine), ``textgen`` (stop sequences), ``sse`` (event-stream framing), ``hangup`` (noticing a
client's disconnect), ``crosssite`` (Host, Origin and content-type rules), ``connections`` (header deadline,
connection caps, descriptor exhaustion), ``prompt_bound`` (bytes per token, to refuse before tokenizing),
``metrics`` (Prometheus text), ``access_log`` (a line per request), ``auth`` (API key), ``codec`` (tokenizer +
chat template), ``openai_routes`` / ``anthropic_routes`` (the two dialects), ``observe`` (the engine's expert
stats and the last requests' profile), ``dashboard`` (``/experts``, ``/profile`` and the page's static files).
"""

from __future__ import annotations

from .app import create_app
from .config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
