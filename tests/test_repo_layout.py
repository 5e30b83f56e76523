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
