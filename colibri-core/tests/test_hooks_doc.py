"""Every hook in hookspecs.py has an entry in docs/hooks.md (exact signature, firstresult) and a test of its own."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from colibri import hookspecs

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "hooks.md"
TEST_DIRS = (REPO / "colibri-core" / "tests",)


def hooks() -> dict[str, tuple[str, bool]]:
    """name -> (signature as written in the docs, firstresult)."""
    out = {}
    for name, fn in vars(hookspecs).items():
        opts = getattr(fn, "colibri_spec", None)
        if opts is None:
            continue
        signature = str(inspect.signature(fn)).replace("'", "")
        out[name] = (f"{name}{signature}", bool(opts.get("firstresult")))
    return out


def doc_sections() -> dict[str, str]:
    text = DOC.read_text(encoding="utf-8")
    parts = re.split(r"^### `([a-z_]+)`\s*$", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_there_are_hooks():
    assert {"describe_family", "detect_config", "model_geometry", "plan_resources"} <= set(hooks())


def test_every_hook_is_documented_with_its_signature():
    sections = doc_sections()
    for name, (signature, firstresult) in hooks().items():
        assert name in sections, f"docs/hooks.md has no '### `{name}`' entry"
        body = sections[name]
        assert signature in body, f"docs/hooks.md: {name} signature differs from hookspecs.py: {signature}"
        stated = re.search(r"firstresult: (yes|no)", body)
        assert stated, f"docs/hooks.md: {name} does not say 'firstresult: yes' or 'firstresult: no'"
        assert (stated.group(1) == "yes") == firstresult, f"docs/hooks.md: {name} firstresult is wrong"
        assert "answered by:" in body, f"docs/hooks.md: {name} does not say who answers"
        assert "returns:" in body, f"docs/hooks.md: {name} does not say what it returns"


def test_no_entry_for_a_hook_that_does_not_exist():
    assert set(doc_sections()) <= set(hooks())


def test_every_hook_has_a_test_of_its_own():
    names = set()
    for directory in TEST_DIRS:
        for path in directory.rglob("test_*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            names |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    for hook in hooks():
        assert any(n == f"test_hook_{hook}" or n.startswith(f"test_hook_{hook}_") for n in names), (
            f"no test named test_hook_{hook}[_...] in colibri-core/tests")
