"""``coli run`` for a pipeline: its flags (``run_options``) and the handler (``run_handler``)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from colibri.errors import UsageError
from colibri.records import ResolvedModel, RunOption

DEFAULT_SIZE = (1024, 1024)
DEFAULT_WEIGHTS = "int8"


def run_options() -> list[RunOption]:
    return [
        RunOption("--out", "Text-to-image: where to write the PNG.", str, "FILE.png"),
        RunOption("--size", "Text-to-image: image size, multiples of 32 (default 1024x1024).", str, "WxH"),
        RunOption("--steps", "Text-to-image: denoising steps (default the pipeline's: 50 for Qwen-Image, 40 or its "
                             "configured sigma grid for 2.1).", int, "N"),
        RunOption("--negative-prompt", "Text-to-image: what to steer away from (true classifier-free guidance).",
                  str, "TEXT"),
        RunOption("--weights", "Text-to-image: int8 (text encoder and transformer matrices per row at load; the "
                               "default) or f32.", str, "int8|f32"),
        RunOption("--guidance", "Text-to-image: true CFG scale with a negative prompt (default the pipeline's: 4 for "
                                "Qwen-Image, 1 (off) for 2.1).", float, "G"),
    ]


def parse_size(text: str | None) -> tuple[int, int]:
    if text is None:
        return DEFAULT_SIZE
    found = re.fullmatch(r"\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*", text)
    if not found:
        raise UsageError(f"--size {text!r}: not WIDTHxHEIGHT", "pass e.g. --size 1024x1024 or 768x512")
    return int(found.group(1)), int(found.group(2))


def request_from(prompt: str, options: Mapping[str, Any]) -> Any:
    import secrets

    from .pipeline import Request

    width, height = parse_size(options.get("size"))
    seed = options.get("seed")
    steps, guidance = options.get("steps"), options.get("guidance")
    return Request(prompt, width=width, height=height, steps=None if steps is None else int(steps),
                   seed=secrets.randbits(32) if seed is None else int(seed),
                   negative_prompt=options.get("negative_prompt"),
                   guidance=None if guidance is None else float(guidance))


def open_pipeline(model: ResolvedModel, threads: int | None, weights: str | None = None) -> Any:
    from colibri import builder

    from .pipeline import open_dir

    # configs and folders are checked before anything is built
    pipe = open_dir(model.path, Path("."), threads, weights or DEFAULT_WEIGHTS)
    engine = builder.engine_for_model(model)
    if engine is None:
        raise UsageError(f"{model.path}: no engine for this pipeline", "coli families lists what colibri-image runs")
    pipe.engine = engine
    return pipe


def run(model: ResolvedModel, prompt: str, options: Mapping[str, Any]) -> int:
    from colibri.console import emit_json
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .png import write_png

    out = options.get("out")
    if not out:
        raise UsageError("no --out FILE.png for the image", 'pass e.g. --out bird.png')
    out_path = Path(out)
    if out_path.suffix.lower() != ".png":
        raise UsageError(f"--out {out}: colibri-image writes PNG", "give a file name ending in .png")
    if not out_path.parent.is_dir():
        raise UsageError(f"--out {out}: the folder {out_path.parent} does not exist", "create it first")
    pipe = open_pipeline(model, options.get("threads"), options.get("weights"))
    req = pipe.resolve(request_from(prompt, options))
    pipe.check(req)
    started = time.monotonic()
    step_started = [started]
    step_seconds: list[float] = []
    with Progress(TextColumn("denoising"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                  TimeElapsedColumn(), console=_stderr_console(), transient=bool(options.get("json"))) as bar:
        task = bar.add_task("denoising", total=req.steps, rate="")

        def progress(done: int, total: int) -> None:
            now = time.monotonic()
            if done > 1:   # the first step's time includes starting the stage and loading its weights
                step_seconds.append(now - step_started[0])
            rate = f"{(now - step_started[0]):.2f} s/step"
            step_started[0] = now
            bar.update(task, completed=done, rate=rate)

        image = pipe.generate(req, progress=progress)
    write_png(out_path, image)
    elapsed = time.monotonic() - started
    peak = peak_rss_bytes(pipe)
    if options.get("json"):
        emit_json({"path": str(out_path), "width": req.width, "height": req.height, "steps": req.steps,
                   "stage_peak_rss_bytes": dict(pipe.stage_peaks),
                   "seed": req.seed, "seconds": elapsed, "peak_rss_bytes": peak,
                   "s_per_step": sum(step_seconds) / len(step_seconds) if step_seconds else None})
    else:
        from colibri.console import human_bytes

        sys.stderr.write(f"{out_path}  {req.width}x{req.height}, {req.steps} steps, seed {req.seed}; "
                         f"peak RSS {human_bytes(peak)}, {elapsed:.1f} s\n")
    return 0


def peak_rss_bytes(pipe: Any) -> int:
    """The largest resident set of this process or of any engine stage it ran (VmHWM: getrusage's maxrss would
    carry over the peak of whatever process launched us)."""
    own = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                own = 1024 * int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return max([own, *pipe.stage_peaks.values()])


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)
