"""Tiny random-weight checkpoints, built with transformers/diffusers at test time.

Nothing here is downloaded: every checkpoint is created from a config, its weights are re-drawn from a seed at
O(1) scale (HF's 0.02 init makes routing near-uniform, which hides routing bugs), and it is saved with the
library's own ``save_pretrained`` so tensor names and config.json spellings are exactly what real checkpoints
of that architecture use. Text models also get a small *real* byte-level BPE tokenizer trained offline, with a
chat template in the family's style.

API (stable; other packages' tests build on it)::

    from colibri.testing.tiny import tiny_model, build_text_model, KINDS

    built = tiny_model("qwen3_moe", tmp_root, seed=0, dtype="float32", num_experts=32, top_k=8)
    built.path                 # Path of the checkpoint directory
    built.num_parameters       # transformers' ``model.num_parameters()`` (diffusers: sum over components)
    built.num_stored_elements  # elements in the safetensors files (parameters + persistent buffers such as
                               # ``e_score_correction_bias`` and ``tid2eid``); what a header count reports
    built.kind, built.model_type

``tiny_model(kind, tmp_root, **options)`` memoises by its arguments (in-process, and across processes through a
sidecar ``<dir>.json`` written after a complete build), so a session fixture that passes the same ``tmp_root``
builds each variant once. ``KINDS`` lists every registered kind, ``TEXT_KINDS`` the causal LMs among them.

The kinds are family knowledge and live in the family packages: each registers a mapping kind -> recipe under the
entry-point group ``colibri.testing.tiny`` (a :class:`TextRecipe`: the config fields, layer count and
:class:`ChatStyle` of its tokenizer, built here with transformers; or a builder function for checkpoints that are
not causal LMs, such as a diffusers pipeline)::

    [project.entry-points."colibri.testing.tiny"]
    mixtral = "colibri_mixtral.tiny:TINY_MODELS"     # {"mixtral": TextRecipe("mixtral", 2, fields, STYLE)}

Options: ``seed`` (weights only; the tokenizer is fixed), ``dtype`` (``"float32"`` default, or ``"bfloat16"``:
router/bias tensors transformers keeps in f32 stay f32), and geometry overrides merged into the config. Text kinds
also take ``chat_template_in="tokenizer_config"`` (default) or ``"jinja"`` (a separate ``chat_template.jinja``).
Generic override names are translated to the family's own field: ``num_experts``, ``top_k``, ``num_kv_heads``,
``num_layers``, ``n_group``; any other key is passed to the config as is (e.g. ``norm_topk_prob``,
``tie_word_embeddings``, ``first_k_dense_replace``, ``index_topk``). Per-layer lists (``layer_types``,
``mlp_layer_types``) are regenerated for an overridden layer count unless given explicitly.

Tiny geometry: vocab 512, hidden 64, 4 heads, 16 experts top-4 (expert width 32), n_group 4 / topk_group 2
where the family groups, one leading dense layer where the family has them, 4 layers (3 linear + 1 full) for
hybrids. ``generation_config.json`` has ``eos_token_id: null`` and ``do_sample: false`` so ``generate`` runs the
full length for comparisons; the stop token is in config.json (``eos_token_id``) and tokenizer_config.json.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import sysconfig
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

VOCAB = 512
HIDDEN = 64


@dataclass(frozen=True)
class TinyModel:
    """A built checkpoint directory and its sizes."""

    path: Path
    kind: str
    model_type: str
    num_parameters: int
    num_stored_elements: int


# ---------------------------------------------------------------------------------------------------------------
# Recipes. The kinds themselves live in the family packages (each registers a mapping kind -> recipe under the
# entry-point group ``colibri.testing.tiny``); core keeps the machinery and the pieces several families share.


@dataclass(frozen=True)
class ChatStyle:
    """A tokenizer's special tokens and chat template, in a family's style."""

    specials: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    template: str


@dataclass(frozen=True)
class TextRecipe:
    """How to build one tiny causal LM kind with transformers.

    ``fields(n)`` returns the family's own config fields for ``n`` layers (per-layer lists come from it, so a
    layer-count override regenerates them). ``vision_config``, when set, builds an image-text-to-text wrapper with
    the fields as its ``text_config``. ``saved_model_type`` rewrites config.json's ``model_type`` after saving, for
    checkpoints that ship one architecture under their own name."""

    model_type: str            # what transformers builds
    layers: int
    fields: Callable[[int], dict[str, Any]]
    style: ChatStyle
    vision_config: Mapping[str, Any] | None = None
    saved_model_type: str | None = None


Builder = Callable[..., "TinyModel"]   # (out_dir, *, seed, dtype, **overrides) -> TinyModel, for non-LM kinds
ENTRY_POINT_GROUP = "colibri.testing.tiny"


def recipes() -> dict[str, TextRecipe | Builder]:
    """Every registered kind: each entry point of ``colibri.testing.tiny`` names a mapping kind -> recipe (a
    ``TextRecipe``, or a builder function for other checkpoints). Loaded once per process."""
    if not _recipes:
        from importlib import metadata

        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            _recipes.update(ep.load())
    return _recipes


_recipes: dict[str, TextRecipe | Builder] = {}


def __getattr__(name: str) -> Any:
    # KINDS / TEXT_KINDS are computed on first use: the family modules that register recipes import this one.
    if name == "KINDS":
        return tuple(recipes())
    if name == "TEXT_KINDS":
        return tuple(k for k, r in recipes().items() if isinstance(r, TextRecipe))
    raise AttributeError(name)


def hybrid_layer_types(n: int) -> list[str]:
    """One full-attention layer after every three linear ones (Qwen3-Next / Qwen3.5 / Kimi Linear)."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


def dense_then_sparse(n: int) -> list[str]:
    """``mlp_layer_types``: one leading dense layer, then MoE."""
    return ["dense" if i < 1 else "sparse" for i in range(n)]


def mla_fields(q_lora_rank: int | None = 48) -> dict[str, Any]:
    """Tiny multi-head latent attention dimensions."""
    return dict(kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)


def grouped_moe_mla_fields(n: int) -> dict[str, Any]:
    """Tiny fields of the sigmoid grouped-MoE + MLA config schema (DeepSeek-V3's, which Kimi K2 and GLM's MLA
    types share): one leading dense layer, 16 experts top-4 in 4 groups keeping 2, one shared expert."""
    return dict(num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                **mla_fields())


# Generic override names -> the field each family's config spells them with (first one the config has).
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_experts": ("n_routed_experts", "num_experts", "num_local_experts"),
    "top_k": ("num_experts_per_tok", "num_experts_per_token"),
    "num_kv_heads": ("num_key_value_heads",),
    "num_layers": ("num_hidden_layers",),
    "n_group": ("n_group", "num_expert_group"),
}


def tiny_config(kind: str, **overrides: Any) -> dict[str, Any]:
    """The config fields ``tiny_model(kind, ..., **overrides)`` builds with (the family's own spellings)."""
    return _tiny_fields(kind, overrides)


def _tiny_fields(kind: str, overrides: dict[str, Any]) -> dict[str, Any]:
    spec = _text_recipe(kind)
    overrides = dict(overrides)
    n = int(overrides.pop("num_layers", overrides.pop("num_hidden_layers", spec.layers)))
    fields = {"vocab_size": VOCAB, "hidden_size": HIDDEN, **spec.fields(n)}
    if "model_max_length" not in fields:     # a config that states its context under the tokenizer's name
        fields.setdefault("max_position_embeddings", 4096)
    for key, value in overrides.items():
        targets = _ALIASES.get(key, (key,))
        target = next((t for t in targets if t in fields), targets[0])
        fields[target] = value
    return fields


# ---------------------------------------------------------------------------------------------------------------
# Weights

# Tensors whose trailing name marks an additive parameter (drawn like a bias whatever its shape).
_BIAS_LIKE = ("A_log", "dt_bias", "attn_sink", "sinks", "_base", "_scale")
_CORRECTION_BIAS_STD = 0.25  # large enough that the selection bias changes which experts win


def redraw_weights(model: Any, seed: int, num_experts: int | None = None, salt: str = "") -> None:
    """Re-draw every stored tensor of ``model`` at O(1) scale from ``seed`` (order-independent per name).

    ``salt`` (the kind) keeps two kinds with one architecture from getting identical weights.
    Matrices N(0, 1/fan_in); norm weights 1 + 0.1·N; biases and bias-like tensors 0.1·N;
    ``e_score_correction_bias`` 0.25·N; integer ``tid2eid`` tables uniform over ``num_experts``.
    """
    import torch

    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            digest = hashlib.sha256(f"{seed}:{salt}:{name}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
            if not tensor.is_floating_point():
                if name.endswith("tid2eid"):
                    if not num_experts:
                        raise ValueError(f"{name}: redraw needs num_experts for the hash-routing table")
                    tensor.copy_(_distinct_experts(tensor.shape, num_experts, gen))
                continue
            shape = tuple(tensor.shape)
            noise = torch.randn(shape, generator=gen, dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("e_score_correction_bias"):
                value = _CORRECTION_BIAS_STD * noise
            elif leaf == "bias" or any(name.endswith(s) for s in _BIAS_LIKE):
                value = 0.1 * noise
            elif len(shape) == 1 and "norm" in name.lower():
                value = 1.0 + 0.1 * noise
            elif len(shape) >= 2:
                value = noise / math.sqrt(math.prod(shape[1:]))
            else:
                value = 0.1 * noise
            tensor.copy_(value.to(tensor.dtype))


def _distinct_experts(shape: tuple[int, ...], num_experts: int, gen: Any) -> Any:
    """A token -> top_k table of distinct experts per token (hash routing never picks one expert twice)."""
    import torch

    rows, k = shape
    return torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(rows)]).to(torch.long)


def cast_dtype(model: Any, dtype: str) -> None:
    import torch

    if dtype in ("float32", "f32", "fp32"):
        return
    if dtype not in ("bfloat16", "bf16"):
        raise ValueError(f"dtype {dtype!r}: use 'float32' or 'bfloat16'")
    keep = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    model.to(torch.bfloat16)
    for name, param in list(model.named_parameters()) + list(model.named_buffers()):
        if param.is_floating_point() and any(k in name for k in keep):
            param.data = param.data.float()


def stored_elements(directory: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in sorted(directory.rglob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                total += math.prod(handle.get_slice(key).get_shape())
    return total


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer

_CORPUS_PARAGRAPH = """\
Colibri runs mixture-of-experts language models on machines whose memory is smaller than the model. Dense
weights stay resident; routed experts are read from disk when the router picks them and kept in a bounded cache.
Placement may change speed, never the tokens. The quick brown fox jumps over the lazy dog; pack my box with five
dozen liquor jugs. 0123456789 + - * / = < > ( ) [ ] { } : ; , . ! ? ' " # @ $ % ^ & _ ~ `
"""

_STDLIB_SOURCES = ("textwrap.py", "string.py", "json/decoder.py", "this.py")


def training_text() -> list[str]:
    """A fixed offline corpus: one embedded paragraph plus a few stdlib source files read from disk."""
    texts = [_CORPUS_PARAGRAPH] * 4
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for rel in _STDLIB_SOURCES:
        path = stdlib / rel
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return texts


def train_tokenizer(out_dir: Path, style: ChatStyle | str, vocab_size: int = VOCAB, max_length: int = 4096,
                    chat_template_in: str = "tokenizer_config") -> dict[str, int | None]:
    """Train a byte-level BPE on the fixed offline corpus and save it in HF layout.

    ``style`` is a :class:`ChatStyle`, or the name of a registered text kind whose style to use.
    Writes ``tokenizer.json`` and ``tokenizer_config.json`` (with the style's ``chat_template`` when
    ``chat_template_in`` is ``"tokenizer_config"``, or a separate ``chat_template.jinja`` when ``"jinja"``).
    Returns the special-token ids: ``{"bos": ..., "eos": ..., "pad": ...}``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    spec = style if isinstance(style, ChatStyle) else _text_recipe(style).style
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(spec.specials), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(training_text(), trainer=trainer)
    tok.add_special_tokens(list(spec.specials))
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos, "eos_token": spec.eos, "pad_token": spec.pad, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    if chat_template_in == "tokenizer_config":
        config["chat_template"] = spec.template
    elif chat_template_in == "jinja":
        (out_dir / "chat_template.jinja").write_text(spec.template, encoding="utf-8")
    else:
        raise ValueError(f"chat_template_in {chat_template_in!r}: use 'tokenizer_config' or 'jinja'")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
    ids = {key: (tok.token_to_id(t) if t else None) for key, t in (("bos", spec.bos), ("eos", spec.eos),
                                                                    ("pad", spec.pad))}
    return ids


# ---------------------------------------------------------------------------------------------------------------
# Builders

def build_text_model(kind: str, out_dir: str | os.PathLike, *, seed: int = 0, dtype: str = "float32",
                     chat_template_in: str = "tokenizer_config", **overrides: Any) -> TinyModel:
    """Build one tiny causal LM of ``kind`` (see ``TEXT_KINDS``) into ``out_dir`` (created; must not exist)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    spec = _text_recipe(kind)
    out = Path(out_dir)
    fields = _tiny_fields(kind, overrides)
    max_length = int(fields.get("max_position_embeddings") or fields.get("model_max_length") or 4096)
    ids = train_tokenizer(out, spec.style, VOCAB, max_length, chat_template_in)
    token_ids = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]}

    torch.manual_seed(seed)
    if spec.vision_config is not None:
        config = AutoConfig.for_model(
            spec.model_type, text_config={**fields, **token_ids}, tie_word_embeddings=fields.get(
                "tie_word_embeddings", False), vision_config=dict(spec.vision_config))
        model = transformers.AutoModelForImageTextToText.from_config(config)
    else:
        config = AutoConfig.for_model(spec.model_type, **fields, **token_ids)
        model = AutoModelForCausalLM.from_config(config)
    num_experts = fields.get("n_routed_experts") or fields.get("num_experts")
    redraw_weights(model, seed, num_experts, salt=kind)
    cast_dtype(model, dtype)
    model.generation_config = GenerationConfig(bos_token_id=ids["bos"], eos_token_id=None,
                                               pad_token_id=ids["pad"], do_sample=False)
    model.save_pretrained(str(out), safe_serialization=True)
    if spec.saved_model_type:
        path = out / "config.json"
        data = json.loads(path.read_text(encoding="utf-8"))
        data["model_type"] = spec.saved_model_type
        write_json(path, data)
    model_type = json.loads((out / "config.json").read_text(encoding="utf-8"))["model_type"]
    return TinyModel(out, kind, model_type, int(model.num_parameters()), stored_elements(out))


def _text_recipe(kind: str) -> TextRecipe:
    recipe = recipes().get(kind)
    if not isinstance(recipe, TextRecipe):
        text = [k for k, r in recipes().items() if isinstance(r, TextRecipe)]
        raise ValueError(f"unknown tiny text kind {kind!r}; choose from {', '.join(text) or 'none installed'}")
    return recipe


# ---------------------------------------------------------------------------------------------------------------
# Memoised entry point

_memo: dict[str, TinyModel] = {}
_lock = threading.Lock()


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def tiny_model(kind: str, tmp_root: str | os.PathLike, *, seed: int = 0, dtype: str = "float32",
               **overrides: Any) -> TinyModel:
    """Build (or reuse) the tiny checkpoint ``kind`` under ``tmp_root``; see the module docstring."""
    if kind not in recipes():
        raise ValueError(f"unknown tiny model kind {kind!r}; choose from {', '.join(recipes()) or 'none'} "
                         f"(family packages register kinds under the entry-point group {ENTRY_POINT_GROUP})")
    key_data = json.dumps({"kind": kind, "seed": seed, "dtype": dtype, **overrides}, sort_keys=True, default=str)
    digest = hashlib.sha256(key_data.encode()).hexdigest()[:12]
    root = Path(tmp_root).resolve()
    out = root / f"{kind}-{digest}"
    sidecar = root / f"{kind}-{digest}.json"
    memo_key = f"{root}|{key_data}"
    with _lock:
        if memo_key in _memo and _memo[memo_key].path.is_dir():
            return _memo[memo_key]
        root.mkdir(parents=True, exist_ok=True)
        with _file_lock(root / f".{kind}-{digest}.lock"):   # parallel test processes build a variant once
            if sidecar.is_file() and out.is_dir():
                data = json.loads(sidecar.read_text(encoding="utf-8"))
                built = TinyModel(Path(data["path"]), data["kind"], data["model_type"], data["num_parameters"],
                                  data["num_stored_elements"])
            else:
                built = _build_into(kind, out, seed, dtype, overrides)
                record = asdict(built)
                record["path"] = str(out)
                write_json(sidecar, record)
        _memo[memo_key] = built
        return built


def _build_into(kind: str, out: Path, seed: int, dtype: str, overrides: dict[str, Any]) -> TinyModel:
    """Build in a staging directory beside ``out`` and rename it into place, so ``out`` is always complete."""
    staging = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=out.parent))
    shutil.rmtree(staging)
    try:
        recipe = recipes()[kind]
        if isinstance(recipe, TextRecipe):
            built = build_text_model(kind, staging, seed=seed, dtype=dtype, **overrides)
        else:
            built = recipe(staging, seed=seed, dtype=dtype, **overrides)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return TinyModel(out, built.kind, built.model_type, built.num_parameters, built.num_stored_elements)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
