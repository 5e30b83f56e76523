"""The typer application, its global options, and the one place user errors become one line and exit 1."""

from __future__ import annotations

import traceback
from typing import Any

import typer
from typer.core import TyperGroup

from .. import __version__, envvars, plugins
from ..console import print_error
from ..errors import ColibriError

DEBUG_ENV = envvars.DEBUG


class ColiGroup(TyperGroup):
    """Turns a :class:`ColibriError` from any command into ``error: <message> (<hint>)`` and exit code 1.

    Doing it here (not in ``main``) makes typer's test runner and the installed ``coli`` script behave the same.
    ``--debug`` (or ``COLIBRI_DEBUG=1``, alias ``COLI_DEBUG``) prints the traceback as well.
    """

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        # Options of ``coli`` itself (``coli --bogus``) are parsed here, before invoke: same one line, no box.
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except typer.TyperException as exc:
            # A bare ``coli`` raises a message-less usage error whose job is to show the help: leave it be.
            if not hasattr(exc, "format_message") or not exc.format_message():
                raise
            print_error(f"{exc.format_message()} (see {info_name or 'coli'} --help)")
            raise typer.Exit(getattr(exc, "exit_code", 2)) from None

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _hide_flag_types(command.get_params(ctx))
        return command

    def format_help(self, ctx: Any, formatter: Any) -> None:
        _hide_flag_types(self.get_params(ctx))
        super().format_help(ctx, formatter)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort):
            raise
        except typer.TyperException as exc:  # typer's own usage errors (bad flag value, unknown option)
            # A message-less one is a group called without its subcommand (coli bench): click shows the help.
            if not hasattr(exc, "format_message") or not exc.format_message():
                raise
            where = getattr(getattr(exc, "ctx", None), "command_path", None) or "coli"
            print_error(f"{exc.format_message()} (see {where} --help)")
            raise typer.Exit(getattr(exc, "exit_code", 2)) from None
        except ColibriError as exc:
            if _debug(ctx):
                traceback.print_exc()
            print_error(exc.one_line())
            raise typer.Exit(exc.exit_code) from None
        except Exception as exc:  # a bug in colibri or in a family plugin: still one line unless --debug
            if _debug(ctx):
                traceback.print_exc()
            first = (str(exc).splitlines() or [""])[0]
            owner = plugins.culprit(exc)
            if owner is not None:
                where = " ".join(part for part in (owner.package, owner.version) if part)
                print_error(f"family plugin {owner.entry_point!r} ({where}) failed: "
                            f"{type(exc).__name__}: {first} (a bug in {owner.package}: rerun with --debug for the "
                            f"traceback and report it to {owner.package}'s authors)")
            else:
                print_error(f"internal error: {type(exc).__name__}: {first} "
                            "(rerun with --debug for the traceback and report it)")
            raise typer.Exit(1) from None


def _hide_flag_types(params: list[Any]) -> None:
    """Typer's help gives every option a type column; for a flag (``--json``, ``--prefetch/--no-prefetch``) that
    reads ``<bool>``, as if it took a value. An instance attribute shadows the method for flags only."""
    for param in params:
        if getattr(param, "is_flag", False):
            param.display_type_rich = _no_type


def _no_type(ctx: Any = None) -> None:
    return None


def _debug(ctx: Any) -> bool:
    return bool(ctx.params.get("debug")) or (envvars.getenv(DEBUG_ENV) or "0") not in ("", "0")


app = typer.Typer(
    cls=ColiGroup,
    name="coli",
    help="colibri: run Mixture-of-Experts models larger than RAM by streaming routed experts from disk.",
    no_args_is_help=True,
    add_completion=True,     # coli --install-completion / --show-completion [bash|zsh|fish|powershell]
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"coli (colibri-core) {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool | None = typer.Option(None, "--version", callback=_print_version, is_eager=True,
                                           help="Print the version and exit."),
    debug: bool = typer.Option(False, "--debug", help=f"Show tracebacks for errors (also {DEBUG_ENV}=1)."),
) -> None:
    """colibri: tiny engine, immense model."""


def main() -> None:
    """Entry point of the ``coli`` script."""
    app(prog_name="coli")
