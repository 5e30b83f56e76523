"""Conversations that survive restarts: the engine's saved KV files (docs/formats.md "Saved KV files"), one
directory per model identity, kept under a disk budget.

The engine reads and writes the files (runtime/kv_file.c: atomic, checksummed, checked against its geometry);
this module decides which file a request loads and where its slot is saved, and evicts the least recently used
files when the directory outgrows its budget. Each submit names the saved file whose token ids share the longest
prefix with the new prompt (the engine loads it only if that beats what its slot already holds) and a save path
keyed by a hash of the identity and the prompt. When the save lands, the loaded file is superseded (the new one
extends it) and removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .cachedir import cache_root

log = logging.getLogger("colibri.kv")

DEFAULT_BUDGET_BYTES = 8 * 1024 ** 3     # per model directory
SUFFIX = ".kv"
MAGIC = b"COLIKV\r\n"
VERSION = 1
# runtime/kv_file.c kv_header: magic, version, header_bytes, family, identity, n_layers, kv_dim, kv_k_only,
# n_tokens, snap_pos, reserved, state_bytes, payload_bytes, checksum
HEADER = struct.Struct("<8sII32s64sIIIIIIQQQ")
IDENTITY_SAMPLE = 64 * 1024              # bytes read from each end of each weight file for the identity
STALE_TMP_S = 3600.0
MODEL_RECORD = "model.json"                     # a temporary file this old is a crashed save


KV_DIR_ENV = "COLIBRI_KV_DIR"


def kv_root(kv_dir: str | os.PathLike | None = None) -> Path:
    """``--kv-dir``, else ``$COLIBRI_KV_DIR``, else ``<cache>/kv`` (``$COLIBRI_CACHE`` or
    ``$XDG_CACHE_HOME/colibri``)."""
    chosen = kv_dir or os.environ.get(KV_DIR_ENV)
    return Path(chosen).expanduser() if chosen else cache_root() / "kv"


def model_identity(model_dir: Path, family: str, engine_args: Sequence[str] = ()) -> str:
    """64 hex digits naming the weights a KV file was computed with: the family, the engine's hyperparameter
    arguments, config.json, and each weight file's name, size and first and last 64 KiB (the header and sampled
    data: two checkpoints of one architecture differ there; a copy of a model keeps its identity)."""
    digest = hashlib.sha256()
    digest.update(f"{family}\0{' '.join(engine_args)}\0".encode())
    config = model_dir / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"\0{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            digest.update(f.read(IDENTITY_SAMPLE))
            if size > 2 * IDENTITY_SAMPLE:
                f.seek(size - IDENTITY_SAMPLE)
                digest.update(f.read(IDENTITY_SAMPLE))
    return digest.hexdigest()


def hyperparameter_args(argv: Sequence[str]) -> list[str]:
    """The ``--set key=value`` pairs of an engine argv (what changes the numbers, unlike --cap or --threads)."""
    return [f"{argv[i]} {argv[i + 1]}" for i in range(len(argv) - 1) if argv[i] == "--set"]


@dataclass(frozen=True)
class Saved:
    """One saved file, as its header describes it."""

    path: Path
    family: str
    identity: str
    n_tokens: int
    snap_pos: int
    state_bytes: int
    size: int
    mtime: float
    tokens: tuple[int, ...] = ()


def read_saved(path: Path, with_tokens: bool = True) -> Saved | None:
    """The header (and token ids) of a saved file, or None when it is not one (the engine checks the rest)."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read(HEADER.size)
            if len(raw) != HEADER.size:
                return None
            (magic, version, header_bytes, family, identity, _layers, _dim, _k_only, n_tokens, snap_pos, _r,
             state_bytes, payload, _sum) = HEADER.unpack(raw)
            if magic != MAGIC or version != VERSION or header_bytes != HEADER.size:
                return None
            if st.st_size != HEADER.size + payload or not 0 < n_tokens * 4 <= payload:
                return None
            tokens: tuple[int, ...] = ()
            if with_tokens:
                data = f.read(4 * n_tokens)
                if len(data) != 4 * n_tokens:
                    return None
                tokens = struct.unpack(f"<{n_tokens}i", data)
    except OSError:
        return None
    return Saved(path, family.rstrip(b"\0").decode("utf-8", "replace"),
                 identity.rstrip(b"\0").decode("utf-8", "replace"), n_tokens, snap_pos, state_bytes, st.st_size,
                 st.st_mtime, tokens)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def usable_tokens(saved: Saved, prompt: Sequence[int]) -> int:
    """The prompt tokens the engine would take from ``saved`` (engine.c load_slot's rule): the shared prefix, short
    of the prompt's last token (always recomputed for its logits); with a recurrent state only the whole file or
    its end-of-prompt checkpoint."""
    shared = common_prefix(saved.tokens, prompt[:max(0, len(prompt) - 1)])
    if not saved.state_bytes or shared == saved.n_tokens:
        return shared
    return saved.snap_pos if 0 < saved.snap_pos <= shared else 0


@dataclass(frozen=True)
class KVPlan:
    """What one submit asks of the engine: the file to load (if any) and where to save."""

    load: Path | None
    load_covers: int           # the loaded file's tokens the prompt extends (all of them: it is then superseded)
    load_tokens: int
    save: Path

    identity: str = ""

    def fields(self) -> dict[str, str]:
        out = {"kv_save": str(self.save), "kv_identity": self.identity}
        if self.load is not None:
            out["kv_load"] = str(self.load)
        return out


class KVStore:
    """The saved files of one model: ``root/<identity[:16]>/``, at most ``budget`` bytes."""

    def __init__(self, root: Path, identity: str, budget: int = DEFAULT_BUDGET_BYTES):
        self.identity = identity
        self.directory = root / identity[:16]
        self.budget = int(budget)
        self._lock = threading.Lock()
        self._tokens: dict[tuple[str, int, int], tuple[int, ...]] = {}   # (name, inode, size) -> token ids

    def describe(self, model_path: Path, family: str) -> None:
        """Name the model in the directory (``model.json``: what ``coli kv list`` shows and ``clear --model``
        matches); a failure only costs that label."""
        record = {"model": str(Path(model_path).resolve()), "name": Path(model_path).name, "family": family,
                  "identity": self.identity}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if describe_model(self.directory) == record:
                return
            tmp = self.directory / f"{MODEL_RECORD}.tmp.{os.getpid()}"
            tmp.write_text(json.dumps(record, indent=1) + "\n")
            os.replace(tmp, self.directory / MODEL_RECORD)
        except OSError as exc:
            log.warning("kv dir %s: %s (check --kv-dir)", self.directory, exc.strerror)

    def _scan(self) -> list[Saved]:
        try:
            paths = [p for p in self.directory.iterdir() if p.name.endswith(SUFFIX)]
        except OSError:
            return []
        found = []
        for path in paths:
            saved = read_saved(path, with_tokens=False)
            if saved is None or saved.identity != self.identity:
                continue
            try:
                st = path.stat()
            except OSError:
                continue
            key = (path.name, st.st_ino, st.st_size)
            tokens = self._tokens.get(key)
            if tokens is None:
                full = read_saved(path)
                if full is None:
                    continue
                tokens = self._tokens[key] = full.tokens
            found.append(Saved(path, saved.family, saved.identity, saved.n_tokens, saved.snap_pos,
                               saved.state_bytes, saved.size, saved.mtime, tokens))
        return found

    def plan(self, prompt: Sequence[int], ctx: int = 0) -> KVPlan | None:
        """The best file for ``prompt`` (the most tokens the engine can take from it, the whole file preferred;
        none longer than the engine's ``ctx``, which it would refuse) and the save path; None when the directory
        cannot be made (a warning: the turn runs without saving)."""
        with self._lock:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                log.warning("kv dir %s: %s; not saving (check --kv-dir)", self.directory, exc.strerror)
                return None
            best: Saved | None = None
            best_key = (0, False)
            for saved in self._scan():
                if ctx and saved.n_tokens > ctx:
                    continue
                usable = usable_tokens(saved, prompt)
                key = (usable, usable == saved.n_tokens)
                if usable > 0 and key > best_key:
                    best, best_key = saved, key
            if best is not None:
                _touch(best.path)
            material = self.identity.encode() + struct.pack(f"<{len(prompt)}i", *prompt)
            save = self.directory / (hashlib.sha256(material).hexdigest()[:32] + SUFFIX)
            return KVPlan(best.path if best else None, best_key[0], best.n_tokens if best else 0, save, self.identity)

    def warn(self, message: str) -> None:
        """A file the engine refused (it prefilled instead): one log line, never an error."""
        log.warning("%s; prefilled instead", message)

    def settle(self, plan: KVPlan, done: Mapping[str, Any]) -> None:
        """After a sequence's ``done``: drop the file the new save supersedes, then hold the budget."""
        with self._lock:
            if done.get("kv_saved_bytes") and plan.load is not None and plan.load != plan.save and \
                    plan.load_covers == plan.load_tokens:
                _unlink(plan.load)
            if done.get("kv_warning"):
                log.warning("%s", done["kv_warning"])
            self.enforce_budget()

    def enforce_budget(self) -> list[Path]:
        """Delete the least recently used files until the directory fits the budget; returns what went."""
        files = []
        now = time.time()
        try:
            entries = list(self.directory.iterdir())
        except OSError:
            return []
        for path in entries:
            try:
                st = path.stat()
            except OSError:
                continue
            if ".tmp." in path.name:
                if now - st.st_mtime > STALE_TMP_S:
                    _unlink(path)
                continue
            if path.name.endswith(SUFFIX):
                files.append((st.st_mtime, st.st_size, path))
        files.sort()
        total = sum(size for _, size, _ in files)
        gone = []
        for _, size, path in files:
            if total <= self.budget:
                break
            _unlink(path)
            total -= size
            gone.append(path)
        return gone


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def describe_model(directory: Path) -> dict[str, Any]:
    """A model directory's ``model.json`` ({} when missing or unreadable)."""
    try:
        data = json.loads((directory / MODEL_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def model_dirs(root: Path) -> Iterable[Path]:
    """Each model's directory under ``root``."""
    try:
        return sorted(p for p in root.iterdir() if p.is_dir())
    except OSError:
        return []


def saved_files(directory: Path) -> list[Saved]:
    """Every readable saved file in one model's directory, newest first (``coli kv list``)."""
    out = []
    try:
        paths = [p for p in directory.iterdir() if p.name.endswith(SUFFIX)]
    except OSError:
        return []
    for path in paths:
        saved = read_saved(path, with_tokens=False)
        if saved is not None:
            out.append(saved)
    return sorted(out, key=lambda s: -s.mtime)
