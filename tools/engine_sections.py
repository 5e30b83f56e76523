#!/usr/bin/env python3
"""Code lines per section of each family engine file (issue #16: "the forward pass is its largest section").

Sections, as docs/architecture.md's "Writing a family" orders a recipe: ``structs`` (typedefs), ``hparams``
(``cb_hp_spec`` tables), ``tensors`` (``cb_tensor_spec`` tables), ``scratch`` (``cb_scratch_spec``), ``load``
(the load-time hooks and what only they call: setup, finish, load_layer, the frees), ``forward`` (what the
forward pass runs: the recipe's mixer / FFN hooks or the family's own forward, and every function they call),
``glue`` (the recipe, the ``cb_family`` vtable, the load wrapper and ``main``, or the ``CB_DECODER_ENGINE``
macro (or ``CB_DECODER_BATCHED_ENGINE``) that spells all four). Code lines are counted as
tools/repeated_lines.py counts them (comments and blank lines dropped). A top-level function no section reaches
is ``other``. A hook table in designated initializers (``.forward = f``, as the image family's ``img_stage``) is
glue whose hooks are roots like a ``cb_family``'s; a file with neither ``main`` nor such a table is a block library
(``lib``, not ranked). Prints one line per file; ``--check`` exits 1 when a file's forward section is not its largest.

    python3 tools/engine_sections.py [--check] [FILE...]   (default: every colibri-*/src/*/engine/*.c)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from repeated_lines import code_lines

ROOT = Path(__file__).resolve().parent.parent
LOAD_HOOKS = ("setup", "finish", "load_layer", "free_layer", "free_model", "load_model")
FORWARD_HOOKS = ("mixer", "ffn", "forward", "logits", "decide")   # decide: an encoder family's whole-prompt forward


def items(path: Path) -> list[tuple[str, str, int]]:
    """(kind, name, code lines) of each top-level item, split at column-0 closing braces / semicolons."""
    lines = [text for _, text in code_lines(path)]
    out, start, depth = [], 0, 0
    for i, text in enumerate(lines):
        depth += text.count("{") - text.count("}")
        ends = depth == 0 and (text.endswith("}") or text.endswith("};") or text.endswith(";") or
                               text.startswith("#"))
        if ends:
            chunk = lines[start:i + 1]
            out.append((classify(chunk), name_of(chunk), len(chunk), " ".join(chunk)))
            start = i + 1
    return out


def name_of(chunk: list[str]) -> str:
    m = re.search(r"(\w+)\s*\(", chunk[0]) if "(" in chunk[0] else re.search(r"(\w+)\s*(\[\])?\s*=", chunk[0])
    return m[1] if m else chunk[0][:30]


def classify(chunk: list[str]) -> str:
    head = chunk[0]
    if head.startswith("#"):
        return "glue"
    if head.startswith("typedef"):
        return "structs"
    for kind, word in (("hparams", "cb_hp_spec"), ("tensors", "tensor_spec"), ("scratch", "cb_scratch_spec"),
                       ("glue", "cb_recipe"), ("glue", "cb_family")):
        if word in head:
            return kind
    if head.startswith("int main") or re.match(r"CB_DECODER_\w*ENGINE\(", head) or is_hook_table(chunk):
        return "glue"
    return "function"


def names_hooks(text: str) -> bool:
    return bool(re.search(rf"\.({'|'.join(LOAD_HOOKS + FORWARD_HOOKS)})\s*=", text))


def is_hook_table(chunk: list[str]) -> bool:
    """A vtable in designated initializers naming a load or forward hook (e.g. the image family's img_stage)."""
    return "(" not in chunk[0] and chunk[0].endswith("{") and names_hooks(" ".join(chunk))


def is_library(path: Path) -> bool:
    """A family's block library (image_ops.c): no main and no hook table, so no forward pass of its own to rank."""
    return not any(name == "main" or (kind == "glue" and names_hooks(body)) for kind, name, _, body in items(path))


def sections(path: Path) -> dict[str, int]:
    found = items(path)
    bodies = {name: body for kind, name, _, body in found if kind == "function"}
    glue = " ".join(body for kind, _, _, body in found if kind == "glue")
    roots = {"load": set(), "forward": set()}
    for hook in LOAD_HOOKS + FORWARD_HOOKS:
        for m in re.finditer(rf"\.{hook}\s*=\s*(\w+)", glue):
            roots["load" if hook in LOAD_HOOKS else "forward"].add(m[1])
    m = re.search(r"cb_family \w+ = \{\s*\"[^\"]*\",\s*(\w+),\s*(\w+),\s*(\w+)\s*\}", glue)
    if m:
        roots["glue"] = {m[1]}           # the load wrapper
        roots["forward"].add(m[2])
        roots["load"].add(m[3])
    owner: dict[str, str] = {}
    for section in ("forward", "load", "glue"):   # forward first: a helper both use is forward code
        todo = [r for r in roots.get(section, ()) if r in bodies]
        while todo:
            fn = todo.pop()
            if fn in owner:
                continue
            owner[fn] = section
            todo += [c for c in bodies if c != fn and c not in owner and re.search(rf"\b{c}\b", bodies[fn])]
    counts: dict[str, int] = {}
    for kind, name, n, _ in found:
        section = owner.get(name, "other") if kind == "function" else kind
        counts[section] = counts.get(section, 0) + n
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("files", nargs="*", type=Path)
    args = ap.parse_args(argv)
    files = args.files or sorted(ROOT.glob("colibri-*/src/*/engine/*.c"))
    bad = 0
    for path in files:
        shown_path = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        if is_library(path):
            print(f"lib {shown_path}: a block library (no main, no hook table), not ranked")
            continue
        counts = sections(path)
        largest = max(counts, key=counts.get)
        ok = largest == "forward"
        bad += not ok
        shown = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
        print(f"{'ok ' if ok else 'NO '} {shown_path}: {shown}")
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
