"""``coli demo``: see expert streaming work on this machine, with nothing to download."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from ..console import print_pairs
from ..errors import UsageError
from ._app import app

DEMO_CTX = 1024
GIB = 1024 ** 3


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _spinner(message: str):
    from contextlib import nullcontext

    if not sys.stderr.isatty():
        sys.stderr.write(message + "\n")
        return nullcontext()
    from rich.console import Console

    return Console(stderr=True).status(message, spinner="dots")


@app.command("demo")
def demo_command(
    ram: Optional[float] = typer.Option(None, "--ram", metavar="GB", help="RAM budget in GiB (default: the "
                                        "budget whose expert cache holds a quarter of the experts)."),
    tokens: int = typer.Option(48, "--tokens", "-n", help="Tokens to generate."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Prompt text (default: the demo model's own, "
                                         "e.g. 'def fibonacci(n):')."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Compute threads (default: all cores)."),
    synthetic: bool = typer.Option(False, "--synthetic", help="Run a bigger random-weight model instead of the "
                                   "bundled trained one (written once to the cache; its text is noise)."),
) -> None:
    """Run a small bundled MoE under a RAM budget smaller than its experts, streaming experts from disk, and show
    the numbers (budget, hit rate, bytes read). Nothing to download; --synthetic runs a bigger random model."""
    from .. import launch
    from ..console import human_bytes
    from ..demo import budget_for_cache_fraction, find_demo_model
    from .. import hooks
    from ..inventory import load_facts
    from ..model import resolve_model
    from ..prompt import choose_sampling
    from ..streaming import stats_line, stream_reply

    if tokens < 1:
        raise UsageError(f"--tokens {tokens}: must be at least 1", "for example --tokens 48")
    if synthetic:
        with _spinner("preparing the synthetic demo checkpoint (written once, random weights)"):
            offered = find_demo_model(synthetic=True)
    else:
        offered = find_demo_model(synthetic=False)
    path = offered.path
    prompt = offered.prompt if prompt is None else prompt
    model = resolve_model(path)
    facts = load_facts(model)
    ram_gib = ram if ram is not None else budget_for_cache_fraction(facts, DEMO_CTX, offered.cache_fraction) / GIB
    launch_spec = launch.prepare(model, ram_gib=ram_gib, ctx=DEMO_CTX,
                                 threads=threads, facts=facts)
    plan = launch_spec.plan
    tok = hooks.load_tokenizer(model)
    on_disk = facts.tensors.total_bytes
    experts_total = plan.experts_per_layer * plan.moe_layers
    routed_total = plan.expert_bytes * experts_total

    if offered.is_random:
        _write(f"colibri demo: {offered.description}. The text it writes is noise;\n"
               "what is real is that the model is bigger than the RAM budget and runs anyway, streaming experts.\n\n")
    else:
        _write(f"colibri demo: {offered.description}.\n"
               "Its routed experts do not all fit the RAM budget below: each token's experts are streamed from "
               "disk on a cache miss.\n\n")
    print_pairs([
        ("checkpoint", f"{path} ({human_bytes(on_disk)} of weights, {experts_total} routed experts of "
                       f"{human_bytes(plan.expert_bytes)})"),
        ("RAM budget", f"{human_bytes(plan.ram_bytes)}" + (" — smaller than the model" if plan.ram_bytes < on_disk
                                                           else "")),
        ("resident", f"dense {human_bytes(plan.dense_bytes)} + KV {human_bytes(plan.kv_bytes)} + "
                     f"reserve {human_bytes(plan.reserve_bytes)}"),
        ("expert cache", f"{plan.cache_slots_per_layer} of {plan.experts_per_layer} experts per layer "
                         f"({100 * plan.cache_slots_per_layer / max(1, plan.experts_per_layer):.0f}%, "
                         f"{human_bytes(plan.cache_bytes)} of {human_bytes(routed_total)} of experts); "
                         "every miss is read from disk"),
    ])
    _write("\n")
    sampling = choose_sampling(path, None, None, None, seed)
    ids = tok.encode(prompt)
    # A random model emits its end-of-text token by chance and the point there is the numbers: no stop tokens.
    stop = () if offered.is_random else tuple(tok.stop_ids)
    with launch.start(launch_spec) as engine:
        _write(prompt)
        reply = stream_reply(engine, tok, ids, write=_write, max_tokens=min(tokens, DEMO_CTX - len(ids)),
                             stop=stop, **sampling.as_request())
    s = reply.stats
    _write("\n\n")
    rows = [
        ("stats", stats_line(s, reply.accept)),
        ("streamed", f"{human_bytes(s.get('bytes_read', 0))} of experts read from disk in {s.get('reads', 0)} reads "
                     f"(hit rate {100 * float(s.get('hit_rate', 0)):.1f}%: {s.get('expert_hits', 0)} hits, "
                     f"{s.get('expert_misses', 0)} misses)"),
        ("engine RSS", f"{human_bytes(s.get('rss_bytes', 0))} for a {human_bytes(on_disk)} model "
                       f"under a {human_bytes(plan.ram_bytes)} budget"),
    ]
    if offered.is_random:
        rows.append(("reminder", "random weights: the text above is noise by construction"))
    print_pairs(rows)
    if reply.interrupted:
        raise SystemExit(130)  # 128 + SIGINT, as a shell reports an interrupted command
