"""A ``coli serve`` app whose engine is teacher-forced (the protocol's ``forced`` ids) to write a given text, for
tests of how replies in each family's real syntax reach the clients. The engine is the protocol fake engine, or
(``real=True``) the family's own built C engine over a tiny random checkpoint: both report forced tokens as
token events, so the server cannot tell a forced reply from a sampled one."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from colibri.engine import Engine
from colibri.records import ResolvedModel
from colibri.server.codec import TokenizerCodec

sys.path.insert(0, str(Path(__file__).parent))
from family_syntax import FAMILIES, TOOLS
from serve_harness import RunningServer, fake_argv, start_server

USER = [{"role": "user", "content": "Weather in Köln for 3 days, and search 'a < b & c'?"}]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


class ForcingEngine(Engine):
    """An engine whose every generation is teacher-forced through ``script``; records the prompts it gets."""

    script: list[int] = []
    scripts: list[list[int]] = []     # when set, one per generation in turn (then ``script`` again)
    prompts: list[list[int]] = []

    def submit(self, prompt, **kwargs):
        ForcingEngine.prompts.append(list(prompt))
        script = ForcingEngine.scripts.pop(0) if ForcingEngine.scripts else ForcingEngine.script
        return super().submit(prompt, **{**kwargs, "forced": script})


@dataclass
class Forced:
    family: object          # family_syntax.Family
    server: RunningServer
    directory: Path


def forcing_server(family, directory: Path, real: bool = False) -> Forced:
    """Serve ``directory`` (the family's tokenizer and template; with ``real`` a whole tiny checkpoint)."""
    model_type = family.tiny_kind
    if real:
        from colibri import launch
        from colibri.model import resolve_model

        resolved = resolve_model(str(directory))
        spec = launch.prepare(resolved, ctx=1024, slots=1, threads=1)
        codec = TokenizerCodec(TokenizerCodec.from_model_dir(directory).tokenizer, resolved)

        def factory():
            return ForcingEngine(spec.argv, env=spec.env, ready_timeout=300)
    else:
        plain = TokenizerCodec.from_model_dir(directory)
        codec = TokenizerCodec(plain.tokenizer, ResolvedModel(directory, family.name, model_type, {}))
        argv = fake_argv(directory, 1024, 1, codec.vocab_size)

        def factory():
            return ForcingEngine(argv, ready_timeout=30)
    assert codec.tools_supported
    server = start_server(directory, ctx=1024, codec=codec, factory=factory)
    return Forced(family, server, directory)


def force(server: RunningServer, text: str) -> None:
    """Make every following generation write ``text`` and then the end-of-turn token."""
    codec = server.codec
    ForcingEngine.script = codec.encode(text, add_special_tokens=False) + [codec.stop_ids[0]]


def force_each(server: RunningServer, texts: list[str]) -> None:
    """Make the next generations write ``texts`` in turn (each then the end-of-turn token)."""
    codec = server.codec
    ForcingEngine.scripts = [codec.encode(t, add_special_tokens=False) + [codec.stop_ids[0]] for t in texts]


def template_server(name: str, tmp_path_factory) -> Forced:
    """The fake engine behind family ``name``'s test template and a tokenizer trained for its tiny kind (skipped
    when the family's package is not installed)."""
    import pytest

    from colibri.testing.tiny import train_tokenizer

    family = FAMILIES[name]
    pytest.importorskip(family.package)
    directory = tmp_path_factory.mktemp(name) / "tiny-tools"
    train_tokenizer(directory, family.tiny_kind)
    (directory / "chat_template.jinja").write_text(family.template, encoding="utf-8")
    return forcing_server(family, directory)
