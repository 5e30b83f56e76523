"""The monorepo's promises that no unit test of a package can see: the layout, the nox sessions and their
descriptions, and CI running exactly the commands the README gives a user."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("colibri-core", "colibri-olmoe", "colibri-qwen", "colibri-glm", "colibri-deepseek-v4", "colibri-kimi",
            "colibri-image", "colibri-decision")


def readme_commands() -> list[str]:
    """The one-line commands in the README's "On a fresh machine" section, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## On a fresh machine", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```\n(.*?)```", section, re.S)]


def test_top_level_layout():
    for name in (*PACKAGES, "engines", "tests", "docs", "noxfile.py", "README.md", ".ci/run"):
        assert (ROOT / name).exists(), name
    assert (ROOT / ".ci" / "run").stat().st_mode & 0o111, ".ci/run must be executable"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_is_complete(package):
    directory = ROOT / package
    with open(directory / "pyproject.toml", "rb") as fh:
        project = tomllib.load(fh)
    assert project["build-system"]["build-backend"] == "hatchling.build"
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["project"]["version"])
    for name in ("README.md", "CHANGELOG.md"):
        assert (directory / name).read_text().strip(), f"{package}/{name} is empty"
    assert list((directory / "tests").glob("test_*.py")), f"{package} ships no tests"
    assert (directory / "src").is_dir()
    if package != "colibri-core":
        assert project["project"]["entry-points"]["colibri.families"], f"{package} registers no family plugin"


def test_nox_lists_every_session_with_its_description():
    listing = subprocess.run([sys.executable, "-m", "nox", "-l", "-f", str(ROOT / "noxfile.py")], cwd=ROOT,
                             capture_output=True, text=True, timeout=120, check=True).stdout
    described = dict(re.findall(r"^[*-] (\S+) -> (.+)$", listing, re.M))
    for session in ("tests", "integration", "lint", "engines", "packaging"):
        assert described.get(session, "").strip(), f"nox -l: session {session} missing or undescribed"
    for package in PACKAGES:
        assert f"package_tests(package='{package}')" in described, package


def test_ci_runs_the_readme_commands():
    main_job, tests_command = readme_commands()[:2]
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests_command in ci, f".ci/run does not run the README's test command: {tests_command}"
    assert "engines" in tests_command.split(), "the engines' C tests (and sanitizers) must be part of CI"
    assert "coli demo" in main_job and "coli demo" in ci
    # CI installs the main job the way the README does: core and the OLMoE family, from the checkout.
    for package in ("./colibri-core", "./colibri-olmoe"):
        assert package in main_job and package in ci


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_has_complete_metadata(package):
    """What PyPI shows and pip resolves: readme, license file, URLs, classifiers, and a bounded colibri-core."""
    with open(ROOT / package / "pyproject.toml", "rb") as fh:
        project = tomllib.load(fh)["project"]
    assert project["readme"] == "README.md" and project["license"] == "MIT"
    assert project["license-files"] == ["LICENSE"] and "MIT License" in (ROOT / package / "LICENSE").read_text()
    assert {"Homepage", "Source", "Changelog", "Issues"} <= set(project["urls"]), project.get("urls")
    assert any(c.startswith("Programming Language :: Python :: 3.") for c in project["classifiers"])
    assert project["description"] and project["requires-python"] == ">=3.10"
    if package != "colibri-core":
        core = [d for d in project["dependencies"] if d.startswith("colibri-core")]
        assert core and re.fullmatch(r"colibri-core>=\d+\.\d+\.\d+,<\d+\.\d+", core[0]), core


def test_the_olmoe_wheel_ships_colibri_nano_once():
    """The file list hatchling puts in the wheel: the int8 container `coli demo` runs, not the bf16 weights too."""
    from hatchling.builders.wheel import WheelBuilder
    from wheel_contents import duplicate_models

    files = {f.distribution_path: f.path for f in WheelBuilder(str(ROOT / "colibri-olmoe")).recurse_included_files()}
    assert "colibri_olmoe/nano-int8/model.safetensors.index.json" in files
    assert duplicate_models(files, lambda name: Path(files[name]).read_bytes()) == []
    assert sum(Path(p).stat().st_size for p in files.values()) < 40_000_000


def test_duplicate_models_are_found():
    configs = {"a/config.json": b"{}", "a/model.safetensors": b"", "b/config.json": b"{}", "b/x.safetensors": b"",
               "c/config.json": b"{}"}
    assert duplicate_models_of(configs) == ["a and b"]
    assert duplicate_models_of({k: v for k, v in configs.items() if not k.startswith("b/")}) == []


def duplicate_models_of(files: dict[str, bytes]) -> list[str]:
    from wheel_contents import duplicate_models

    return duplicate_models(files, files.__getitem__)


def test_ci_builds_every_package():
    """`nox -s packaging` (python -m build + twine check) is part of the README's test command, which CI runs."""
    assert "packaging" in readme_commands()[1].split()
    source = (ROOT / "noxfile.py").read_text()
    assert '"build", "--no-isolation"' in source and '"twine", "check", "--strict"' in source


# What core's own tests may not need: a family package (core must not know one) or torch/transformers (core's tests
# run on the checkpoint core writes itself, colibri-core/tests/tiny_checkpoint.py). Tests that need them are
# cross-package and live in this folder.
TORCH_STACK = ("torch", "transformers", "diffusers", "accelerate")
TORCH_HELPERS = ("colibri.testing.parity", "colibri.testing.quality")   # they run models tiny_model builds


def family_import_names() -> set[str]:
    """The import package of every family plugin in the repository (its colibri.families entry points)."""
    names = set()
    for pyproject in ROOT.glob("colibri-*/pyproject.toml"):
        with open(pyproject, "rb") as fh:
            points = tomllib.load(fh).get("project", {}).get("entry-points", {}).get("colibri.families", {})
        names.update(target.split(":")[0].split(".")[0] for target in points.values())
    return names


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file: import statements (at any depth), and the string arguments of
    pytest.importorskip, importlib.import_module and __import__."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("importorskip", "import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def forbidden_in_core_tests(module: str, families: set[str]) -> bool:
    top = module.split(".")[0]
    return (top in families or top in TORCH_STACK or module == "colibri.testing.tiny.tiny_model"
            or any(module == h or module.startswith(h + ".") for h in TORCH_HELPERS))


def test_core_tests_import_no_family_package_and_no_torch():
    families = family_import_names()
    assert {"colibri_olmoe", "colibri_qwen", "colibri_kimi"} <= families
    offenders = [f"{path.relative_to(ROOT)}:{line} imports {module}"
                 for path in sorted((ROOT / "colibri-core" / "tests").rglob("*.py"))
                 for line, module in imported_modules(path) if forbidden_in_core_tests(module, families)]
    assert not offenders, "core's own tests must run without families and torch (move these to tests/):\n" + \
        "\n".join(offenders)


def test_the_import_check_sees_every_spelling(tmp_path):
    sample = tmp_path / "test_sample.py"
    sample.write_text("import os\nimport torch.nn\nfrom colibri_glm import plugin\nfrom colibri.testing.tiny import "
                      "tiny_model, ChatStyle\n\ndef f(pytest):\n    import transformers\n"
                      "    pytest.importorskip('colibri_qwen')\n    from colibri.testing.parity import x\n")
    families = {"colibri_glm", "colibri_qwen"}
    bad = [(line, m) for line, m in imported_modules(sample) if forbidden_in_core_tests(m, families)]
    assert sorted(line for line, _ in bad) == [2, 3, 3, 4, 7, 8, 9, 9]
    assert not forbidden_in_core_tests("colibri.testing.tiny.ChatStyle", families)
