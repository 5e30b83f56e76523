"""Rendering a checkpoint's own chat template, byte for byte as transformers' ``apply_chat_template`` does.

Byte identity matters beyond looks: a conversation re-rendered each turn must reproduce the previous turn's text
exactly, or the engine's prefix reuse breaks and every turn re-prefills the whole history.

Where the template comes from (transformers' order): ``chat_template.jinja`` plus any
``additional_chat_templates/*.jinja`` files win over the ``chat_template`` entry of ``tokenizer_config.json``
(a string, or a list of ``{"name", "template"}``); a processor's ``chat_template.json`` is the last resort.

The environment matches transformers' (``utils/chat_template_utils.py``): an immutable sandbox with
``trim_blocks`` and ``lstrip_blocks``, the loop-controls extension, a ``{% generation %}`` block that renders its
body, ``tojson`` without HTML escaping (``ensure_ascii=False``), ``raise_exception``, ``strftime_now``, and a
``namespace`` that refuses underscore-prefixed attributes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

from .errors import ConfigError, UsageError

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"

# The names transformers passes to every template (only those that are set).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@dataclass(frozen=True)
class ChatTemplate:
    """A template's source and where it came from (shown when it fails to render)."""

    source: str
    origin: str


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text", "restore the file from the original checkpoint") from None


def read_json_file(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})",
                          "restore the file from the original checkpoint") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level is not a JSON object", "restore the file from the original checkpoint")
    return data


def available_templates(model_dir: Path, tokenizer_config: Mapping[str, Any] | None = None) -> dict[str, ChatTemplate]:
    """Every named template the checkpoint ships (``default`` is the unnamed one)."""
    found: dict[str, ChatTemplate] = {}
    main_file = model_dir / TEMPLATE_FILE
    if main_file.is_file():
        found["default"] = ChatTemplate(_read_text(main_file), str(main_file))
    extra_dir = model_dir / TEMPLATE_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            found[path.name.removesuffix(".jinja")] = ChatTemplate(_read_text(path), str(path))
    if found:
        return found
    config_path = model_dir / TOKENIZER_CONFIG
    config = tokenizer_config if tokenizer_config is not None else read_json_file(config_path)
    entry = (config or {}).get("chat_template")
    origin = f"{config_path} (chat_template)"
    if isinstance(entry, str):
        return {"default": ChatTemplate(entry, origin)}
    if isinstance(entry, list):
        for item in entry:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise ConfigError(f"{config_path}: chat_template list entries need 'name' and 'template' strings",
                                  "restore tokenizer_config.json from the original checkpoint")
            found[item["name"]] = ChatTemplate(item["template"], f"{origin}[{item['name']}]")
        return found
    if entry is not None:
        raise ConfigError(f"{config_path}: chat_template is neither a string nor a list of named templates",
                          "restore tokenizer_config.json from the original checkpoint")
    processor = read_json_file(model_dir / PROCESSOR_TEMPLATE_FILE)
    if processor and isinstance(processor.get("chat_template"), str):
        return {"default": ChatTemplate(processor["chat_template"], str(model_dir / PROCESSOR_TEMPLATE_FILE))}
    return {}


def select_template(templates: Mapping[str, ChatTemplate], name: str | None = None,
                    with_tools: bool = False) -> ChatTemplate | None:
    """The template to use: ``name`` if given, ``tool_use`` when tools are passed and it exists, else ``default``."""
    if not templates:
        return None
    if name is not None:
        if name not in templates:
            raise UsageError(f"chat template {name!r} not found",
                             f"this checkpoint has: {', '.join(sorted(templates))}")
        return templates[name]
    if with_tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise ConfigError(f"the checkpoint has several chat templates ({', '.join(sorted(templates))}) and no default",
                      "name one explicitly")


# ---- the environment --------------------------------------------------------------------------------------------

def _build_environment():
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; here it just renders."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

        def _render_body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson HTML-escapes <, >, & and ' — wrong for prompts.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class DictFactory:
        """``dict(...)`` inside a template, without exposing the ``dict`` type's attributes to the sandbox."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class GuardedNamespace(jinja2.utils.Namespace):
        """A namespace that refuses underscore-prefixed attribute names (a path to interpreter internals)."""

        def __init__(*args, **kwargs):
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for key in attrs:
                GuardedNamespace._refuse_private(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key, value):
            GuardedNamespace._refuse_private(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _refuse_private(key):
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {key!r} is not allowed in a chat template")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=DictFactory(),
                       namespace=GuardedNamespace)
    return env


@lru_cache(maxsize=16)
def _compile(source: str):
    return _build_environment().from_string(source)


def _plain(value: Any) -> Any:
    """Template inputs as plain JSON-like data (the sandbox must never see arbitrary objects' methods)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Drop None-valued keys (templates handle a missing key, not a None) and fill every reasoning alias."""
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise UsageError(f"chat message {message!r} is not a mapping", "pass {'role': ..., 'content': ...}")
        msg = {k: v for k, v in _plain(message).items() if v is not None}
        reasoning = next((msg[k] for k in REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def render(template: ChatTemplate, messages: Sequence[Mapping[str, Any]], *,
           special_tokens: Mapping[str, str] | None = None, add_generation_prompt: bool = True,
           tools: Sequence[Mapping[str, Any]] | None = None, documents: Sequence[Mapping[str, Any]] | None = None,
           **kwargs: Any) -> str:
    """The prompt text for ``messages`` (extra ``kwargs`` such as ``enable_thinking`` reach the template)."""
    import jinja2

    if not messages:
        raise UsageError("cannot render an empty conversation", "pass at least one message")
    variables = {**(special_tokens or {}), **kwargs}
    try:
        compiled = _compile(template.source)
        return compiled.render(messages=normalize_messages(messages), tools=_plain(tools),
                               documents=_plain(documents), add_generation_prompt=add_generation_prompt,
                               **_plain(variables))
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ConfigError(f"{template.origin}: chat template does not parse (line {exc.lineno}: {exc.message})",
                          "restore the template from the original checkpoint") from None
    except jinja2.exceptions.TemplateError as exc:
        raise UsageError(f"chat template refused the conversation: {exc}", f"template: {template.origin}") from None
