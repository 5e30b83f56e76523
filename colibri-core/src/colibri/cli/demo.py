"""``coli demo``: see expert streaming work on this machine, with nothing to download."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from ..console import print_pairs
from ..errors import EngineError, UsageError
from ._app import app

DEMO_PROMPT = "def fibonacci(n):"
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
    prompt: str = typer.Option(DEMO_PROMPT, "--prompt", help="Prompt text (the model is random: any will do)."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Compute threads (default: all cores)."),
) -> None:
    """Build (once) a synthetic OLMoE-architecture model bigger than a small RAM budget and run it, streaming
    experts from disk. The weights are random, so the text is noise: the point is the mechanics and the numbers."""
    from .. import launch, plugins
    from ..console import human_bytes
    from ..demo import DemoSpec, budget_for_cache_fraction, ensure_checkpoint, is_built
    from ..inventory import family_answer, load_facts
    from ..model import resolve_model
    from ..prompt import choose_sampling
    from ..streaming import stats_line, stream_reply

    if tokens < 1:
        raise UsageError(f"--tokens {tokens}: must be at least 1", "for example --tokens 48")
    olmoe = plugins.families().get("olmoe")
    if olmoe is None or olmoe.error:
        why = f" ({olmoe.error})" if olmoe is not None else ""
        raise EngineError(f"coli demo runs the OLMoE engine, and the olmoe family is not available{why}",
                          "pip install colibri-olmoe (or ./colibri-olmoe from a checkout)")
    spec = DemoSpec()
    if is_built(spec):
        path, _ = ensure_checkpoint(spec)
    else:
        with _spinner(f"writing the synthetic demo checkpoint once (~{spec.total_bytes / 1e6:.0f} MB, "
                      "random weights)"):
            path, _ = ensure_checkpoint(spec)
    model = resolve_model(path, family="olmoe")
    facts = load_facts(model)
    ram_bytes = budget_for_cache_fraction(facts, DEMO_CTX) if ram is None else None
    launch_spec = launch.prepare(model, ram_gib=ram if ram is not None else ram_bytes / GIB, ctx=DEMO_CTX,
                                 threads=threads, facts=facts)
    plan = launch_spec.plan
    tok = family_answer(model, "load_tokenizer")
    on_disk = facts.tensors.total_bytes
    experts_total = plan.experts_per_layer * plan.moe_layers

    _write("colibri demo: a synthetic OLMoE-architecture model with RANDOM weights. The text it writes is noise;\n"
           "what is real is that the model is bigger than the RAM budget and runs anyway, streaming experts.\n\n")
    print_pairs([
        ("checkpoint", f"{path} ({human_bytes(on_disk)} of weights, {experts_total} routed experts of "
                       f"{human_bytes(plan.expert_bytes)})"),
        ("RAM budget", f"{human_bytes(plan.ram_bytes)}" + (" — smaller than the model" if plan.ram_bytes < on_disk
                                                           else "")),
        ("resident", f"dense {human_bytes(plan.dense_bytes)} + KV {human_bytes(plan.kv_bytes)} + "
                     f"reserve {human_bytes(plan.reserve_bytes)}"),
        ("expert cache", f"{plan.cache_slots_per_layer} of {plan.experts_per_layer} experts per layer "
                         f"({100 * plan.cache_slots_per_layer / max(1, plan.experts_per_layer):.0f}%, "
                         f"{human_bytes(plan.cache_bytes)}); every miss is read from disk"),
    ])
    _write("\n")
    sampling = choose_sampling(path, None, None, None, seed)
    ids = tok.encode(prompt)
    with launch.start(launch_spec) as engine:
        _write(prompt)
        # No stop tokens: a random model emits its end-of-text token by chance, and the demo is about the numbers.
        reply = stream_reply(engine, tok, ids, write=_write, max_tokens=min(tokens, DEMO_CTX - len(ids)),
                             **sampling.as_request())
    s = reply.stats
    _write("\n\n")
    print_pairs([
        ("stats", stats_line(s, reply.accept)),
        ("streamed", f"{human_bytes(s.get('bytes_read', 0))} of experts read from disk in {s.get('reads', 0)} reads "
                     f"(hit rate {100 * float(s.get('hit_rate', 0)):.1f}%: {s.get('expert_hits', 0)} hits, "
                     f"{s.get('expert_misses', 0)} misses)"),
        ("engine RSS", f"{human_bytes(s.get('rss_bytes', 0))} for a {human_bytes(on_disk)} model "
                       f"under a {human_bytes(plan.ram_bytes)} budget"),
        ("reminder", "random weights: the text above is noise by construction"),
    ])
    if reply.interrupted:
        raise SystemExit(130)  # 128 + SIGINT, as a shell reports an interrupted command
