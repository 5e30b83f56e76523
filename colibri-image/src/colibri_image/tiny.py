"""A tiny random-weight Stable-Diffusion-style pipeline for tests (``colibri.testing.tiny.tiny_model("diffusers",
...)``), built with diffusers and transformers.

Registered under the entry-point group ``colibri.testing.tiny``.
"""

from __future__ import annotations

import json
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


QWEN_STYLE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_qwen_image_pipeline(out_dir: str | os.PathLike, *, seed: int = 0, dtype: str = "float32",
                              text: dict[str, Any] | None = None, vae: dict[str, Any] | None = None,
                              **overrides: Any) -> TinyModel:
    """A tiny QwenImagePipeline: Qwen2.5-VL text encoder, QwenImageTransformer2DModel, AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler with Qwen-Image's scheduler settings (dynamic shift, terminal stretch).

    ``overrides`` go to the transformer config (e.g. ``num_layers=3``), ``text`` to the text encoder's
    ``text_config`` and ``vae`` to the VAE (the benchmark builds real widths with fewer layers this way).
    """
    import torch
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from colibri.testing.tiny import ChatStyle, train_tokenizer

    out = Path(out_dir)
    torch.manual_seed(seed)
    text_cfg: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    text_cfg.update(text or {})
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=text_cfg,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0])))
    dit_cfg: dict[str, Any] = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
    dit_cfg.update(overrides)
    transformer = QwenImageTransformer2DModel(**dit_cfg)
    vae_cfg: dict[str, Any] = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                                   temperal_downsample=[False, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                                   latents_std=[1.5, 0.8, 1.2, 2.0])
    vae_cfg.update(vae or {})
    vae_model = AutoencoderKLQwenImage(**vae_cfg)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    tok_dir = Path(tempfile.mkdtemp(prefix="colibri-qwen-tok-"))
    try:
        train_tokenizer(tok_dir, ChatStyle(QWEN_STYLE_SPECIALS, None, "<|im_end|>", "<|endoftext|>", ""))
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
        components = {"text_encoder": text_encoder, "transformer": transformer, "vae": vae_model}
        for comp in components.values():
            redraw_weights(comp, seed)
            cast_dtype(comp, dtype)
        pipe = QwenImagePipeline(scheduler=scheduler, vae=vae_model, text_encoder=text_encoder, tokenizer=tokenizer,
                                 transformer=transformer)
        pipe.save_pretrained(str(out), safe_serialization=True)
    finally:
        shutil.rmtree(tok_dir, ignore_errors=True)
    total = sum(sum(p.numel() for p in c.parameters()) for c in components.values())
    return TinyModel(out, "qwen-image", "diffusers", int(total), stored_elements(out))


TINY_MODELS["qwen-image"] = build_qwen_image_pipeline


QWEN3_VL_SPECIALS = QWEN_STYLE_SPECIALS + ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# The part of Qwen3-VL's chat template the pipeline uses (it tokenizes the system turn to know how much to drop).
QWEN3_VL_TEMPLATE = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['content'] is string -%}{{ m['content'] }}{%- else -%}"
    "{%- for c in m['content'] -%}{%- if c['type'] == 'text' -%}{{ c['text'] }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}{{ '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


def prompt_only_processor(image_processor: Any, tokenizer: Any, chat_template: str | None = None) -> Any:
    """A Qwen3VLProcessor without its video processor (which wants torchvision, not installable here): enough for
    prompt-only generation. Load a saved one with ``prompt_only_processor_from(folder)``."""
    from transformers import Qwen3VLProcessor

    class PromptOnlyQwen3VLProcessor(Qwen3VLProcessor):
        @classmethod
        def get_attributes(cls) -> list[str]:
            return [name for name in super().get_attributes() if name != "video_processor"]

    return PromptOnlyQwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                                      chat_template=chat_template)


def prompt_only_processor_from(folder: str | os.PathLike) -> Any:
    """The prompt-only processor of a saved pipeline's ``processor/`` folder (for diffusers' from_pretrained)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    folder = Path(folder)
    template = folder / "chat_template.jinja"
    return prompt_only_processor(Qwen2VLImageProcessorPil(), AutoTokenizer.from_pretrained(str(folder)),
                                 template.read_text(encoding="utf-8") if template.is_file() else None)


def build_qwen_image21_pipeline(out_dir: str | os.PathLike, *, seed: int = 0, dtype: str = "float32",
                                text: dict[str, Any] | None = None, vae: dict[str, Any] | None = None,
                                sample_sigmas: list[float] | None = None, **overrides: Any) -> TinyModel:
    """A tiny QwenImage21Pipeline: Qwen3-VL text encoder (its processor without the video part, which wants
    torchvision), QwenImage21Transformer2DModel, AutoencoderKLQwenImage21 (16x like the real one: five levels),
    FlowMatchEulerDiscreteScheduler with dynamic shift and terminal stretch.

    ``overrides`` go to the transformer config, ``text`` to the text encoder's ``text_config``, ``vae`` to the VAE;
    ``sample_sigmas`` is the pipeline's configured sigma grid.
    """
    import torch
    from diffusers import (AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline,
                           QwenImage21Transformer2DModel)
    from transformers import (PreTrainedTokenizerFast, Qwen2VLImageProcessorPil, Qwen3VLConfig,
                              Qwen3VLForConditionalGeneration)

    from colibri.testing.tiny import ChatStyle, train_tokenizer

    out = Path(out_dir)
    torch.manual_seed(seed)
    tok_dir = Path(tempfile.mkdtemp(prefix="colibri-qwen3-tok-"))
    try:
        train_tokenizer(tok_dir, ChatStyle(QWEN3_VL_SPECIALS, None, "<|im_end|>", "<|endoftext|>", ""))
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
        ids = {name: tokenizer.convert_tokens_to_ids(name) for name in QWEN3_VL_SPECIALS}
        text_cfg: dict[str, Any] = dict(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=2048, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                             "mrope_interleaved": True})
        text_cfg.update(text or {})
        text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
            text_config=text_cfg, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                               deepstack_visual_indexes=[], num_position_embeddings=16)))
        dit_cfg: dict[str, Any] = dict(patch_size=1, in_channels=16, out_channels=16, num_layers=2,
                                       attention_head_dim=16, num_attention_heads=2, context_in_dim=32, mlp_ratio=3,
                                       axes_dims_rope=(4, 6, 6))
        dit_cfg.update(overrides)
        transformer = QwenImage21Transformer2DModel(**dit_cfg)
        z = int(dit_cfg["in_channels"])
        vae_cfg: dict[str, Any] = dict(base_dim=4, decoder_base_dim=8, z_dim=z, dim_mult=[1, 1, 2, 2, 2],
                                       num_res_blocks=1, temperal_downsample=[False, True, True, True],
                                       latents_mean=[0.1 * ((i % 5) - 2) for i in range(z)],
                                       latents_std=[0.8 + 0.1 * (i % 7) for i in range(z)])
        vae_cfg.update(vae or {})
        vae_model = AutoencoderKLQwenImage21(**vae_cfg)
        scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
            base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
        processor = prompt_only_processor(Qwen2VLImageProcessorPil(), tokenizer, QWEN3_VL_TEMPLATE)
        components = {"text_encoder": text_encoder, "transformer": transformer, "vae": vae_model}
        for comp in components.values():
            redraw_weights(comp, seed)
            cast_dtype(comp, dtype)
        pipe = QwenImage21Pipeline(scheduler=scheduler, vae=vae_model, text_encoder=text_encoder,
                                   processor=processor, transformer=transformer, sample_sigmas=sample_sigmas)
        pipe.save_pretrained(str(out), safe_serialization=True)
        # the component is recorded as the stand-in's class; the directory names the real one
        index_path = out / "model_index.json"
        index = json.loads(index_path.read_text())
        index["processor"] = ["transformers", "Qwen3VLProcessor"]
        index_path.write_text(json.dumps(index, indent=2))
    finally:
        shutil.rmtree(tok_dir, ignore_errors=True)
    total = sum(sum(p.numel() for p in c.parameters()) for c in components.values())
    return TinyModel(out, "qwen-image-21", "diffusers", int(total), stored_elements(out))


TINY_MODELS["qwen-image-21"] = build_qwen_image21_pipeline
