"""``coli doctor``: named pass/warn/fail checks of a checkpoint directory, from headers only.

Doctor never reads weight bytes: every check works on config files, the index, and the safetensors headers
(8-byte length + JSON), so it runs in milliseconds on a 700 GB checkpoint. A failed check names the file and
the tensor at fault; the CLI exits 1 when any check failed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import hooks, plugins
from .checkpoint import ShardHeader, TensorInfo, read_header, read_index
from .errors import ColibriError
from .inventory import geometry_of, logical_tensors, shard_sets_of
from .model import model_dir_from, read_config, resolve_model
from .prompt import NO_TEMPLATE_NOTICE
from .records import TEXT_GENERATION, ResolvedModel, ShardSet
from .validation import (  # noqa: F401  (Check and the deep checks are doctor's public names too)
    FAIL, PASS, WARN, Check, check_chat_template_renders, check_counts, check_dtypes, check_offsets, check_overlaps,
    check_roles, check_sizes, check_tokenizer_loads, file_checks, layout_checks, summarise,
)

LOW_DISK_BYTES = 1024 * 1024 * 1024

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "spiece.model", "vocab.txt")
TOKENIZER_PAIRS = (("vocab.json", "merges.txt"),)
TOKENIZER_DIRS = ("", "tokenizer")


# ---------------------------------------------------------------------------------------------- engine status

def engine_status(family: str, model: ResolvedModel | None = None) -> tuple[bool, str]:
    """(built, one-line status) of a family's engine, without building anything.

    Asks ``colibri.builder.engine_status(family) -> (built, binary path or None, reason)`` when the builder is
    installed, after the family's ``limits`` for the model (which may say this model has no engine); without a
    builder, ``engine_source`` tells whether an engine exists at all.
    """
    if model is not None:
        limits = hooks.limits(model)
        if limits is not None and not limits.has_engine:
            return False, f"no engine ({limits.reason_no_engine})" if limits.reason_no_engine else "no engine"
    builder: Any
    try:
        from . import builder
    except ModuleNotFoundError as exc:
        if exc.name != "colibri.builder":
            raise
        builder = None
    status_fn = getattr(builder, "engine_status", None)
    if status_fn is not None:
        built, path, reason = status_fn(family, model)
        return bool(built), (f"built: {path}" if built and path else reason)
    source = family_source(family, model)
    if source is None:
        return False, "no engine"
    return False, f"not built ({source.name}; the engine builder is not installed)"


def family_source(family: str, model: ResolvedModel | None = None):
    """The family's own ``engine_source`` answer (for ``model``, or its main engine), or None."""
    return hooks.family_engine_source(family, model)


# ---------------------------------------------------------------------------------------------- file checks

def _present(model_dir: Path, names: tuple[str, ...]) -> str | None:
    for sub in TOKENIZER_DIRS:
        base = model_dir / sub if sub else model_dir
        for name in names:
            if (base / name).is_file():
                return str(Path(sub) / name) if sub else name
    return None


def check_tokenizer(model_dir: Path, needs_tokenizer: bool) -> Check:
    found = _present(model_dir, TOKENIZER_FILES)
    if found is None:
        for sub in TOKENIZER_DIRS:
            base = model_dir / sub if sub else model_dir
            for pair in TOKENIZER_PAIRS:
                if all((base / f).is_file() for f in pair):
                    found = " + ".join(str(Path(sub) / f) if sub else f for f in pair)
        if found is None:
            tiktoken = sorted(model_dir.glob("*.tiktoken"))
            found = tiktoken[0].name if tiktoken else None
    if found:
        return Check("tokenizer", PASS, found)
    detail = f"{model_dir}: no tokenizer.json (nor tokenizer.model, vocab.json + merges.txt, *.tiktoken)"
    return Check("tokenizer", FAIL if needs_tokenizer else WARN,
                 detail + ("; copy the checkpoint's tokenizer files into the directory" if needs_tokenizer else ""))


def check_loaded_tokenizer(model: ResolvedModel) -> tuple[Check, Any]:
    """The tokenizer exactly as run/chat/serve load it (the family's ``load_tokenizer``): doctor passes what they
    can load and fails, with their error, what they cannot. Returns the check and the tokenizer (None if failed)."""
    tok, failed = _guarded("tokenizer", lambda: hooks.load_tokenizer(model))
    if failed:
        return failed, None
    source = getattr(tok, "source", None)
    size = getattr(tok, "vocab_size", None)
    detail = ", ".join(str(part) for part in (source.name if source else "loaded by the family",
                                              f"{size} tokens" if size else None) if part)
    return Check("tokenizer", PASS, detail), tok


def check_chat_template(model_dir: Path, is_language_model: bool, tok: Any = None) -> Check:
    """With the loaded tokenizer, its templates (a family may bring its own); without one, the template files."""
    if not is_language_model:
        return Check("chat template", PASS, "not needed (not a language model)")
    if tok is not None and hasattr(tok, "templates"):
        if tok.has_chat_template:
            return Check("chat template", PASS, ", ".join(t.origin for t in tok.templates.values()))
        return Check("chat template", WARN, f"{model_dir}: {NO_TEMPLATE_NOTICE}")
    for name in ("chat_template.jinja", "chat_template.json"):
        if (model_dir / name).is_file():
            return Check("chat template", PASS, name)
    tok_config = model_dir / "tokenizer_config.json"
    if tok_config.is_file():
        try:
            data = json.loads(tok_config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return Check("chat template", FAIL, f"{tok_config}: not valid JSON ({exc})")
        if isinstance(data, dict) and data.get("chat_template"):
            return Check("chat template", PASS, "tokenizer_config.json chat_template")
    return Check("chat template", WARN, f"{model_dir}: {NO_TEMPLATE_NOTICE}")


@dataclass
class ShardScan:
    """What the shard check learnt, for the deep checks to reuse."""

    headers: list[ShardHeader] = field(default_factory=list)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)   # by name (a shard set's prefix included)

    @property
    def names(self) -> set[str]:
        return set(self.tensors)


def check_shards(shard_sets: tuple[ShardSet, ...], scan: ShardScan) -> Check:
    """Every shard the index names exists and parses, holds what the index says, and is not cut short."""
    problems: list[str] = []
    seen: dict[str, Path] = {}
    files = 0
    for shard_set in shard_sets:
        weight_map: dict[str, str] | None = None
        if shard_set.index_file is not None:
            try:
                weight_map = read_index(shard_set.index_file)
            except ColibriError as exc:
                problems.append(exc.message)
        for file in shard_set.files:
            if not file.exists():
                where = f" but listed in {shard_set.index_file.name}" if shard_set.index_file else ""
                problems.append(f"{file}: shard is missing{where}")
                continue
            try:
                header = read_header(file)
            except ColibriError as exc:
                problems.append(exc.message)
                continue
            files += 1
            scan.headers.append(header)
            held = set()
            for t in header.tensors:
                name = shard_set.prefix + t.name
                held.add(t.name)
                if name in seen:
                    problems.append(f"{file}: tensor {t.name!r} also appears in {seen[name]}")
                seen[name] = file
                scan.tensors[name] = t
            past_end = [t for t in header.tensors if t.end > header.file_size]
            if past_end:
                worst = max(past_end, key=lambda t: t.end)
                problems.append(f"{file}: truncated: tensor {worst.name!r} ends at byte {worst.end} but the file "
                                f"has {header.file_size} bytes")
            if weight_map is not None and shard_set.index_file is not None:    # the map is read from the index
                listed = {n for n, f in weight_map.items() if shard_set.directory / f == file}
                for name in sorted(listed - held):
                    problems.append(f"{file}: tensor {name!r} is listed in {shard_set.index_file.name} "
                                    "but not in this shard's header")
    ok = f"{files} file(s), {len(seen)} tensors, complete"
    if not shard_sets or not any(s.files for s in shard_sets):
        problems.append("no *.safetensors weights found")
    return summarise("shards", problems, ok)


def check_disk_space(model_dir: Path) -> Check:
    from .console import human_bytes
    from .sysinfo import free_disk_bytes

    free = free_disk_bytes(model_dir)
    if free < LOW_DISK_BYTES:
        return Check("disk space", WARN, f"{model_dir}: only {human_bytes(free)} free; building an engine and "
                                         "logs need some room")
    return Check("disk space", PASS, f"{human_bytes(free)} free")


# ---------------------------------------------------------------------------------------------- driver

def check_container(model_dir: Path, model: ResolvedModel) -> tuple[Check, Any]:
    """Validate a colibri-quant stamp with the container reader, and that the family's engine runs its schemes.
    Returns the check and the container (None when native or refused)."""
    from .convert.container import open_container

    container, failed = _guarded("container", lambda: open_container(model_dir))
    if failed:
        return failed, None
    if container is None:
        return Check("container", PASS, "native checkpoint (no colibri-quant stamp)"), None
    schemes = sorted({t.scheme for t in container.tensors.values() if t.quant is not None})
    limits = hooks.limits(model)
    supported = limits.quant_schemes if limits is not None else ()
    missing = [s for s in schemes if s not in supported]
    detail = (f"colibri-quant v{container.version}, {len(container.tensors)} tensors "
              f"({', '.join(schemes) or 'no quantized tensors'})")
    if missing:
        return Check("container", FAIL, f"{detail}; the {model.family} engine does not run {', '.join(missing)} "
                                        f"(it runs {', '.join(supported) or 'no quantized weights'})",
                     fix="run the source checkpoint, or reconvert with schemes the family supports"), container
    return Check("container", PASS, detail), container


def _guarded(name: str, fn: Callable[[], Any]) -> tuple[Any, Check | None]:
    """Run a step that asks the family something; a ColibriError becomes a failed check, not an abort."""
    try:
        return fn(), None
    except ColibriError as exc:
        return None, Check(name, FAIL, exc.one_line(), (exc.message,), exc.hint or "")


def diagnose(model_option: str | Path | None, family: str | None = None, deep: bool = False) -> list[Check]:
    """Run every check in order; stops early only when a later check would have nothing to look at."""
    model_dir = model_dir_from(model_option)
    checks: list[Check] = []

    config, failed = _guarded("config", lambda: read_config(model_dir))
    if failed:
        return [failed]
    if config is None:
        marker = "model_index.json" if (model_dir / "model_index.json").is_file() else None
        checks.append(Check("config", PASS if marker else WARN,
                            f"no config.json; {marker} present" if marker else f"{model_dir}: no config.json"))
    else:
        declared = f"model_type {config['model_type']!r}" if "model_type" in config else "no model_type field"
        checks.append(Check("config", PASS, f"config.json, {declared}"))

    model, failed = _guarded("family", lambda: resolve_model(model_dir, family))
    if failed:
        return checks + [failed]
    checks.append(Check("family", PASS, f"{model.family} claims model_type {model.model_type!r}"))
    return checks + model_checks(model, deep)


def model_checks(model: ResolvedModel, deep: bool = False) -> list[Check]:
    """The checks of a resolved model (everything after config and family), e.g. for ``coli convert``."""
    model_dir = model.path
    checks: list[Check] = []
    geometry, failed = _guarded("geometry", lambda: geometry_of(model))
    if failed:
        return [failed]

    has_vocab = geometry.vocab_size > 0
    task = hooks.model_task(model)
    is_lm = has_vocab and task == TEXT_GENERATION   # only a text generator needs a chat template
    tok = None
    limits, _ = _guarded("limits", lambda: hooks.limits(model))
    if has_vocab and limits is not None and limits.has_engine:   # what run/chat/serve would load, loaded the same way
        tokenizer, tok = check_loaded_tokenizer(model)
    else:   # a model the engine commands do not run (a pipeline, an extractor): its tokenizer files are there
        tokenizer = check_tokenizer(model_dir, needs_tokenizer=is_lm)
    checks.append(tokenizer)
    if is_lm or task == TEXT_GENERATION:
        checks.append(check_chat_template(model_dir, is_lm, tok))
    else:
        checks.append(Check("chat template", PASS, f"not needed (a {task} model)"))

    shard_sets, failed = _guarded("shards", lambda: shard_sets_of(model))
    scan = ShardScan()
    checks.append(failed or check_shards(shard_sets, scan))
    container_check, container = check_container(model_dir, model)
    checks.append(container_check)
    # A container's roles are its source tensors (the scheme map), not the .qweight/.scales it stores.
    tensors = logical_tensors(container) if container is not None else scan.tensors
    # Before any layout is sized from the config: its counts against what the shards hold.
    counts = check_counts(model, geometry, tensors)
    checks.append(counts)
    checks.append(check_disk_space(model_dir))
    built, status = engine_status(model.family, model)
    checks.append(Check("engine", PASS if built else WARN, status))

    if deep:
        checks += file_checks(scan.headers)
        checks += _layout_checks(model, geometry, tensors, counts)
        if is_lm and tokenizer.status == PASS and _loads_its_tokenizer(model):   # the files are there: do they load?
            loads, tok = check_tokenizer_loads(model, geometry.vocab_size)
            checks += [loads, check_chat_template_renders(tok)]
    return checks


def _loads_its_tokenizer(model: ResolvedModel) -> bool:
    """Whether the model's tokenizer is one colibri loads: the family's own ``load_tokenizer``, or core's default
    (which reads the directory's ``tokenizer.json``)."""
    own = any(impl.plugin_name == model.family for impl in plugins.manager().hook.load_tokenizer.get_hookimpls())
    return own or (model.path / "tokenizer.json").is_file()


def _layout_checks(model: ResolvedModel, geometry, tensors: dict[str, TensorInfo], counts: Check) -> list[Check]:
    if counts.status == FAIL:
        return [Check("tensor roles", WARN, "not checked: config.json contradicts the tensors (see config vs "
                                            "tensors)")]
    layout, failed = _guarded("tensor layout", lambda: hooks.tensor_layout(model))
    if failed:
        return [failed]
    if layout is None:
        return [Check("tensor roles", WARN, f"family {model.family} gives no tensor layout")]
    return layout_checks(layout, tensors, geometry, model.path)


def failures(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.status == FAIL]


class DoctorFailed(ColibriError):
    """One or more doctor checks failed; the message quotes the first problem."""

    def __init__(self, failed_checks: list[Check], deep: bool):
        first = failed_checks[0]
        problem = first.problems[0] if first.problems else first.detail
        hint = first.fix
        if not hint:   # a file-level problem: the tensor or shard named above
            hint = "fix or re-download the files named above"
            if not deep:
                hint += "; coli doctor --deep also checks every tensor"
        super().__init__(f"{len(failed_checks)} check(s) failed; {first.name}: {problem}", hint)
        self.checks = failed_checks
