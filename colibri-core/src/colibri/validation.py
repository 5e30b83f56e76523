"""One validation of a checkpoint against its family's layout, shared by ``doctor --deep``, ``convert`` and the
launch path (``run``, ``chat``, ``serve``).

Each check returns a named :class:`Check` listing every problem (doctor shows them all); :func:`require` turns the
first failed check into a one-line :class:`CheckpointError` (convert and the launch path refuse with it). What is
checked, from headers alone (never weight bytes):

* the files: known dtypes, shape x dtype = byte span, every byte range inside its file, no two ranges overlapping;
* the config against the tensors on disk (:func:`check_counts`), *before* any tensor layout is sized from it: a
  config that claims more layers or experts than the shards hold tensors for is refused, so a hostile
  ``num_hidden_layers`` never turns into a table of a billion names;
* the family's layout: every tensor it names is present (:func:`check_roles`), with the shape the family derives
  from the config (:func:`check_shapes`: ``TensorLayout.shapes`` and ``expert_shapes``);
* the tokenizer loads, and the chat template renders a one-message conversation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import configs, hooks
from .checkpoint import DTYPE_BYTES, LAYER_INDEX, ShardHeader, TensorInfo
from .errors import CheckpointError, ColibriError
from .records import Geometry, ResolvedModel, TensorLayout

PASS, WARN, FAIL = "pass", "warn", "fail"
MAX_PROBLEMS_SHOWN = 5
SAMPLE_CONVERSATION = ({"role": "user", "content": "Hello"},)


@dataclass(frozen=True)
class Check:
    """One named check. ``problems`` lists every offending file/tensor; ``detail`` summarises."""

    name: str
    status: str
    detail: str
    problems: tuple[str, ...] = ()
    fix: str = ""            # what to do, when the failure says it (else the closing hint is about the files)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "problems": list(self.problems),
                "fix": self.fix}


def summarise(name: str, problems: list[str], ok_detail: str) -> Check:
    if not problems:
        return Check(name, PASS, ok_detail)
    shown = "; ".join(problems[:MAX_PROBLEMS_SHOWN])
    more = f"; and {len(problems) - MAX_PROBLEMS_SHOWN} more" if len(problems) > MAX_PROBLEMS_SHOWN else ""
    return Check(name, FAIL, shown + more, tuple(problems))


def require(checks: Iterable[Check]) -> None:
    """Raise a one-line :class:`CheckpointError` for the first failed check (every problem names its file)."""
    for check in checks:
        if check.status != FAIL:
            continue
        problem = check.problems[0] if check.problems else check.detail
        more = f" (and {len(check.problems) - 1} more)" if len(check.problems) > 1 else ""
        raise CheckpointError(f"{check.name}: {problem}{more}",
                              "restore or re-download the files named; coli doctor --deep lists every problem")


# ---------------------------------------------------------------------------------------------- files

def _all_tensors(headers: Iterable[ShardHeader]) -> list[tuple[ShardHeader, TensorInfo]]:
    return [(h, t) for h in headers for t in h.tensors]


def check_dtypes(headers: list[ShardHeader]) -> Check:
    problems = [f"{h.file}: tensor {t.name!r} has unknown dtype {t.dtype!r}"
                for h, t in _all_tensors(headers) if t.dtype not in DTYPE_BYTES]
    return summarise("dtypes", problems, ", ".join(sorted({t.dtype for _, t in _all_tensors(headers)})) or "none")


def check_sizes(headers: list[ShardHeader]) -> Check:
    problems = []
    for h, t in _all_tensors(headers):
        if t.dtype not in DTYPE_BYTES:
            continue  # reported by the dtype check
        expected = t.numel * DTYPE_BYTES[t.dtype]
        if expected != t.nbytes:
            problems.append(f"{h.file}: tensor {t.name!r} shape {list(t.shape)} x {t.dtype} is {expected:g} bytes "
                            f"but its offsets span {t.nbytes}")
    return summarise("tensor sizes", problems, "shape x dtype matches every byte range")


def check_offsets(headers: list[ShardHeader]) -> Check:
    problems = [f"{h.file}: tensor {t.name!r} runs to byte {t.end}, past the end of the {h.file_size}-byte file"
                for h, t in _all_tensors(headers) if t.end > h.file_size]
    return summarise("offsets", problems, "every tensor lies inside its file")


def check_overlaps(headers: list[ShardHeader]) -> Check:
    problems = []
    for h in headers:
        ordered = sorted((t for t in h.tensors if t.end > t.begin), key=lambda t: (t.begin, t.end))
        for prev, cur in zip(ordered, ordered[1:]):
            if cur.begin < prev.end:
                problems.append(f"{h.file}: tensor {cur.name!r} (bytes {cur.begin}-{cur.end}) overlaps "
                                f"{prev.name!r} (bytes {prev.begin}-{prev.end})")
    return summarise("overlaps", problems, "no two tensors share bytes")


def file_checks(headers: list[ShardHeader]) -> list[Check]:
    return [check_dtypes(headers), check_sizes(headers), check_offsets(headers), check_overlaps(headers)]


# ---------------------------------------------------------------------------------------------- config vs disk

def check_counts(model: ResolvedModel, geometry: Geometry, names: Collection[str]) -> Check:
    """The config's layer and expert counts against the tensors on disk, before a layout is built from them.

    Every layer has at least one tensor of its own (``layers.<i>.`` in the HF naming every text family uses), and
    every routed expert of every MoE layer has at least one; a config claiming more is refused naming its field.
    Counts below what is on disk are the role check's business (it names each missing tensor).
    """
    where = model.path / "config.json"
    cfg = model.text_config
    problems = []
    layer_ids = {int(m.group(1)) for n in names if (m := LAYER_INDEX.search(n))}
    layer_field = configs.present_name(cfg, *configs.LAYER_COUNT_FIELDS)
    if layer_ids and geometry.num_layers > len(layer_ids):
        problems.append(f"{where}: {layer_field!r} is {geometry.num_layers} but the shards hold tensors of "
                        f"{len(layer_ids)} layers")
    elif geometry.num_layers > len(names):
        problems.append(f"{where}: {layer_field!r} is {geometry.num_layers} but the shards hold only "
                        f"{len(names)} tensors")
    moe_layers = len(geometry.moe_layers)
    if not problems and geometry.num_experts and moe_layers * geometry.num_experts > len(names):
        field = configs.present_name(cfg, *configs.EXPERT_COUNT_FIELDS)
        problems.append(f"{where}: {field!r} is {geometry.num_experts}, {moe_layers * geometry.num_experts} routed "
                        f"experts in {moe_layers} MoE layers, but the shards hold only {len(names)} tensors")
    ok = f"{geometry.num_layers} layers, {geometry.num_experts} experts per MoE layer, {len(names)} tensors"
    return summarise("config vs tensors", problems, ok)


# ---------------------------------------------------------------------------------------------- layout

def check_roles(layout: TensorLayout, names: Collection[str], geometry: Geometry, where: object = None) -> Check:
    """Every tensor the family's layout names is on disk: embedding, norms, routers, each expert, lm_head.
    ``where`` (the checkpoint directory) prefixes each problem."""
    problems: list[str] = []
    at = f"{where}: " if where is not None else ""

    def need(role: str, name: str) -> None:
        if name not in names:
            problems.append(f"{at}{role}: tensor {name!r} is missing")

    for name in layout.embeddings:
        need("embedding", name)
    if layout.lm_head is not None and layout.lm_head not in layout.embeddings:
        need("lm_head", layout.lm_head)
    for name in layout.norms:
        need("norm", name)
    for layer, name in layout.routers:
        need(f"layer {layer} router", name)
    for ex in layout.experts:
        missing = [n for n in ex.tensors if n not in names]
        if missing:
            problems.append(f"{at}layer {ex.layer} expert {ex.expert}: tensor {missing[0]!r} is missing"
                            + (f" (and {len(missing) - 1} more of that expert)" if len(missing) > 1 else ""))
    for name in layout.required:
        need("required", name)
    for name in layout.buffers:
        need("buffer", name)
    per_layer = Counter(ex.layer for ex in layout.experts)
    if geometry.num_experts:
        for layer, count in sorted(per_layer.items()):
            if count != geometry.num_experts:
                problems.append(f"{at}layer {layer}: the layout names {count} experts but the config says "
                                f"{geometry.num_experts}")
    tied = "tied" if layout.lm_head is None else "untied"
    ok = (f"embedding, {len(layout.norms)} norms, {len(layout.routers)} routers, {len(layout.experts)} experts "
          f"in {len(per_layer)} MoE layers, lm_head {tied}")
    return summarise("tensor roles", problems, ok)


def _expected_shapes(layout: TensorLayout, tensors: Any) -> Iterable[tuple[str, tuple[int, ...], str]]:
    """(name, expected shape, where the expectation comes from) for every tensor whose shape is known."""
    for name, shape in layout.shapes.items():
        yield name, tuple(shape), "config"
    if layout.expert_shapes:
        for ex in layout.experts:
            for name, shape in zip(ex.tensors, layout.expert_shapes):
                yield name, tuple(shape), "config"
        return
    # The family states no expert shapes: the experts of one layer are alike in every real family, so each is
    # held to the shape most of its layer's experts have at that position (a lone transposed matrix stands out).
    by_slot: dict[tuple[int, int], Counter] = {}
    for ex in layout.experts:
        for i, name in enumerate(ex.tensors):
            if name in tensors:
                by_slot.setdefault((ex.layer, i), Counter())[tuple(tensors[name].shape)] += 1
    for ex in layout.experts:
        for i, name in enumerate(ex.tensors):
            counts = by_slot.get((ex.layer, i))
            if counts is not None and len(counts) > 1:
                yield name, counts.most_common(1)[0][0], "siblings"


def check_shapes(layout: TensorLayout, tensors: Any, config_file: object = "config.json") -> Check:
    """Each tensor's shape on disk against the one the family derives from the config (``TensorLayout.shapes``
    and ``expert_shapes``), or, for experts whose shapes the family does not state, against the other experts of
    its layer. ``tensors`` maps names to :class:`TensorInfo` (a TensorIndex or a dict); a missing tensor is the
    role check's business."""
    problems = []
    checked = 0
    for name, want, source in _expected_shapes(layout, tensors):
        if name not in tensors:
            continue
        checked += 1
        t = tensors[name]
        got = tuple(t.shape)
        if got != want:
            why = " (transposed?)" if sorted(got) == sorted(want) else ""
            basis = f"{config_file} implies" if source == "config" else "the other experts of its layer have"
            problems.append(f"{t.file}: tensor {name!r} has shape {list(got)} but {basis} {list(want)}{why}")
    stated = bool(layout.shapes or layout.expert_shapes)
    if not stated and not problems:     # nothing to hold the shapes to: not a fault of the checkpoint
        return Check("tensor shapes", PASS, "the family states no expected shapes"
                     + ("; each layer's experts agree" if layout.experts else ""))
    return summarise("tensor shapes", problems, f"{checked} tensors have the shapes config.json implies")


def layout_checks(layout: TensorLayout, tensors: Any, geometry: Geometry, model_dir: Path) -> list[Check]:
    return [check_roles(layout, tensors, geometry, model_dir), check_shapes(layout, tensors, model_dir / "config.json")]


# ---------------------------------------------------------------------------------------------- tokenizer

def check_tokenizer_loads(model: ResolvedModel, vocab_size: int) -> tuple[Check, Any]:
    """The family's tokenizer loads and fits the model's embedding; returns the check and the tokenizer."""
    try:
        tok = hooks.load_tokenizer(model)
    except ColibriError as exc:
        return Check("tokenizer loads", FAIL, exc.one_line()), None
    except Exception as exc:    # a tokenizer library's own error on a malformed file
        first = (str(exc).splitlines() or [""])[0]
        return Check("tokenizer loads", FAIL, f"{model.path}: the tokenizer does not load "
                                               f"({type(exc).__name__}: {first})"), None
    if tok is None:
        return Check("tokenizer loads", WARN, f"family {model.family} loads no tokenizer"), None
    source = getattr(tok, "source", None) or model.path
    size = tok.vocab_size
    if size <= 0:
        return Check("tokenizer loads", FAIL, f"{source}: the tokenizer has an empty vocabulary"), tok
    if vocab_size and size > vocab_size:
        return Check("tokenizer loads", FAIL, f"{source}: the tokenizer has {size} tokens but "
                                               f"{model.path / 'config.json'} 'vocab_size' is {vocab_size}"), tok
    return Check("tokenizer loads", PASS, f"{size} tokens"), tok


def check_chat_template_renders(tok: Any) -> Check:
    """A one-message conversation renders with the checkpoint's chat template (when it has one)."""
    if tok is None or not getattr(tok, "has_chat_template", False):
        return Check("chat template renders", PASS, "no chat template to render")
    try:
        tok.render_chat(list(SAMPLE_CONVERSATION))
    except ColibriError as exc:
        return Check("chat template renders", FAIL, exc.one_line())
    except Exception as exc:    # jinja errors the renderer does not translate
        first = (str(exc).splitlines() or [""])[0]
        return Check("chat template renders", FAIL, f"{tok.source}: the chat template fails on a one-message "
                                                     f"conversation ({type(exc).__name__}: {first})")
    return Check("chat template renders", PASS, "renders a one-message conversation")


def require_sound_tensors(model: ResolvedModel, geometry: Geometry, layout: TensorLayout | None,
                          tensors: Mapping[str, TensorInfo] | Any) -> None:
    """The launch path's gate: the family's layout is on disk with the shapes the config implies."""
    if layout is not None:
        require(layout_checks(layout, tensors, geometry, model.path))
