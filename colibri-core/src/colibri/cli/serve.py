"""``coli serve``: the OpenAI- and Anthropic-compatible HTTP API (see docs/server.md).

Safe by default: it binds 127.0.0.1, and refuses any other address unless an API key is set.
"""

from __future__ import annotations

from typing import Optional

import ipaddress
import logging
import socket
import time

import typer

from .. import envvars
from ..errors import EngineError, UsageError
from ..records import TEXT_GENERATION
from ..server.config import (
    API_KEY_ENV,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_HOST,
    DEFAULT_KV_SLOTS,
    DEFAULT_MAX_BODY,
    DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PORT,
    DEFAULT_QUEUE_TIMEOUT_S,
)
from ._app import app
from .options import (FamilyOption, ModelOption, ExpertsKOption, ExpertsTopPOption,
                      ExpertWorkersOption, IoOption, IoThreadsOption, KvBudgetOption, KvDirOption, KvOption,
                      LookaheadOption, PartitionOption, PinOption, PrefetchOption, PreloadOption, TuneProfileOption,
                      kv_options, streaming_options, tune_profile)

_SIZE_SUFFIXES = {"": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024 ** 2, "mb": 1000 ** 2, "mib": 1024 ** 2,
                  "g": 1024 ** 3, "gb": 1000 ** 3, "gib": 1024 ** 3}


def parse_size(text: str, flag: str = "--max-body") -> int:
    """``--max-body``, ``--kv-disk-budget``: bytes, or with a K/M/G/KiB/MiB/GiB suffix."""
    raw = text.strip().lower()
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    suffix = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if suffix not in _SIZE_SUFFIXES or value <= 0:
        raise UsageError(f"{flag} {text!r}: not a size", "give bytes or a size such as 1MiB, 512K or 8G")
    return int(value * _SIZE_SUFFIXES[suffix])


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False   # a hostname could resolve anywhere: treat it as public


def check_bind(host: str, api_key: str | None) -> None:
    if not is_loopback(host) and not api_key:
        raise UsageError(f"--host {host} exposes the server beyond this machine without an API key",
                         f"set --api-key or {API_KEY_ENV}, or bind --host 127.0.0.1")


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading anything, so a taken port is one clear line instead of a failure after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"--host {host} --port {port}: cannot bind ({exc.strerror})",
                         "pick another --port, or stop the program using it") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def open_browser_when_listening(server, url: str) -> None:
    """``coli web``: open the dashboard once uvicorn listens (the page itself waits for the engine)."""
    import threading
    import webbrowser

    def wait_then_open() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started and not webbrowser.open(url):
            typer.echo(f"coli web: no browser found; open {url}", err=True)

    threading.Thread(target=wait_then_open, name="open-browser", daemon=True).start()


@app.command("web", help="Serve the model (as coli serve, same options) and open its dashboard in the browser: "
                         "chat, live speed, hit rate, bytes read, and a per-layer heatmap of the expert cache.")
@app.command("serve")
def serve_command(
    context: typer.Context,
    model: str | None = ModelOption,
    family: str | None = FamilyOption,
    host: str = typer.Option(DEFAULT_HOST, "--host", help="Address to bind. Anything but loopback needs an API "
                             "key."),
    port: int = typer.Option(DEFAULT_PORT, "--port", help="TCP port to listen on."),
    kv_slots: int = typer.Option(DEFAULT_KV_SLOTS, "--kv-slots", help="Sequences the engine runs at once (each "
                                 "keeps its own KV cache; a conversation sticks to its slot)."),
    max_queue: int = typer.Option(DEFAULT_MAX_QUEUE, "--max-queue", help="Requests that may wait for a slot; "
                                  "beyond that the server answers 429 with Retry-After."),
    queue_timeout: float = typer.Option(DEFAULT_QUEUE_TIMEOUT_S, "--queue-timeout", help="Seconds a request may "
                                        "wait for a slot before it gets 429."),
    api_key: str | None = typer.Option(None, "--api-key", envvar=envvars.names(API_KEY_ENV), show_envvar=True,
                                          help="Require this key on every route but /health (Bearer, or "
                                               "x-api-key on /v1/messages)."),
    ctx: int | None = typer.Option(None, "--ctx", help="Context per slot in tokens (prompt + completion); "
                                      "default: the family's default, or down to 1024 when KV would take the expert "
                                      "cache's RAM (a warning says so)."),
    ram: float | None = typer.Option(None, "--ram", help="RAM budget in GiB for the plan (default: what is "
                                        "available)."),
    cap: int | None = typer.Option(None, "--cap", help="Expert cache slots per MoE layer (0 = all experts; "
                                      "default: from the RAM plan)."),
    prefetch: Optional[bool] = PrefetchOption,
    lookahead: Optional[bool] = LookaheadOption,
    io_threads: Optional[int] = IoThreadsOption,
    use_tune_profile: bool = TuneProfileOption,
    preload: Optional[bool] = PreloadOption,
    pin: Optional[bool] = PinOption,
    io: str = IoOption,
    experts_k: Optional[int] = ExpertsKOption,
    expert_workers: Optional[int] = ExpertWorkersOption,
    partition: str = PartitionOption,
    experts_top_p: Optional[float] = ExpertsTopPOption,
    threads: int | None = typer.Option(None, "--threads", help="Engine compute threads (default: cores)."),
    cors_origin: list[str] | None = typer.Option(
        None, "--cors-origin", metavar="ORIGIN",
        help="Allow browser requests from this origin (repeatable; CORS is off without it)."),
    max_body: str = typer.Option(str(DEFAULT_MAX_BODY), "--max-body", help="Largest request body (bytes, or "
                                 "e.g. 1MiB); larger ones get 413."),
    allowed_host: list[str] | None = typer.Option(
        None, "--allowed-host", metavar="NAME",
        help="Also answer requests whose Host is NAME (repeatable; .example.com: and its subdomains; * = any). "
             "IP addresses, localhost and the --host name are always allowed."),
    header_timeout: float = typer.Option(DEFAULT_HEADER_TIMEOUT_S, "--header-timeout", help="Seconds a "
                                         "connection has to send a request's headers; then it is closed."),
    body_timeout: float = typer.Option(DEFAULT_BODY_TIMEOUT_S, "--body-timeout", help="Seconds a request's body "
                                       "has to arrive after its headers; then 408."),
    max_connections: int | None = typer.Option(None, "--max-connections", help="Open connections at once; more "
                                                  "get 503 (default: 512, fewer if the descriptor limit is low)."),
    max_connections_per_client: int = typer.Option(DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
                                                   "--max-connections-per-client",
                                                   help="Open connections from one client address."),
    log_level: str = typer.Option("info", "--log-level", help="Server log level: debug, info, warning, error."),
    disk_bw: float | None = typer.Option(None, "--disk-bw", metavar="GB/s", help="The model disk's read "
                                         "bandwidth for the disk bound (default: the coli tune profile's, else "
                                         "what coli plan --measure-disk measured on that disk)."),
    replicas: int | None = typer.Option(None, "--replicas", help="Run N engine replicas as Ray actors across the "
                                        "cluster's nodes behind this one endpoint, --kv-slots each (needs "
                                        "colibri-core[cluster]; docs/cluster.md). coli cluster serve: one per node."),
    address: str | None = typer.Option(None, "--address", metavar="RAY_ADDRESS", help="The Ray cluster of the "
                                       "replicas or expert workers (host:port, or auto); default: RAY_ADDRESS, "
                                       "else a new local one."),
    replica_resource: list[str] | None = typer.Option(
        None, "--replica-resource", metavar="TAG",
        help="Place the replicas on nodes with this Ray resource (repeatable: replica i takes the i-th tag, in "
             "turn)."),
    kv: bool | None = KvOption,
    kv_dir: str | None = KvDirOption,
    kv_disk_budget: str = KvBudgetOption,
) -> None:
    """Serve the model over an OpenAI- and Anthropic-compatible HTTP API."""
    from .. import hooks
    from ..launch import prepare, start
    from ..model import resolve_model
    from ..console import print_warning
    from ..prompt import NO_TEMPLATE_NOTICE, checkpoint_sampling
    from ..server import ServerConfig, create_app
    from ..server.codec import TokenizerCodec
    from ..server.connections import uvicorn_server
    from ..disk_bound import disk_bound_for

    check_bind(host, api_key)
    if not 1 <= port <= 65535:
        raise UsageError(f"--port {port}: must be between 1 and 65535")
    if kv_slots < 1:
        raise UsageError(f"--kv-slots {kv_slots}: must be at least 1")
    if max_queue < 0:
        raise UsageError(f"--max-queue {max_queue}: must be 0 or more")
    if queue_timeout <= 0:
        raise UsageError(f"--queue-timeout {queue_timeout:g}: must be a positive number of seconds")
    body_limit = parse_size(max_body)
    kv_opts = kv_options(kv, kv_dir, kv_disk_budget, default=True)
    if body_limit < 1024:
        raise UsageError(f"--max-body {max_body}: must be at least 1 KiB")
    for name, seconds in (("--header-timeout", header_timeout), ("--body-timeout", body_timeout)):
        if not seconds > 0:
            raise UsageError(f"{name} {seconds:g}: must be a positive number of seconds")
    if max_connections is not None and max_connections < 1:
        raise UsageError(f"--max-connections {max_connections}: must be at least 1")
    if max_connections_per_client < 1:
        raise UsageError(f"--max-connections-per-client {max_connections_per_client}: must be at least 1")
    level = log_level.lower()
    if level not in ("debug", "info", "warning", "error"):
        raise UsageError(f"--log-level {log_level}: not a level", "use debug, info, warning or error")
    on_cluster = replicas is not None or (context.parent is not None and context.parent.info_name == "cluster")
    if not on_cluster and (replica_resource or (address and not expert_workers)):
        raise UsageError(f"{'--replica-resource' if replica_resource else '--address'}: only with --replicas N"
                         f"{'' if replica_resource else ' or --expert-workers N'}",
                         "add --replicas N, or use coli cluster serve")
    if on_cluster and expert_workers:
        raise UsageError("--expert-workers: not together with replicas (yet)",
                         "serve replicas, or one engine whose experts live on the workers")
    if replicas is not None and replicas < 1:
        raise UsageError(f"--replicas {replicas}: must be at least 1")

    resolved = resolve_model(model, family)
    if hooks.model_task(resolved) != TEXT_GENERATION:
        if on_cluster:
            raise UsageError(f"{resolved.path}: replicas serve text-generation models only",
                             "serve this model without --replicas")
        _serve_family_routes(resolved, host, port, kv_slots, max_queue, queue_timeout, api_key, cors_origin,
                             body_limit, allowed_host, header_timeout, body_timeout, max_connections,
                             max_connections_per_client, level, {"threads": threads, "ram": ram})
        return
    # the tokenizer and template exactly as coli run / coli chat load them (a family may answer itself)
    codec = TokenizerCodec(hooks.load_tokenizer(resolved), model=resolved)
    if not codec.renders_chat:
        print_warning(NO_TEMPLATE_NOTICE)
    spec = prepare(resolved, ram_gib=ram, ctx=ctx, trade_ctx=True, slots=kv_slots, cap=cap, threads=threads,
                   streaming=streaming_options(prefetch, pin, io, experts_k, experts_top_p, lookahead, preload),
                   tune=tune_profile(use_tune_profile, resolved.path), io_threads=io_threads)
    from ..cluster.experts import with_expert_workers

    spec, expert_cluster = with_expert_workers(spec, expert_workers, partition, address)
    disk = disk_bound_for(spec, disk_bw)   # the dashboard's, /metrics' and every done event's disk bound
    engine_factory, replica_count = (lambda: start(spec, kv=kv_opts)), 0
    if on_cluster:
        engine_factory, replica_count = _replica_factory(spec, replicas, address, tuple(replica_resource or ()))
    sock = bind_socket(host, port)

    fatal: list[str] = []
    slots_total = kv_slots * max(1, replica_count)   # the server's scheduler spreads its slots over the replicas
    config = ServerConfig(model_id=resolved.path.name, ctx=spec.ctx, kv_slots=slots_total, max_queue=max_queue,
                          queue_timeout=queue_timeout, api_key=api_key or None,
                          cors_origins=tuple(cors_origin or ()), max_body=body_limit, family=resolved.family,
                          created=int(time.time()), lossy=spec.streaming.lossy_label(), host=host,
                          allowed_hosts=tuple(allowed_host or ()), header_timeout=header_timeout,
                          body_timeout=body_timeout, max_connections=max_connections or 0,
                          max_connections_per_client=max_connections_per_client, disk_bandwidth=disk.bandwidth,
                          disk_bandwidth_source=disk.source,
                          routed_bytes_per_token=spec.plan.routed_bytes_per_token)

    def on_fatal(detail: str) -> None:
        fatal.append(detail)
        server.should_exit = True

    application = create_app(config, engine_factory, codec, on_fatal=on_fatal,
                             default_sampling=checkpoint_sampling(resolved.path))
    # access_log off: colibri.server.access logs each request with its route, tokens and duration instead
    server = uvicorn_server(application, config, log_level=level, timeout_graceful_shutdown=5, access_log=False)
    shown = f"[{host}]" if ":" in host else host
    typer.echo(f"coli serve: {resolved.path.name} ({resolved.family}) on http://{shown}:{port}/v1 — "
               f"{f'{replica_count} replicas x ' if replica_count else ''}{kv_slots} slot(s), ctx {spec.ctx}, "
               f"queue {max_queue}, "
               f"{'API key required' if api_key else 'no API key (loopback only)'}; dashboard on "
               f"http://{shown}:{port}/; loading the engine…", err=True)
    if context.info_name == "web":
        open_browser_when_listening(server, f"http://{shown}:{port}/")
    try:
        _run_server(server, sock, level)
    finally:
        if expert_cluster is not None:
            expert_cluster.stop()
    if fatal:
        raise EngineError(fatal[0])


def _replica_factory(spec, replicas: int | None, address: str | None, resources: tuple[str, ...]):
    """``--replicas``: join the Ray cluster now (a bad address is one line before anything loads) and return the
    factory of the replica pool the server loads in the background, with the number of replicas (default: one per
    alive node)."""
    from ..cluster.replicas import ReplicaPool, alive_nodes, check_placement, connect

    ray = connect(address)
    count = replicas or len(alive_nodes(ray))
    check_placement(ray, resources, spec.threads)
    return (lambda: ReplicaPool(spec, count, address=address, resources=resources)), count


def _run_server(server, sock: socket.socket, level: str) -> None:
    server_log = logging.getLogger("colibri.server")
    if not server_log.handlers:   # uvicorn configures only its own loggers; engine deaths and restarts go here
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        server_log.addHandler(handler)
        server_log.propagate = False
    server_log.setLevel(level.upper())
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


def _serve_family_routes(resolved, host, port, kv_slots, max_queue, queue_timeout, api_key, cors_origin,
                         body_limit, allowed_host, header_timeout, body_timeout, max_connections,
                         max_connections_per_client, level, options) -> None:
    """Serve a non-text model: its family's routes (``server_routes``) behind core's gate, queue and limits."""
    from .. import hooks
    from ..server import ServerConfig, create_app
    from ..server.connections import uvicorn_server

    task = hooks.model_task(resolved)
    routes = hooks.server_routes(resolved, options)
    if not routes:
        raise UsageError(f"{resolved.path}: the {resolved.family} family serves no HTTP API for {task} models",
                         "coli families lists what each family runs")
    sock = bind_socket(host, port)
    config = ServerConfig(model_id=resolved.path.name, ctx=0, kv_slots=kv_slots, max_queue=max_queue,
                          queue_timeout=queue_timeout, api_key=api_key or None,
                          cors_origins=tuple(cors_origin or ()), max_body=body_limit, family=resolved.family,
                          created=int(time.time()), host=host, allowed_hosts=tuple(allowed_host or ()),
                          header_timeout=header_timeout, body_timeout=body_timeout,
                          max_connections=max_connections or 0,
                          max_connections_per_client=max_connections_per_client)
    application = create_app(config, None, None, family_routes=routes)
    server = uvicorn_server(application, config, log_level=level, timeout_graceful_shutdown=5, access_log=False)
    shown = f"[{host}]" if ":" in host else host
    typer.echo(f"coli serve: {resolved.path.name} ({resolved.family}, {task}) on http://{shown}:{port}/v1 — "
               f"{', '.join(r.path for r in routes)}; {kv_slots} slot(s), queue {max_queue}, "
               f"{'API key required' if api_key else 'no API key (loopback only)'}", err=True)
    _run_server(server, sock, level)
