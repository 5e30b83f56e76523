"""Issue #16: core never names a family or a model type in its code, only in comments and help text.

What counts as code: every Python identifier, and every Python or C string literal that *is* a model type or a
family name (``"olmoe"``, ``"deepseek_v3"``: what a dispatch on the family would compare with) or is one name
holding a family's (``"Qwen2Tokenizer"``: a table keyed by a family's class); C identifiers too.
Prose that mentions a release (help text, hints, docstrings, comments) is allowed. The model types are those of
``family_packages.json`` (kept in step with the families by tests/test_cli_hints.py); ``testing/`` is included.
"""

from __future__ import annotations

import io
import json
import re
import sys
import token
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "colibri-core" / "src" / "colibri"
sys.path.insert(0, str(ROOT / "tools"))

from repeated_lines import code_lines  # noqa: E402

# The families' own names where they are distinctive words. "image" and "decision" are also protocol words core
# must use (an OpenAI content part of type "image", the engine's "decision" event), so they are checked through
# the model types their families claim instead.
FAMILY_WORDS = ("olmoe", "qwen", "glm", "deepseek", "kimi", "mixtral")
IN_IDENTIFIER = re.compile("(?i)" + "|".join(FAMILY_WORDS))
# A literal that is one name (no spaces: a class or key such as "Qwen2Tokenizer") is code, like an identifier.
ONE_NAME = re.compile(r"[A-Za-z_][\w.-]*")


def names_a_family(body: str, exact: set[str]) -> bool:
    return body in exact or bool(ONE_NAME.fullmatch(body) and IN_IDENTIFIER.search(body))


def exact_words() -> set[str]:
    types = json.loads((CORE / "family_packages.json").read_text(encoding="utf-8"))["packages"]
    return set(types) | set(FAMILY_WORDS)


def python_hits(path: Path, exact: set[str]) -> list[tuple[int, str]]:
    hits, previous = [], token.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
        if tok.type == token.NAME and IN_IDENTIFIER.search(tok.string):
            hits.append((tok.start[0], tok.string))
        elif tok.type == token.STRING and previous not in (token.NEWLINE, token.INDENT, token.DEDENT, tokenize.NL):
            body = re.sub(r"^[rbuRBUfF]*", "", tok.string).strip("\"'")
            if names_a_family(body, exact):
                hits.append((tok.start[0], tok.string))
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok.type
    return hits


def c_hits(path: Path, exact: set[str]) -> list[tuple[int, str]]:
    hits = []
    for number, line in code_lines(path):
        for m in re.finditer(r'"((?:\\.|[^"\\])*)"|([A-Za-z_]\w*)', line):
            if (m[1] is not None and names_a_family(m[1], exact)) or (m[2] and IN_IDENTIFIER.search(m[2])):
                hits.append((number, m[0]))
    return hits


def family_names_in_core() -> list[str]:
    exact = exact_words()
    found = []
    for path in sorted(CORE.rglob("*")):
        if path.suffix == ".py":
            hits = python_hits(path, exact)
        elif path.suffix in (".c", ".h"):
            hits = c_hits(path, exact)
        else:
            continue
        found += [f"{path.relative_to(ROOT)}:{n}: {what}" for n, what in hits]
    return found


def test_core_code_names_no_family_and_no_model_type():
    assert family_names_in_core() == []


def test_the_check_sees_a_dispatch_on_a_model_type(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""olmoe in a docstring is prose."""\n# so is qwen3_moe in a comment\n'
                      'HELP = "e.g. pip install colibri-olmoe"\n'
                      'if model.model_type == "deepseek_v3":\n    kimi_routing = 1\n'
                      'SPLITS = {"Qwen2TokenizerFast": None}\n', encoding="utf-8")
    assert python_hits(sample, exact_words()) == [(4, '"deepseek_v3"'), (5, "kimi_routing"),
                                                  (6, '"Qwen2TokenizerFast"')]
    c_sample = tmp_path / "sample.c"
    c_sample.write_text('/* glm4_moe here is a comment */\nif (!strcmp(type, "glm4_moe")) qwen_rope();\n'
                        'snprintf(err, n, "see the olmoe docs");\n', encoding="utf-8")
    assert c_hits(c_sample, exact_words()) == [(2, '"glm4_moe"'), (2, "qwen_rope")]
