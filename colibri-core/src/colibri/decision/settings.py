"""A checkpoint's decision settings: ``decision.json`` and ``decision_template.jinja`` (transformers'
``DecisionConfig`` files), or the defaults every chat model answers with when it ships neither."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .questions import TYPES

SETTINGS_FILE = "decision.json"
TEMPLATE_FILE = "decision_template.jinja"


@dataclass(frozen=True)
class DecisionSettings:
    labels: dict[str, list[str]] = field(default_factory=dict)        # label tokens per question type
    temperature: dict[str, float] = field(default_factory=dict)       # divides the option scores, per type
    template: str | None = None                                       # None: the generic prompt in the chat template
    noul_options: tuple[str, ...] = ("true", "false")                 # the order a noul's options are printed in
    sanitize: bool = True                                             # control tokens in the request are text

    def temperature_of(self, kind: str) -> float:
        return float(self.temperature.get(kind, 1.0))


def _labels(value: Any, where: str) -> dict[str, list[str]]:
    if not isinstance(value, dict) or not all(k in TYPES and isinstance(v, list) and all(isinstance(x, str) for x in v)
                                              for k, v in value.items()):
        raise ConfigError(f"{where}: 'labels' must map question types to lists of label strings",
                          "e.g. {\"noul\": [\"Yes\", \"No\"]}")
    return {k: list(v) for k, v in value.items()}


def _temperatures(value: Any, where: str) -> dict[str, float]:
    if not isinstance(value, dict) or not all(
            k in TYPES and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
            for k, v in value.items()):
        raise ConfigError(f"{where}: 'temperature' must map question types to positive numbers",
                          "e.g. {\"choice\": 0.7}")
    return {k: float(v) for k, v in value.items()}


def load_settings(model_dir: Path) -> DecisionSettings:
    """The decision settings of ``model_dir`` (unknown keys of decision.json are ignored, as transformers does)."""
    path, template_path = model_dir / SETTINGS_FILE, model_dir / TEMPLATE_FILE
    raw: dict[str, Any] = {}
    if path.is_file():
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: not readable JSON ({exc})", "restore decision.json from the checkpoint") \
                from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: not a JSON object", "restore decision.json from the checkpoint")
    noul = raw.get("noul_options", ["true", "false"])
    if not isinstance(noul, list) or sorted(map(str, noul)) != ["false", "true"]:
        raise ConfigError(f"{path}: 'noul_options' must order 'true' and 'false'", "e.g. [\"true\", \"false\"]")
    template = None
    if template_path.is_file():
        template = template_path.read_text(encoding="utf-8")
    elif isinstance(raw.get("chat_template"), str):
        template = raw["chat_template"]
    return DecisionSettings(labels=_labels(raw.get("labels", {}), str(path)),
                            temperature=_temperatures(raw.get("temperature", {}), str(path)),
                            template=template, noul_options=tuple(noul),
                            sanitize=bool(raw.get("sanitize_control_tokens", True)))
