"""A tiny random-weight Stable-Diffusion-style pipeline for tests (``colibri.testing.tiny.tiny_model("diffusers",
...)``), built with diffusers and transformers.

Registered under the entry-point group ``colibri.testing.tiny``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from colibri.testing.tiny import VOCAB, TinyModel, cast_dtype, redraw_weights, stored_elements, training_text


def build_diffusers_pipeline(out_dir: str | os.PathLike, *, seed: int = 0, dtype: str = "float32",
                             **overrides: Any) -> TinyModel:
    """A tiny Stable-Diffusion-style pipeline (UNet2DCondition + AutoencoderKL + CLIP text encoder + DDIM).

    ``overrides`` go to the UNet config (e.g. ``block_out_channels=(32, 64)``). ``num_parameters`` is the sum over
    the components' parameters.
    """
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    out = Path(out_dir)
    torch.manual_seed(seed)
    unet_cfg: dict[str, Any] = dict(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)
    unet_cfg.update(overrides)
    unet = UNet2DConditionModel(**unet_cfg)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), latent_channels=4,
                        norm_num_groups=8, layers_per_block=1, sample_size=16)
    text_encoder = CLIPTextModel(CLIPTextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=1, num_attention_heads=2,
                                                max_position_embeddings=32, projection_dim=32,
                                                bos_token_id=0, eos_token_id=1, pad_token_id=1))
    tok_dir = Path(tempfile.mkdtemp(prefix="colibri-clip-tok-"))
    try:
        tokenizer = _clip_tokenizer(tok_dir, CLIPTokenizer)
        components = {"unet": unet, "vae": vae, "text_encoder": text_encoder}
        for comp in components.values():
            redraw_weights(comp, seed)
            cast_dtype(comp, dtype)
        pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                       scheduler=DDIMScheduler(num_train_timesteps=1000, steps_offset=1,
                                                                          clip_sample=False), safety_checker=None,
                                       feature_extractor=None, requires_safety_checker=False)
        pipe.save_pretrained(str(out), safe_serialization=True)
    finally:
        shutil.rmtree(tok_dir, ignore_errors=True)
    total = sum(sum(p.numel() for p in c.parameters()) for c in components.values())
    return TinyModel(out, "diffusers", "diffusers", int(total), stored_elements(out))


def _clip_tokenizer(tmp: Path, tokenizer_cls: Any) -> Any:
    """A CLIP tokenizer over a BPE trained on the offline corpus (vocab.json + merges.txt)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|startoftext|>", "<|endoftext|>"],
                                  end_of_word_suffix="</w>", initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(training_text(), trainer=trainer)
    tok.model.save(str(tmp))
    merges = tmp / "merges.txt"
    lines = merges.read_text(encoding="utf-8").splitlines()
    if not lines or not lines[0].startswith("#version"):
        merges.write_text("#version: 0.2\n" + "\n".join(lines) + "\n", encoding="utf-8")
    return tokenizer_cls(vocab_file=str(tmp / "vocab.json"), merges_file=str(merges), model_max_length=32)


TINY_MODELS = {"diffusers": build_diffusers_pipeline}
