"""tools/repeated_lines.py counts the issue's measure (normalized 4-line windows) right on a known fixture."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("repeated_lines", ROOT / "tools" / "repeated_lines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


C_SHARED = ["int a = 1;", "int b = 2;", "int c = a + b;", "return c;"]


def test_counts_a_c_window_repeated_across_files_despite_comments_and_spacing(tmp_path):
    tool = _tool()
    first = tmp_path / "one.c"
    second = tmp_path / "two.c"
    # The shared window, then two lines of its own; the copy is re-indented, commented and split by a blank line.
    first.write_text("\n".join(C_SHARED + ["x();", "y();"]) + "\n")
    second.write_text(
        "/* a header\n   comment */\nvoid f(void) {\n"
        "    int a =   1;  // one\n\n    int b = 2;\n    int c = a + b; /* sum */\n    return c;\n}\n"
    )
    count, total, hits = tool.repeated([first, second])
    assert total == 6 + 6  # one.c: 6 code lines; two.c: f's 6 (the comment lines and the blank line drop)
    assert count == 8  # the 4 shared lines in each file, nothing else
    assert hits[first] == [1, 2, 3, 4]
    assert hits[second] == [4, 6, 7, 8]


def test_python_docstrings_and_comments_are_not_code_and_three_lines_are_not_a_window(tmp_path):
    tool = _tool()
    first = tmp_path / "a.py"
    second = tmp_path / "b.py"
    body = "def f(x):\n    y = x + 1\n    z = y * 2\n    return z\n"
    first.write_text('"""Module doc."""\n' + body)
    second.write_text(
        '"""Other doc,\nover two lines."""\n\n# a comment\ndef f(x):  # same f\n    """Its doc."""\n'
        "    y = x + 1\n    z = y * 2\n    return z\n\n\ndef g():\n    y = x + 1\n    z = y * 2\n    return 0\n"
    )
    count, total, _ = tool.repeated([first, second])
    assert total == 4 + 8
    assert count == 8  # f's four lines twice; g shares three lines only, under the window


def test_a_window_repeated_inside_one_file_counts_and_the_cli_prints_the_figure(tmp_path, capsys):
    tool = _tool()
    (tmp_path / "one.c").write_text("\n".join(C_SHARED + ["mid();"] + C_SHARED) + "\n")
    assert tool.main(["--root", str(tmp_path), "--set", "c", "*.c"]) == 0
    assert capsys.readouterr().out.strip() == "c: 8 of 9 code lines repeated (88.9 %) in 1 files"
    assert tool.main(["--root", str(tmp_path), "--set", "none", "*.py"]) == 1
