"""A checkpoint's tokenizer: ``tokenizer.json`` via the ``tokenizers`` library, its special tokens, its stop ids
and its chat template. No transformers, no torch.

Special tokens come from ``tokenizer_config.json`` (a string, or an AddedToken dict with ``content``), filled in
from the legacy ``special_tokens_map.json``. Stop ids are the union of ``generation_config.json``'s and
``config.json``'s ``eos_token_id`` (an int or a list) and the id of the tokenizer's ``eos_token``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from . import chat_template as ct
from .errors import ConfigError
from .records import PreTokenizerSplit

TOKENIZER_FILE = "tokenizer.json"


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


@dataclass
class TextTokenizer:
    """Text <-> ids for one checkpoint, plus what prompts need: special tokens, stop ids, chat template."""

    backend: Any                                   # tokenizers.Tokenizer
    special_tokens: dict[str, str]                 # bos_token, eos_token, ... as transformers names them
    stop_ids: tuple[int, ...]
    templates: dict[str, ct.ChatTemplate] = field(default_factory=dict)
    source: Path | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return self.backend.token_to_id(bos) if bos else None

    @property
    def has_chat_template(self) -> bool:
        return bool(self.templates)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As ``tokenizer(text).input_ids``: the tokenizer's own post-processor adds BOS and the like."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    template: str | None = None, **kwargs: Any) -> str:
        chosen = ct.select_template(self.templates, template, with_tools=kwargs.get("tools") is not None)
        if chosen is None:
            raise ConfigError(f"{self.source}: the checkpoint has no chat template", "use --raw for plain text")
        return ct.render(chosen, messages, special_tokens=self.special_tokens,
                         add_generation_prompt=add_generation_prompt, **kwargs)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """As ``apply_chat_template(..., tokenize=True)``: the rendered text already holds its special tokens."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs), add_special_tokens=False)


def convert_hint(model_dir: Path) -> str:
    """How to write the tokenizer.json colibri reads, once, from the files transformers' slow tokenizers read."""
    return (f"write tokenizer.json once with transformers: python -c \"from transformers import AutoTokenizer; "
            f"AutoTokenizer.from_pretrained('{model_dir}').save_pretrained('{model_dir}')\"")


def load_tokenizer_dir(model_dir: Path, config: Mapping[str, Any] | None = None) -> TextTokenizer:
    """The tokenizer of a plain Hugging Face checkpoint directory: ``tokenizer.json``, else a GPT-2-style
    ``vocab.json`` + ``merges.txt`` converted as transformers converts them. A sentencepiece ``tokenizer.model``
    alone is refused with the command that writes its tokenizer.json (converting it needs sentencepiece and
    protobuf, which colibri does not depend on)."""
    from tokenizers import Tokenizer

    path = model_dir / TOKENIZER_FILE
    if not path.is_file():
        if all((model_dir / name).is_file() for name in BPE_FILES):
            return tokenizer_from_backend(byte_level_bpe(model_dir), model_dir, config, model_dir / BPE_FILES[0])
        if (model_dir / SENTENCEPIECE_FILE).is_file():
            raise ConfigError(f"{model_dir / SENTENCEPIECE_FILE}: a sentencepiece model and no tokenizer.json",
                              convert_hint(model_dir))
        raise ConfigError(f"{path}: no tokenizer.json in the checkpoint (nor vocab.json + merges.txt)",
                          "copy tokenizer.json from the original model repository into the directory")
    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise ConfigError(f"{path}: not a tokenizers file ({str(exc).splitlines()[0] if str(exc) else exc})",
                          "restore tokenizer.json from the original checkpoint") from None
    return tokenizer_from_backend(backend, model_dir, config, path)


BPE_FILES = ("vocab.json", "merges.txt")
SENTENCEPIECE_FILE = "tokenizer.model"


def pre_tokenizer_split(model_dir: Path, tokenizer_class: str | None) -> PreTokenizerSplit:
    """The split rule of the class that wrote vocab.json + merges.txt, as the families know it (the
    ``byte_level_split`` hook; no class: GPT-2's). Classes that ship the same two files split differently, so one
    nobody knows is refused rather than tokenized almost right."""
    if tokenizer_class is None:
        return PreTokenizerSplit()
    from . import hooks   # the plugin layer sits above the tokenizer (hooks -> decision -> tokenizer)

    split = hooks.byte_level_split(tokenizer_class)
    if split is None:
        raise ConfigError(f"{model_dir}: vocab.json + merges.txt of a {tokenizer_class} and no tokenizer.json (no "
                          f"installed family converts that tokenizer class)", convert_hint(model_dir))
    return split


def byte_level_bpe(model_dir: Path) -> Any:
    """vocab.json + merges.txt as transformers' GPT-2 converter builds them: byte-level BPE, the byte-level
    pre-tokenizer (``add_prefix_space`` from tokenizer_config.json), decoder and post-processor, and the added
    tokens of ``added_tokens_decoder`` plus the named special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tok_config = ct.read_json_file(model_dir / ct.TOKENIZER_CONFIG) or {}
    cls = tok_config.get("tokenizer_class")
    split = pre_tokenizer_split(model_dir, None if cls is None else str(cls))
    vocab, merges = (str(model_dir / name) for name in BPE_FILES)
    try:
        model = models.BPE.from_file(vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False)
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise ConfigError(f"{model_dir}: vocab.json + merges.txt do not load ({str(exc).splitlines()[0]})",
                          "restore them from the original checkpoint") from None
    backend = Tokenizer(model)
    prefix_space = bool(tok_config.get("add_prefix_space"))
    if split.nfc:
        backend.normalizer = normalizers.NFC()
    if split.pattern is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=prefix_space, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    added = tok_config.get("added_tokens_decoder") or {}
    for _, spec in sorted(added.items(), key=lambda item: int(item[0])):
        if isinstance(spec, Mapping) and isinstance(spec.get("content"), str):
            token = AddedToken(spec["content"], single_word=bool(spec.get("single_word")),
                               lstrip=bool(spec.get("lstrip")), rstrip=bool(spec.get("rstrip")),
                               normalized=bool(spec.get("normalized", not spec.get("special"))),
                               special=bool(spec.get("special")))
            (backend.add_special_tokens if spec.get("special") else backend.add_tokens)([token])
    named = [_token_text(tok_config.get(name)) for name in ct.SPECIAL_TOKEN_NAMES]
    backend.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in named if text])
    return backend


def tokenizer_from_backend(backend: Any, model_dir: Path, config: Mapping[str, Any] | None = None,
                           source: Path | None = None) -> TextTokenizer:
    """A :class:`TextTokenizer` around an already built ``tokenizers.Tokenizer``: special tokens, stop ids and chat
    templates read from ``model_dir`` as for a plain checkpoint (families that convert another tokenizer format
    share this so their stop ids and templates follow the same rules)."""
    tok_config = ct.read_json_file(model_dir / ct.TOKENIZER_CONFIG) or {}
    legacy_map = ct.read_json_file(model_dir / "special_tokens_map.json") or {}
    special: dict[str, str] = {}
    for name in ct.SPECIAL_TOKEN_NAMES:
        text = _token_text(tok_config.get(name))
        if text is None:
            text = _token_text(legacy_map.get(name))
        if text is not None:
            special[name] = text

    stop: list[int] = []
    gen_config = ct.read_json_file(model_dir / "generation_config.json") or {}
    for declared in (gen_config, config or {}, (config or {}).get("text_config") or {}):
        stop += _ids(declared.get("eos_token_id"))
    eos = special.get("eos_token")
    if eos is not None and backend.token_to_id(eos) is not None:
        stop.append(backend.token_to_id(eos))
    templates = ct.available_templates(model_dir, tok_config)
    return TextTokenizer(backend, special, tuple(dict.fromkeys(stop)), templates, source)
