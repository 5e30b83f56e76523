"""A real byte-level BPE tokenizer trained on text every Python install ships (the standard library's sources).

Used by ``coli demo`` for its synthetic checkpoint and by tests that need a genuine tokenizer without a download.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, Sequence

EOS = "<|endoftext|>"
CHAT_TOKENS = ("<|user|>", "<|assistant|>", "<|system|>")


def stdlib_texts(max_bytes: int = 4_000_000) -> Iterator[str]:
    """Source files of the running interpreter's standard library, up to ``max_bytes`` in total (sorted, so the
    same interpreter always yields the same corpus)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield text
        total += len(text)
        if total >= max_bytes:
            return


def train_bpe(texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = (EOS, *CHAT_TOKENS)):
    """A GPT-2-style byte-level BPE (every byte representable, so any text round-trips)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_tokenizer_files(directory: Path, tok, chat_template: str | None = None, eos: str = EOS) -> None:
    """tokenizer.json and a tokenizer_config.json naming the special tokens (and the chat template, if any)."""
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eos, "eos_token": eos, "unk_token": eos,
              "model_max_length": 4096, "clean_up_tokenization_spaces": False}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
