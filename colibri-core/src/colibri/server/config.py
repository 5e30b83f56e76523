"""The server's settings, as ``coli serve`` collects them from flags and the environment."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_KV_SLOTS = 1
DEFAULT_MAX_QUEUE = 16
DEFAULT_QUEUE_TIMEOUT_S = 60.0
DEFAULT_MAX_BODY = 1024 * 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 64
API_KEY_ENV = "COLIBRI_API_KEY"   # colibri.envvars.API_KEY (alias COLI_API_KEY)


@dataclass(frozen=True)
class ServerConfig:
    model_id: str                          # the name /v1/models lists (the model directory's name)
    ctx: int                               # tokens per slot
    kv_slots: int = DEFAULT_KV_SLOTS
    max_queue: int = DEFAULT_MAX_QUEUE
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_body: int = DEFAULT_MAX_BODY
    family: str = ""
    created: int = 0                       # unix time the server started (the model's "created")
    lossy: str = ""                        # opt-in lossy routing ("experts-k=4"), labelled on every response
    host: str = DEFAULT_HOST               # the bound address (a name there is a Host the server answers to)
    allowed_hosts: tuple[str, ...] = ()    # more Host names to answer to (--allowed-host; "*" = any)
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S    # a request's headers must be in within this
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S        # and its body within this after them
    max_connections: int = 0               # open connections at once; 0 = 512, or fewer if descriptors are few
    max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT   # from one client address
    disk_bandwidth: float = 0.0            # bytes/s of the model's disk for the dashboard's disk bound; 0 = unknown
    disk_bandwidth_source: str = "unknown"   # where that figure came from (--disk-bw, an earlier measurement)
    routed_bytes_per_token: int = 0        # routed-expert bytes one token reads when every expert misses (the plan)
