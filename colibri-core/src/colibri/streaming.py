"""Streaming one reply from an engine as text, with Ctrl-C meaning "stop this reply", and the stats line."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .detok import IncrementalDetokenizer
from .engine import Engine
from .tokenizer import TextTokenizer

DRAIN_TIMEOUT_S = 60.0


@dataclass
class Reply:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    accept: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    interrupted: bool = False


def stream_reply(engine: Engine, tok: TextTokenizer, prompt_ids: Sequence[int], *, write: Callable[[str], None],
                 slot: int = 0, max_tokens: int = 256, stop: Sequence[int] = (), constraint: Any = None,
                 **sampling: Any) -> Reply:
    """Submit, write text as it becomes stable, return the reply. Ctrl-C cancels the request and still waits for
    the engine's ``done`` (so the slot is free and the stats are real) instead of killing the program.
    ``constraint``: a :class:`colibri.constraints.Constraint` whose mask every sampling step obeys."""
    detok = IncrementalDetokenizer(lambda ids: tok.decode(ids, skip_special_tokens=True), skip_ids=stop)
    if constraint is not None:
        sampling["constrained"] = True
    req = engine.submit(prompt_ids, slot=slot, max_tokens=max_tokens, stop=stop, **sampling)
    if constraint is not None:
        engine.mask(req, constraint.mask())
    reply = Reply()
    seen = 0
    while not req.finished:
        try:
            # After a cancel the engine still answers promptly; the timeout only guards against a lost event.
            for _ in req.events(timeout=DRAIN_TIMEOUT_S if reply.interrupted else None):
                while seen < len(req.tokens):
                    if constraint is not None:
                        constraint.follow(engine, req, req.tokens[seen], stop)
                    piece = detok.push(req.tokens[seen])
                    seen += 1
                    if piece and not reply.interrupted:
                        write(piece)
        except KeyboardInterrupt:
            if not reply.interrupted:
                reply.interrupted = True
                req.cancel()
    rest = detok.flush()
    if rest and not reply.interrupted:
        write(rest)
    reply.tokens, reply.text, reply.accept, reply.stats = list(req.tokens), detok.text, req.accept, req.stats
    return reply


def _rate(value: Any) -> str:
    return f"{float(value):.1f} tok/s" if isinstance(value, (int, float)) else "? tok/s"


def stats_line(stats: dict[str, Any], accept: dict[str, Any] | None = None) -> str:
    """One line: prefill and decode speed, expert hit rate, bytes read from disk, engine RSS, and decode speed as a
    share of the disk bound when ``stats`` carries it (colibri/disk_bound.py)."""
    from .console import human_bytes
    from .disk_bound import share_text

    prefilled = stats.get("prefilled_tokens", stats.get("prompt_tokens", 0))
    reused = (accept or {}).get("reused_tokens", max(0, stats.get("prompt_tokens", 0) - prefilled))
    reuse = f" (+{reused} reused)" if reused else ""
    parts = [f"prefill {prefilled} tok{reuse} @ {_rate(stats.get('prefill_tps'))}",
             f"decode {stats.get('generated_tokens', 0)} tok @ {_rate(stats.get('decode_tps'))}"]
    if "hit_rate" in stats:
        parts.append(f"expert hit rate {100 * float(stats['hit_rate']):.1f}%")
    if "bytes_read" in stats:
        parts.append(f"read {human_bytes(stats['bytes_read'])}")
    if "rss_bytes" in stats:
        parts.append(f"RSS {human_bytes(stats['rss_bytes'])}")
    share = share_text(stats)
    if share:
        parts.append(share)
    parts.extend(streaming_parts(stats))
    if stats.get("reason") == "cancelled":
        parts.append("cancelled")
    return " · ".join(parts)


def policy_text(stats: dict[str, Any]) -> str:
    """"policy duel (6 pinned, LRU leads 1 layer)", "policy lru", ...; "pin on (6 pinned)" from an engine that
    names no policy."""
    pinned = f"{stats.get('pinned_experts', 0)} pinned"
    policy = stats.get("policy")
    if not isinstance(policy, str):
        return "pin " + (f"on ({pinned})" if stats.get("pin") else "off")
    details = [pinned] if stats.get("pin") else []
    if isinstance(stats.get("duel_lru_layers"), int):
        layers = stats["duel_lru_layers"]
        details.append(f"LRU leads {layers} layer{'' if layers == 1 else 's'}")
    return f"policy {policy}" + (f" ({', '.join(details)})" if details else "")


def streaming_parts(stats: dict[str, Any]) -> list[str]:
    """The streaming switches in effect, where the time went, and any lossy routing (always shown)."""
    parts = []
    if "io" in stats:
        switches = [f"io {stats['io']}", "prefetch " + ("on" if stats.get("prefetch") else "off")
                    + (" + lookahead" if stats.get("lookahead") else ""),
                    policy_text(stats)]
        if stats.get("prefetch_issued"):
            switches.append(f"prefetched {stats.get('prefetch_used', 0)}/{stats['prefetch_issued']} used")
        if isinstance(stats.get("lookahead_recall"), (int, float)):
            switches.append(f"lookahead recall {100 * float(stats['lookahead_recall']):.0f}%")
        parts.append(", ".join(switches))
    phases = [(name, stats.get(key)) for name, key in (("I/O wait", "io_wait_s"), ("experts", "expert_s"),
                                                        ("attention", "attention_s"), ("other", "other_s"))]
    seconds = [(name, float(v)) for name, v in phases if isinstance(v, (int, float))]
    if len(seconds) == len(phases) and sum(v for _, v in seconds) > 0:
        parts.append("time: " + ", ".join(f"{name} {v:.2f}s" for name, v in seconds))
    if stats.get("lossy"):
        parts.append(f"LOSSY routing: {stats['lossy']}")
    return parts
