"""Kimi's tiktoken-format tokenizer, loaded without running the checkpoint's Python.

Kimi checkpoints ship ``tiktoken.model`` (one ``<base64 token bytes> <rank>`` per line) and a Python tokenizer
class instead of ``tokenizer.json``. The class's pre-tokenization regex cannot be read without executing it, so
``KIMI_PATTERN`` is the one every published Kimi/Moonlight tokenizer uses; ``tokenizer_config.json`` contributes
only the special tokens (``added_tokens_decoder``), the named ones (``bos_token``...) and the chat template.

The ranks become an equivalent ``tokenizers`` byte-level BPE: token bytes are spelled with the GPT-2
byte-to-unicode table, and every way of splitting a token into two known tokens becomes a merge, ordered by the
token's rank — tiktoken's "merge the adjacent pair whose concatenation ranks lowest", expressed as a merge list.
A regex piece that is itself a token is taken whole, as tiktoken does (``ignore_merges``). Special tokens sit at
``len(ranks)`` onward: the named ones from ``added_tokens_decoder``, the rest of the reserved block
``<|reserved_token_{id}|>``, as Kimi's own class fills it.

Converting ~160k ranks takes seconds, so the result is cached as a sidecar next to the model,
``.colibri-tokenizer-<digest>.json``, keyed by the bytes of ``tiktoken.model`` and ``tokenizer_config.json``
(an edited file makes a new digest; stale sidecars are removed). A read-only model directory caches under the
colibri cache instead.

Not reproduced: Kimi's class cuts runs of more than 25,000 consecutive whitespace (or non-whitespace) characters
before encoding; only text with such runs can tokenize differently.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

from colibri import chat_template as ct
from colibri.cachedir import cache_root
from colibri.errors import ConfigError
from colibri.tokenizer import TOKENIZER_FILE, TextTokenizer, tokenizer_from_backend

TIKTOKEN_FILE = "tiktoken.model"
SIDECAR_PREFIX = ".colibri-tokenizer-"
# Bumped whenever the conversion changes, so sidecars written by an older colibri are rebuilt.
CONVERTER_VERSION = "1"
RESERVED_SPECIAL_TOKENS = 256

# The ``pat_str`` of Kimi's tokenization_kimi.py (identical across Kimi K2, K2.5, Kimi Linear and Moonlight):
# Han runs on their own, letter runs with English contractions, numbers in groups of up to three, punctuation
# runs, then whitespace handling as in cl100k.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of every byte (what ``tokenizers``' ByteLevel pre-tokenizer produces)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def read_ranks(path: Path) -> dict[bytes, int]:
    """``tiktoken.model``: token bytes -> rank; ranks must be exactly 0..n-1 (special ids start at n)."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})", "check the file's permissions") from None
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (ValueError, binascii.Error):
            raise ConfigError(f"{path}:{number}: not '<base64 token> <rank>'",
                              "restore tiktoken.model from the original checkpoint") from None
        if token in ranks:
            raise ConfigError(f"{path}:{number}: token listed twice",
                              "restore tiktoken.model from the original checkpoint")
        ranks[token] = rank
    if not ranks:
        raise ConfigError(f"{path}: no tokens", "restore tiktoken.model from the original checkpoint")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ConfigError(f"{path}: ranks are not exactly 0..{len(ranks) - 1}",
                          "restore tiktoken.model from the original checkpoint")
    return ranks


def special_tokens(tok_config: Mapping[str, Any], num_base: int, where: str) -> dict[int, str]:
    """Special token id -> text: ``added_tokens_decoder``'s entries, the reserved block's gaps filled in."""
    named: dict[int, str] = {}
    for key, entry in (tok_config.get("added_tokens_decoder") or {}).items():
        content = entry.get("content") if isinstance(entry, Mapping) else None
        if not (isinstance(key, str) and key.isdigit() and isinstance(content, str) and content):
            raise ConfigError(f"{where}: added_tokens_decoder entry {key!r} needs an integer key and a 'content'",
                              "restore tokenizer_config.json from the original checkpoint")
        if int(key) < num_base:
            raise ConfigError(f"{where}: added_tokens_decoder id {key} is inside tiktoken.model's {num_base} ranks",
                              "tokenizer_config.json and tiktoken.model come from different checkpoints")
        named[int(key)] = content
    end = max([num_base + RESERVED_SPECIAL_TOKENS, *(i + 1 for i in named)])
    specials = {i: named.get(i, f"<|reserved_token_{i}|>") for i in range(num_base, end)}
    if len(set(specials.values())) != len(specials):
        raise ConfigError(f"{where}: added_tokens_decoder names one token twice",
                          "restore tokenizer_config.json from the original checkpoint")
    return specials


def bpe_merges(ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of every token into two tokens, in the order tiktoken would merge them (the token's rank)."""
    found = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                found.append((rank, ranks[left], ranks[right], left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def build_backend(ranks: Mapping[bytes, int], specials: Mapping[int, str], pattern: str = KIMI_PATTERN):
    """The ``tokenizers.Tokenizer`` equivalent to ``tiktoken.Encoding(pattern, ranks, specials)``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    spell = byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(spell[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(left), text(right)) for left, right in bpe_merges(ranks)]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    ordered = sorted(specials.items())
    backend.add_special_tokens([AddedToken(content, special=True, normalized=False) for _, content in ordered])
    for token_id, content in ordered:
        if backend.token_to_id(content) != token_id:
            raise ConfigError(f"special token {content!r} did not land on id {token_id}",
                              "its text collides with an ordinary token; restore the original tokenizer files")
    return backend


def _digest(model_dir: Path) -> str:
    h = hashlib.sha256(f"colibri-kimi tiktoken v{CONVERTER_VERSION}\0{KIMI_PATTERN}\0".encode())
    for name in (TIKTOKEN_FILE, ct.TOKENIZER_CONFIG):
        path = model_dir / name
        h.update(name.encode() + b"\0")
        h.update(path.read_bytes() if path.is_file() else b"<absent>")
        h.update(b"\0")
    return h.hexdigest()[:16]


def sidecar_candidates(model_dir: Path, digest: str) -> tuple[Path, Path]:
    """Where the converted tokenizer is cached: next to the model, else (read-only model) in colibri's cache."""
    name = f"{SIDECAR_PREFIX}{digest}.json"
    return model_dir / name, cache_root() / "tokenizers" / name


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _drop_stale(directory: Path, keep: Path) -> None:
    for old in directory.glob(f"{SIDECAR_PREFIX}*.json"):
        if old != keep:
            old.unlink(missing_ok=True)


def _cached_backend(path: Path):
    from tokenizers import Tokenizer

    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception:  # a truncated or foreign file is rebuilt, not trusted
        return None


def convert(model_dir: Path):
    """The converted backend for ``model_dir`` (from the sidecar when it is current) and where it is cached."""
    digest = _digest(model_dir)
    candidates = sidecar_candidates(model_dir, digest)
    for path in candidates:
        backend = _cached_backend(path)
        if backend is not None:
            return backend, path
    tok_config = ct.read_json_file(model_dir / ct.TOKENIZER_CONFIG) or {}
    ranks = read_ranks(model_dir / TIKTOKEN_FILE)
    backend = build_backend(ranks, special_tokens(tok_config, len(ranks), str(model_dir / ct.TOKENIZER_CONFIG)))
    serialized = backend.to_str()
    for path in candidates:
        try:
            _atomic_write(path, serialized)
        except OSError:
            continue                      # read-only model directory: try colibri's cache
        if path.parent == model_dir:      # the shared cache holds other models' sidecars: leave those
            _drop_stale(model_dir, path)
        return backend, path
    return backend, None                  # nowhere writable: converted again next time


def load_tiktoken_tokenizer(model_dir: Path, config: Mapping[str, Any] | None = None) -> TextTokenizer | None:
    """The tokenizer of a Kimi checkpoint that ships ``tiktoken.model``; ``None`` when it ships none (then core's
    ``tokenizer.json`` loader answers)."""
    if not (model_dir / TIKTOKEN_FILE).is_file():
        if not (model_dir / TOKENIZER_FILE).is_file():
            raise ConfigError(f"{model_dir}: neither tiktoken.model nor tokenizer.json in the checkpoint",
                              "copy tiktoken.model and tokenizer_config.json from the original model repository")
        return None
    backend, cached = convert(model_dir)
    return tokenizer_from_backend(backend, model_dir, config, cached or model_dir / TIKTOKEN_FILE)
