"""``coli run``: one prompt in, streamed text out, then one line of stats."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from ..console import emit_json, print_warning
from ..errors import UsageError
from ..model import resolve_model
from ._app import app
from .options import (FamilyOption, JsonOption, ModelOption, ExpertsKOption, ExpertsTopPOption,
                      ExpertWorkersOption, IoOption, IoThreadsOption, KvBudgetOption, KvDirOption, KvOption,
                      LookaheadOption, PartitionOption, PinOption, PrefetchOption, PreloadOption, RayAddressOption,
                      TuneProfileOption, kv_options, streaming_options, tune_profile)

DEFAULT_MAX_TOKENS = 256


class _Output:
    """stdout as the reply streams, remembering whether the last byte was a newline so the output always ends
    with one (as a shell expects), whatever the model's last token was."""

    def __init__(self) -> None:
        self.at_line_start = True

    def write(self, text: str) -> None:
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.at_line_start = text.endswith("\n")

    def end_line(self) -> None:
        if not self.at_line_start:
            self.write("\n")


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """PROMPT, else --prompt-file (``-``: stdin), else stdin when it is not a terminal (``echo hi | coli run``)."""
    from ..prompt import read_prompt_file

    if prompt is not None and prompt_file is not None:
        raise UsageError("both a PROMPT and --prompt-file given", "pass one of them")
    if prompt is None and prompt_file is None and not sys.stdin.isatty():
        prompt_file = Path("-")
    if prompt_file is not None:
        prompt = read_prompt_file(prompt_file)
        if not prompt.strip() and str(prompt_file) == "-":
            prompt = None
    if prompt is None:
        raise UsageError("no prompt given", 'pass a PROMPT, e.g. coli run "Hello" --model DIR, --prompt-file FILE, '
                                            "or pipe it on stdin")
    return prompt


def _run_other_task(resolved: Any, task: str, prompt: str, options: dict[str, Any]) -> None:
    """Hand a non-text model to its family's run handler (exit with its code)."""
    from .. import hooks

    code = hooks.run_handler(resolved, prompt, options)
    if code is None:
        raise UsageError(f"{resolved.path}: the {resolved.family} family runs no {task} model with coli run",
                         "coli families lists what each family runs")
    if code:
        raise SystemExit(code)


def _generate(launch: Any, spec: Any, tok: Any, built: Any, grammar: Any, budget: int, sampling: Any, view: Any,
              as_json: bool, kv: Any) -> Any:
    from ..constraints import ConstraintCompiler
    from ..streaming import stream_reply

    with launch.start(spec, kv=kv) as engine:
        constraint = None
        if grammar is not None:
            constraint = ConstraintCompiler(tok.backend.to_str(), int(engine.ready.get("vocab") or tok.vocab_size),
                                            tok.stop_ids).start(grammar)
        reply = stream_reply(engine, tok, built.ids, write=(lambda _t: None) if as_json else view.feed,
                             max_tokens=budget, stop=tok.stop_ids, constraint=constraint, **sampling.as_request())
    return reply


def run_command(
    prompt: Optional[str] = typer.Argument(None, help="The prompt (or use --prompt-file, or pipe it on stdin)."),
    model: Optional[str] = ModelOption,
    family: Optional[str] = FamilyOption,
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", "-n",
                                             help=f"Tokens to generate at most [default: {DEFAULT_MAX_TOKENS}]."),
    temp: Optional[float] = typer.Option(None, "--temp", help="Temperature; 0 = greedy. Default: the checkpoint's "
                                         "generation_config.json, greedy if it does not ask for sampling."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling mass."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample among the K most likely tokens (0 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed (default: random)."),
    ram: Optional[float] = typer.Option(None, "--ram", metavar="GB",
                                        help="RAM budget in GiB (default: what the machine has available)."),
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
    ctx: Optional[int] = typer.Option(None, "--ctx", help="Context length in tokens (default: the prompt + "
                                      "--max-tokens, at most 4096 or the model's maximum)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Compute threads (default: all cores)."),
    chat: Optional[bool] = typer.Option(None, "--chat/--raw", help="Wrap the prompt in the checkpoint's chat "
                                        "template (default when it has one) or send it as plain text."),
    think: Optional[bool] = typer.Option(None, "--think/--no-think", help="Pass enable_thinking to a chat template "
                                         "that has the switch (Qwen3); default: the template's own."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", metavar="FILE", help="Read the prompt from "
                                               "a UTF-8 file (- for stdin)."),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", metavar="FILE", help="Constrain the reply to "
                                               "JSON valid against this JSON schema file (needs llguidance)."),
    as_json: bool = JsonOption,
    kv: Optional[bool] = KvOption,
    kv_dir: Optional[str] = KvDirOption,
    kv_disk_budget: str = KvBudgetOption,
    expert_workers: Optional[int] = ExpertWorkersOption,
    partition: str = PartitionOption,
    address: Optional[str] = RayAddressOption,
    **family_options: Any,
) -> None:
    """Generate text for one prompt, streaming it, then print speed, expert hit rate, bytes read and RSS.

    For a model whose family runs another task (a text-to-image pipeline), the family's run handler takes the
    prompt instead, with the flags it adds (listed below, from every installed family)."""
    from .. import launch
    from .. import hooks
    from ..prompt import build_prompt, choose_sampling, clamp_max_tokens, thinking_kwargs
    from ..reasoning_view import ReasoningView
    from ..constraints import schema_file_grammar
    from ..disk_bound import disk_bound_for
    from ..streaming import stats_line

    from ..records import TEXT_GENERATION

    prompt = _read_prompt(prompt, prompt_file)
    resolved = resolve_model(model, family)
    extra = dict(family_options)
    task = hooks.model_task(resolved)
    if task != TEXT_GENERATION:
        _run_other_task(resolved, task, prompt, {**extra, "seed": seed, "threads": threads, "ram": ram,
                                                 "json": as_json})
        return
    given = [name for name, value in extra.items() if value is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise UsageError(f"{flag}: not an option for {resolved.path.name} (a {task} model)",
                         "that flag applies to the families that offer it (e.g. text-to-image pipelines)")
    tok = hooks.load_tokenizer(resolved)
    if think is not None and chat is False:
        raise UsageError("--think/--no-think with --raw: thinking is a chat-template switch", "drop one of them")
    built = build_prompt(tok, prompt, chat, thinking_kwargs(tok, think))
    if built.notice:
        print_warning(built.notice)
    sampling = choose_sampling(resolved.path, temp, top_p, top_k, seed)
    asked = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    # without --ctx the KV is sized for this prompt and budget, not the default context (ctx_choice.py)
    spec = launch.prepare(resolved, ram_gib=ram, ctx=ctx, cap=cap, threads=threads, needed=len(built.ids) + asked,
                          streaming=streaming_options(prefetch, pin, io, experts_k, experts_top_p, lookahead,
                                                      preload),
                          tune=tune_profile(use_tune_profile, resolved.path), io_threads=io_threads)
    budget, clamp_notice = clamp_max_tokens(asked, len(built.ids), spec.ctx, launch.max_ctx(spec.facts))
    if clamp_notice and max_tokens is not None:   # the default quietly fits the context
        print_warning(clamp_notice)

    grammar = schema_file_grammar(resolved, built.text, json_schema) if json_schema is not None else None
    out = _Output()
    view = ReasoningView(hooks.parse_output(resolved) if built.mode == "chat" else None, built.text, out.write)
    from ..cluster.experts import with_expert_workers

    spec, expert_cluster = with_expert_workers(spec, expert_workers, partition, address)
    try:
        reply = _generate(launch, spec, tok, built, grammar, budget, sampling, view, as_json,
                          kv_options(kv, kv_dir, kv_disk_budget, default=False))
    finally:
        if expert_cluster is not None:
            expert_cluster.stop()
    if not as_json:
        view.finish()
    reply.stats.update(disk_bound_for(spec).share(reply.stats))
    stats = {k: v for k, v in reply.stats.items() if k not in ("ev", "id")}
    if as_json:
        emit_json({"model": str(resolved.path), "family": resolved.family, "mode": built.mode,
                   "prompt_ids": built.ids, "generated_ids": reply.tokens, "text": reply.text,
                   "sampling": sampling.as_request(), "ctx": spec.ctx, "cap": spec.cap,
                   "ram_bytes": spec.plan.ram_bytes, "reused_tokens": reply.accept.get("reused_tokens", 0),
                   "kv_loaded_tokens": reply.accept.get("kv_loaded", 0),
                   "stats": stats})
    else:
        out.end_line()
        sys.stderr.write(stats_line(reply.stats, reply.accept) + "\n")
        sys.stderr.flush()
    if reply.interrupted:
        raise SystemExit(130)  # 128 + SIGINT, as a shell reports an interrupted command


def _with_family_options(fn: Any) -> Any:
    """Give ``fn`` one keyword parameter per installed family's ``run_options`` flag, so typer parses them and
    ``--help`` lists them (their values arrive in ``**family_options``)."""
    import inspect

    from .. import hooks

    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    taken = {p.name for p in params}
    for option in hooks.run_options():
        if option.name in taken or option.kind not in (str, int, float):
            continue
        taken.add(option.name)
        params.append(inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[option.kind],
                                        default=typer.Option(None, option.flag, help=option.help,
                                                             metavar=option.metavar or None)))
    fn.__signature__ = sig.replace(parameters=params)
    return fn


run_command = app.command("run")(_with_family_options(run_command))
