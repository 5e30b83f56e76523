"""Resolving a model directory to the family that runs it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from . import envvars, hooks, plugins
from .configs import check_config
from .errors import ConfigError, FamilyError, ModelNotFoundError, UsageError
from .records import Claim, ResolvedModel

MODEL_ENV = envvars.MODEL
MAX_CONFIG_BYTES = 64 * 1024 * 1024     # real config.json files are a few KiB; refuse before reading a huge one


def model_dir_from(option: str | os.PathLike | None) -> Path:
    """The model directory from ``--model`` or ``COLIBRI_MODEL`` (alias ``COLI_MODEL``); never an invented default."""
    value = option if option not in (None, "") else envvars.getenv(MODEL_ENV)
    if not value:
        raise UsageError("no model given", f"pass --model DIR or set {MODEL_ENV}=DIR to a checkpoint directory")
    path = Path(value).expanduser()
    if not path.exists():
        from .models_dir import find, is_name

        pulled = find(str(value))   # a name: the copy `coli pull` keeps in the model directory
        if pulled is None:
            pull = f", or `coli pull {value}` first" if is_name(str(value)) else ""
            raise ModelNotFoundError(f"{path}: no such directory, nor a pulled model of that name",
                                     f"pass --model the checkpoint directory{pull}")
        path = pulled
    if not path.is_dir():
        raise ModelNotFoundError(f"{path}: is a file, not a checkpoint directory",
                                 "pass --model the directory that holds config.json")
    return path


def read_config(model_dir: Path) -> Mapping[str, Any] | None:
    """The parsed ``config.json``, ``None`` when absent; a clear error when it is not a JSON object."""
    path = model_dir / "config.json"
    if not path.exists():
        return None
    if path.is_file() and path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {path.stat().st_size} bytes, not a config (at most {MAX_CONFIG_BYTES})",
                          "restore config.json from the original checkpoint")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deeply",
                          "restore config.json from the original checkpoint") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})", "check the file's permissions") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text", "restore config.json from the original checkpoint") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
                          "restore config.json from the original checkpoint") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level is not a JSON object", "restore config.json")
    check_config(data, where=str(path))
    return MappingProxyType(data)


def _installed_family_names() -> str:
    names = [n for n, f in plugins.families().items() if not f.error]
    return ", ".join(names) if names else "none"


def package_for_model_type(model_type: Any) -> str | None:
    """The package that runs ``model_type``, from the help-text table family_packages.json (never a branch)."""
    from importlib.resources import files

    table = json.loads(files(__package__).joinpath("family_packages.json").read_text(encoding="utf-8"))
    return table["packages"].get(model_type) if isinstance(model_type, str) else None


def _is_installed(package: str) -> bool:
    from importlib import metadata

    try:
        metadata.distribution(package)
    except metadata.PackageNotFoundError:
        return False
    return True


def collect_claims(model_dir: Path, config: Mapping[str, Any] | None) -> list[Claim]:
    return hooks.claims(model_dir, config)


def resolve_model(option: str | os.PathLike | None, family: str | None = None) -> ResolvedModel:
    """Find the model directory, read its config, and settle which family runs it."""
    model_dir = model_dir_from(option)
    config = read_config(model_dir)
    claims = collect_claims(model_dir, config)
    if family:
        if family not in plugins.families():
            raise FamilyError(f"--family {family}: no such family installed",
                              f"installed families: {_installed_family_names()}")
        chosen = [c for c in claims if c.family == family]
        if not chosen:
            raise FamilyError(f"--family {family} does not claim {model_dir}",
                              f"families that do: {', '.join(c.family for c in claims) or 'none'}")
        claims = chosen[:1]
    if not claims:
        if config is None:
            marker = "no config.json (and no marker file any family recognises)"
            if not any(model_dir.glob("*.safetensors")) and not (model_dir / "model_index.json").exists():
                raise ModelNotFoundError(f"{model_dir}: no config.json and no weights",
                                         "point --model at a Hugging Face checkpoint directory")
        elif "model_type" not in config:
            raise FamilyError(f"{model_dir / 'config.json'}: no model_type field, and no installed family "
                              "recognises the config without one",
                              "restore config.json from the original checkpoint (its model_type names the "
                              f"architecture); installed families: {_installed_family_names()}")
        else:
            marker = f"model_type {config.get('model_type')!r}"
            package = package_for_model_type(config.get("model_type"))
            entries = [f for f in plugins.families().values() if f.package == package]
            broken = [f for f in entries if f.error]
            if broken:
                raise FamilyError(f"{model_dir / 'config.json'}: {marker} needs {package}, whose plugin failed to "
                                  f"load ({broken[0].error})", f"reinstall {package}; coli families shows the error")
            if package is not None and not entries:
                if _is_installed(package):   # present, but COLIBRI_LOAD_PLUGINS / COLIBRI_DISABLE_PLUGINS left it out
                    raise FamilyError(f"{model_dir / 'config.json'}: {marker} needs the family package {package}, "
                                      "which is installed but not loaded",
                                      "check COLIBRI_LOAD_PLUGINS and COLIBRI_DISABLE_PLUGINS")
                raise FamilyError(f"{model_dir / 'config.json'}: {marker} needs the family package {package}, "
                                  "which is not installed", f"pip install {package}")
        raise FamilyError(f"{model_dir / 'config.json'}: {marker} is not claimed by any installed family",
                          f"installed families: {_installed_family_names()}; install the family package for it")
    if claims:   # a claim on more specific evidence (marker files) outranks the plain model_type claims
        top = max(c.priority for c in claims)
        claims = [c for c in claims if c.priority == top]
    if len(claims) > 1:
        names = " and ".join(f"{c.family}" for c in claims)
        raise FamilyError(f"{model_dir}: claimed by {names}",
                          f"choose one with --family {claims[0].family}")
    claim = claims[0]
    return ResolvedModel(path=model_dir, family=claim.family, model_type=claim.model_type,
                         config=config if config is not None else MappingProxyType({}))
