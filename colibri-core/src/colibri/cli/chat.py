"""``coli chat``: an interactive conversation with one engine loaded once, or (``--attach``) with a running server."""

from __future__ import annotations

import re
import sys
from typing import Any, Callable, Optional

import typer

from .. import envvars
from ..console import print_error, print_warning
from ..errors import ColibriError, UsageError
from ..server.config import API_KEY_ENV
from ..model import resolve_model
from ._app import app
from .options import (FamilyOption, ModelOption, ExpertsKOption, ExpertsTopPOption,
                      IoOption, IoThreadsOption, KvBudgetOption, KvDirOption, KvOption, LookaheadOption, PinOption,
                      PrefetchOption, PreloadOption, TuneProfileOption, kv_options, streaming_options, tune_profile)

DEFAULT_MAX_TOKENS = 1024
COMMANDS = "/reset (new conversation), /stats (token reuse and speed), /help, /exit"
HELP_TEXT = (f'commands: {COMMANDS}; end a line with \\ to continue it, or wrap several lines in """; '
             'start a message with // to send it with one leading /; Ctrl-C stops a reply')
# A line is a command when its first word is a slash and letters ("/stats", "/sttas"); "/usr/bin ..." is a message.
COMMAND_WORD = re.compile(r"/[A-Za-z?]+")


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _engine_summary(stats: dict[str, Any]) -> str:
    """The engine's cumulative counters on one line (per-layer lists summed)."""
    from ..console import human_bytes

    parts = []
    for key, value in stats.items():
        if key == "ev":
            continue
        if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            value = sum(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(f"{key} {human_bytes(value) if 'bytes' in key else value}")
    return ", ".join(parts)


def stats_report(session, engine_stats: dict[str, Any] | None) -> str:
    from ..streaming import stats_line

    if not session.turns:
        lines = ["no turns yet"]
    else:
        last, total = session.turns[-1], session.totals()
        lines = [f"last turn: {last.prompt_tokens} prompt tokens = {last.reused_tokens} reused + "
                 f"{last.prefilled_tokens} prefilled; {last.generated_tokens} generated",
                 f"  {stats_line(last.done, {'reused_tokens': last.reused_tokens})}",
                 f"conversation: {len(session.turns)} turns, {total.prefilled_tokens} tokens prefilled, "
                 f"{total.reused_tokens} reused from the cache, {total.generated_tokens} generated"]
        if session.dropped_messages:
            lines.append(f"  {session.dropped_messages} oldest messages dropped to fit --ctx {session.ctx}")
    if engine_stats:
        lines.append(f"engine: {_engine_summary(engine_stats)}")
    return "\n".join(lines)


class ReasoningApart:
    """Writes a reply whose reasoning arrives apart (an attached server parses it out): the reasoning dimmed on a
    terminal, then the answer on a line of its own."""

    def __init__(self, interactive: bool):
        self.interactive = interactive
        self.thinking = False

    def think(self, text: str) -> None:
        if not self.thinking:
            self.thinking = True
            _write("\x1b[2m" if self.interactive else "")
        _write(text)

    def answer(self, text: str) -> None:
        self.end()
        _write(text)

    def end(self) -> None:
        if self.thinking:
            self.thinking = False
            _write("\x1b[0m\n" if self.interactive else "\n")


@app.command("chat")
def chat_command(
    url: Optional[str] = typer.Argument(None, metavar="URL", help="With --attach: the server's address "
                                        "(default http://127.0.0.1:8000)."),
    attach: bool = typer.Option(False, "--attach", help="Drive a running coli serve over its streaming API "
                                "(at URL, default 127.0.0.1:8000) instead of loading an engine here; with no "
                                "server there, run an engine here as without --attach."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar=envvars.names(API_KEY_ENV), show_envvar=True,
                                          help="With --attach: the server's API key (sent as a bearer token)."),
    model: Optional[str] = ModelOption,
    family: Optional[str] = FamilyOption,
    system: Optional[str] = typer.Option(None, "--system", help="A system message to start the conversation."),
    max_tokens: int = typer.Option(DEFAULT_MAX_TOKENS, "--max-tokens", "-n", help="Tokens per reply at most."),
    temp: Optional[float] = typer.Option(None, "--temp", help="Temperature; 0 = greedy (default: the "
                                         "checkpoint's generation_config.json)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling mass."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample among the K most likely tokens (0 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed (default: random)."),
    ram: Optional[float] = typer.Option(None, "--ram", metavar="GB", help="RAM budget in GiB."),
    cap: Optional[int] = typer.Option(None, "--cap", help="Expert cache slots per MoE layer (default: from --ram)."),
    prefetch: Optional[bool] = PrefetchOption,
    lookahead: Optional[bool] = LookaheadOption,
    io_threads: Optional[int] = IoThreadsOption,
    use_tune_profile: bool = TuneProfileOption,
    preload: Optional[bool] = PreloadOption,
    pin: Optional[bool] = PinOption,
    io: str = IoOption,
    experts_k: Optional[int] = ExpertsKOption,
    experts_top_p: Optional[float] = ExpertsTopPOption,
    ctx: Optional[int] = typer.Option(None, "--ctx", help="Context length in tokens (default 4096, or down to "
                                      "1024 when KV would take the expert cache's RAM; a warning says so)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Compute threads (default: all cores)."),
    think: Optional[bool] = typer.Option(None, "--think/--no-think", help="Pass enable_thinking to a chat template "
                                         "that has the switch (Qwen3); default: the template's own."),
    resume: bool = typer.Option(False, "--resume", help="Continue this model's last conversation (kept after each "
                                "turn); its saved KV is loaded, so only the new message is prefilled."),
    kv: Optional[bool] = KvOption,
    kv_dir: Optional[str] = KvDirOption,
    kv_disk_budget: str = KvBudgetOption,
) -> None:
    """Chat with a model: the engine loads once; each turn reuses the cached prefix of the conversation (with
    --attach: the same, driving a running coli serve)."""
    from .. import launch
    from ..cachedir import cache_root
    from ..chat_input import LineSource
    from ..chat_session import ChatSession
    from ..disk_bound import disk_bound_for
    from .. import hooks
    from ..prompt import choose_sampling, thinking_kwargs

    if max_tokens < 1:
        raise ColibriError(f"--max-tokens {max_tokens}: must be at least 1")
    if url is not None and not attach:
        raise UsageError(f"unexpected argument {url!r}", "to drive a running server, pass --attach URL")
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    source = LineSource(interactive, cache_root() / "chat_history" if interactive else None)
    if attach:
        from ..attach import probe, server_url

        address = server_url(url)
        if probe(address) is not None:
            given = {"temperature": temp, "top_p": top_p, "top_k": top_k, "seed": seed}
            local_only = [flag for flag, value in (("--ram", ram), ("--cap", cap), ("--ctx", ctx),
                                                   ("--threads", threads), ("--prefetch", prefetch), ("--pin", pin),
                                                   ("--preload", preload), ("--experts-k", experts_k),
                                                   ("--experts-top-p", experts_top_p)) if value is not None]
            if local_only:
                print_warning(f"{', '.join(local_only)}: the server's engine is already set up; ignored with --attach")
            attached(address, api_key, {k: v for k, v in given.items() if v is not None}, max_tokens, system,
                     {} if think is None else {"enable_thinking": think}, source, interactive)
            return
        try:
            resolved = resolve_model(model, family)
        except ColibriError as exc:
            raise UsageError(f"--attach: no colibri server answers at {address}, and no model to run here "
                             f"({exc.one_line()})",
                             "start one with coli serve or coli start, or pass --model") from None
        print_warning(f"no colibri server answers at {address}: running an engine here")
    else:
        resolved = resolve_model(model, family)
    tok = hooks.load_tokenizer(resolved)
    template_kwargs = thinking_kwargs(tok, think)
    sampling = choose_sampling(resolved.path, temp, top_p, top_k, seed)
    spec = launch.prepare(resolved, ram_gib=ram, ctx=ctx, trade_ctx=True, cap=cap, threads=threads,
                          streaming=streaming_options(prefetch, pin, io, experts_k, experts_top_p, lookahead,
                                                      preload),
                          tune=tune_profile(use_tune_profile, resolved.path), io_threads=io_threads)
    kv_opts = kv_options(kv, kv_dir, kv_disk_budget, default=True)
    store = launch.kv_store_for(spec, kv_opts)
    transcript = store.directory / TRANSCRIPT
    with launch.start(spec, kv=kv_opts, store=store) as engine:
        session = ChatSession(engine, tok, sampling, max_tokens, spec.ctx, system, template_kwargs,
                              max_ctx=launch.max_ctx(spec.facts), parser=lambda: hooks.parse_output(resolved),
                              transcript=transcript)
        if session.notice:
            print_warning(session.notice)
        if resume:
            resume_session(session, transcript, interactive)
        if interactive:
            sys.stderr.write(f"{resolved.path.name} ({resolved.family}) ready. {HELP_TEXT}\n")
        disk = disk_bound_for(spec)

        def local_turn(text: str):
            reply = session.turn(text, _write)
            reply.stats.update(disk.share(reply.stats))   # the stats line's share of the disk bound
            return reply

        converse(session, source, interactive, engine.stats, lambda _exc: not engine.alive, local_turn)


TRANSCRIPT = "chat.json"    # the model's last `coli chat` conversation, in its kv directory


def resume_session(session, transcript, interactive: bool) -> None:
    """``--resume``: the kept conversation becomes the history (a warning when there is none)."""
    from ..chat_session import load_transcript

    messages = load_transcript(transcript)
    if messages is None:
        print_warning(f"--resume: no conversation kept in {transcript}; starting a new one")
        return
    session.messages = messages
    if interactive:
        turns = sum(1 for m in messages if m["role"] == "user")
        sys.stderr.write(f"resumed a conversation of {turns} message(s)\n")


def attached(address: str, api_key: str | None, sampling: dict[str, Any], max_tokens: int, system: str | None,
             template_kwargs: dict[str, Any], source, interactive: bool) -> None:
    """``coli chat --attach``: the same conversation loop over a running server."""
    from ..attach import AttachedSession, ServerReplyError

    session = AttachedSession(address, api_key, sampling, max_tokens, system, template_kwargs)
    writer = ReasoningApart(interactive)

    def turn(text: str):
        try:
            return session.turn(text, writer.answer, writer.think)
        finally:
            writer.end()

    try:
        if interactive:
            sys.stderr.write(f"attached to {session.model or 'the server'} at {address}. {HELP_TEXT}\n")
        converse(session, source, interactive, session.engine_stats,
                 lambda exc: not isinstance(exc, ServerReplyError), turn)
    finally:
        session.close()


def converse(session, source, interactive: bool, engine_stats: Callable[[], dict[str, Any] | None],
             fatal: Callable[[ColibriError], bool], turn: Callable[[str], Any]) -> None:
    """Read messages and commands until /exit or the end of input; ``turn`` answers one message (streaming it),
    ``fatal`` says whether an error ends the chat (the engine or the server is gone) or only the turn."""
    from ..chat_input import read_message
    from ..streaming import stats_line

    try:
        while True:
            try:
                text = read_message(source.read)
            except KeyboardInterrupt:
                _write("\n")
                continue
            except EOFError:
                if interactive:
                    _write("\n")
                break
            command = text.strip()
            if not command:
                continue
            if command in ("/exit", "/quit"):
                break
            if command == "/reset":
                session.reset()
                _write("(conversation reset)\n")
                continue
            if command == "/stats":
                _write(stats_report(session, engine_stats()) + "\n")
                continue
            if command in ("/help", "/?"):
                _write(HELP_TEXT + "\n")
                continue
            if COMMAND_WORD.fullmatch(command.split()[0]):
                print_error(f"unknown command {command.split()[0]} (commands: {COMMANDS}; "
                            "start with // to send a message that begins with /)")
                continue
            if command.startswith("//"):
                text = text.lstrip()[1:]
            try:
                reply = turn(text)
            except ColibriError as exc:
                if fatal(exc):
                    raise
                print_error(exc.one_line())
                continue
            _write("\n")
            if reply.interrupted:
                _write("(reply stopped)\n")
            if interactive:
                sys.stderr.write(f"\x1b[2m{stats_line(reply.stats, reply.accept)}\x1b[0m\n")
    finally:
        source.save_history()
