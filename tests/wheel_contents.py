"""What a built wheel must hold beyond what ``twine check`` looks at: its LICENSE, each bundled model's weights at
most once (colibri-olmoe once shipped colibri-nano both as bf16 and as its int8 container), and colibri-core's
dashboard files.

Run by ``nox -s packaging`` on the wheels it builds (``python tests/wheel_contents.py WHEEL...``); the layout test
applies the same rule to the file list hatchling would put in the wheel, without building it.
"""

from __future__ import annotations

import sys
import zipfile
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import PurePosixPath

# what `coli serve` serves at / (colibri/server/dashboard.py): package data, so the wheel must carry it
DASHBOARD_ASSETS = tuple(f"colibri/server/static/{name}" for name in ("index.html", "dashboard.js", "dashboard.css"))


def duplicate_models(names: Iterable[str], read: Callable[[str], bytes]) -> list[str]:
    """Directories that ship weights for the same model (identical config.json) as another directory."""
    names = list(names)
    weighted = {str(PurePosixPath(n).parent) for n in names if n.endswith(".safetensors")}
    by_config: dict[bytes, list[str]] = defaultdict(list)
    for name in names:
        directory = str(PurePosixPath(name).parent)
        if PurePosixPath(name).name == "config.json" and directory in weighted:
            by_config[read(name)].append(directory)
    return [" and ".join(sorted(dirs)) for dirs in by_config.values() if len(dirs) > 1]


def wheel_problems(path: str) -> list[str]:
    with zipfile.ZipFile(path) as wheel:
        names = wheel.namelist()
        problems = [f"{path}: ships the same model's weights twice: {dup}"
                    for dup in duplicate_models(names, wheel.read)]
    if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
        problems.append(f"{path}: no LICENSE in .dist-info/licenses")
    if PurePosixPath(path).name.startswith("colibri_core-"):
        problems += [f"{path}: the dashboard's {asset} is missing" for asset in DASHBOARD_ASSETS if asset not in names]
    return problems


def main(paths: list[str]) -> int:
    problems = [p for path in paths for p in wheel_problems(path)]
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{len(paths)} wheel(s) checked, {len(problems)} problem(s)")
    return 1 if problems or not paths else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
