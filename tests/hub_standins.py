"""Offline stand-ins for every model vgrpo and reward.py load by name, written in the Hugging Face cache layout.

    python tests/hub_standins.py /tmp/hub             # 5-15 s on a CPU, 13 MB
    HF_HUB_CACHE=/tmp/hub HF_HUB_OFFLINE=1 python vgrpo.py --model sd3 --reward pickscore --mixed-precision no \
        --resolution 64 --sample-steps 4 --prompts-per-step 2 --group-size 4 --iterations 2

The cache format is public: repository `org/name` lives in `models--org--name/`, whose `refs/main` names a
commit and whose `snapshots/<commit>/` holds the repository's files. Tiny models with random weights saved
there with `save_pretrained` resolve under the real ids with HF_HUB_OFFLINE=1, so `--model sd3`, `--model flux`
and the CLIP-based rewards load through exactly the code they run on a cluster, without any download.

Each stand-in keeps what the loaders and pipelines depend on: the real classes, the three text encoders of
SD3.5 and the two of FLUX.1 with tokenizers at their real lengths (CLIP 77, T5 up to 512), 16 latent channels
behind an 8x VAE with the real scaling and shift factors, SD3.5's patch size 2, RMS qk-norm and dual-attention
block, FLUX.1's packed 64-channel input, guidance embedding and resolution-dependent shift, Qwen-Image's
Qwen2.5-VL text encoder, video VAE with per-channel statistics and exponential shift, FLUX.2 [klein]'s 28-layer
Qwen3 (it reads layers 9, 18, 27), batch-normalised VAE and 4D rotary ids (base and distilled, is_distilled), CLIP image
processors at 224 px with CLIP's mean and std, the OpenCLIP checkpoint format of HPSv2.1, the state dict of
the LAION aesthetic head, GenEval's Mask2Former detector (Swin backbone, the 80 COCO classes, 100 queries), and
ImageReward.pt's layout (a BLIP ViT and BERT) with med_config.json and a bert-base-uncased tokenizer.
Widths are near 32 and there are 1-2 layers, so a process loads SD3 and PickScore in a few seconds. Weights
are a function of `seed` alone: two caches with different seeds differ in every randomly drawn tensor (norms
start at 1 in both), the same seed gives the same bytes.
"""

import argparse
import contextlib
import hashlib
import math
import os
import shutil
import tempfile
import time

import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository, when run as a script
import reward  # noqa: E402
from vgrpo import MODEL_IDS, write_byte_tokenizer  # noqa: E402

BYTE_VOCAB = 514          # write_byte_tokenizer: 256 bytes, the same + </w>, <|startoftext|> 512, <|endoftext|> 513
CLIP_CONTEXT = 77         # every real CLIP text encoder reads 77 tokens; SD3 and FLUX rely on it
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
MARKER = ".vgrpo-standin"  # in a repository folder: written by this file, so it may be replaced


# --------------------------------------------------------------------------- building blocks


@contextlib.contextmanager
def seeded(seed, *name):
    """Torch's global RNG seeded from (seed, name), restored afterwards: each part's weights depend on the cache's
    seed and the part's name only, not on which parts were built before it."""
    digest = hashlib.sha256("/".join(map(str, (seed, *name))).encode()).digest()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        yield


def clip_tokenizer():
    """vgrpo's byte-level CLIP tokenizer (no merges, so no vocabulary to download) at CLIP's real 77 tokens."""
    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory() as d:
        write_byte_tokenizer(d)
        tokenizer = CLIPTokenizer.from_pretrained(d, model_max_length=CLIP_CONTEXT)
    assert len(tokenizer) == BYTE_VOCAB, f"write_byte_tokenizer now has {len(tokenizer)} tokens, not {BYTE_VOCAB}"
    return tokenizer


def clip_text_config(width, layers=2, hidden_act="quick_gelu"):
    """A CLIP text tower over the byte vocabulary; pad = eos, as in OpenAI's CLIP-L tokenizer, so the pooled
    token (the first eos) is the same whatever the padding."""
    return dict(vocab_size=BYTE_VOCAB, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                num_attention_heads=2, max_position_embeddings=CLIP_CONTEXT, projection_dim=width,
                hidden_act=hidden_act, bos_token_id=512, eos_token_id=513, pad_token_id=513)


def clip_text_encoder(seed, name, width, with_projection):
    """SD3's CLIP-L / CLIP-G (CLIPTextModelWithProjection, projection = width as in both real ones) or FLUX's CLIP-L
    (CLIPTextModel, whose pooled output of size `width` is FLUX's pooled projection input)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    with seeded(seed, name):
        cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
        return cls(CLIPTextConfig(**clip_text_config(width))).eval()


def t5_tokenizer():
    """A character-level unigram T5 tokenizer built in code (the real SentencePiece model cannot be downloaded):
    T5's special tokens at their real ids (<pad> 0, </s> 1, <unk> 2), then printable ASCII and the word marker."""
    from transformers import T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    vocab += [(chr(c), -2.0) for c in range(33, 127)]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)


def t5_encoder(seed, name, width, vocab_size):
    """T5 v1.1 as in T5-XXL (gated GELU feed-forward, relative position buckets, so any sequence length works)."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=vocab_size, d_model=width, d_kv=16, d_ff=2 * width, num_layers=1, num_heads=2,
                      feed_forward_proj="gated-gelu", dropout_rate=0.0, tie_word_embeddings=False)
    with seeded(seed, name):
        return T5EncoderModel(config).eval()


def vae_8x(seed, name, scaling_factor, shift_factor):
    """AutoencoderKL as in SD3 and FLUX.1: four blocks (8x downsampling) into 16 latent channels, no quant convs."""
    from diffusers import AutoencoderKL

    with seeded(seed, name):
        return AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 16, 32), layers_per_block=1,
            latent_channels=16, norm_num_groups=8, sample_size=1024, scaling_factor=scaling_factor,
            shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False).eval()


QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                "<|video_pad|>"]
# Qwen's chat format (<|im_start|>role ... <|im_end|>), an image part as `image_tokens`; written here, not copied
QWEN_CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
             "{% else %}{% for c in m['content'] %}{% if c['type'] in ('image', 'image_url') %}IMAGE{% elif c['type'] "
             "== 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen_tokenizer(extra=()):
    """Qwen2's byte-level BPE tokenizer (Qwen2.5-VL, Qwen3) over the 256 byte symbols without merges (the real
    151k-entry vocabulary cannot be downloaded), with Qwen's special tokens after them; eos <|im_end|>."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, bos_token=None, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL + list(extra)})
    return tokenizer


JUDGE_ANSWER = "Final Score: 4"   # what the stand-in judge answers, a score of 4 / 5 = 0.8


def build_llava_judge(directory, seed):
    """A VLM judge for the unifiedreward tests, served by `transformers serve`: LLaVA (a CLIP ViT, a projector, a
    Qwen2 language model) as UnifiedReward-7b-v1.5 is (LLaVA-OneVision on Qwen2), 32 wide, one layer each, 112 px
    images in 14 px patches. Its processor needs no torchvision: Qwen2.5-VL's processor requires it (its video
    processor), and torchvision's only wheel that the registry here offers is a CUDA build that does not load
    beside the CPU build of torch."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaProcessor, Qwen2Config)

    tokenizer = qwen_tokenizer(extra=["<image>"])
    tokenizer.add_tokens([JUDGE_ANSWER])   # one token, so that a one-layer model can be made to write it
    end, image, answer = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<image>", JUDGE_ANSWER])
    text = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, eos_token_id=end,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=112, patch_size=14, projection_dim=32)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=image,
                         vision_feature_select_strategy="default", vision_feature_layer=-1)
    with seeded(seed, "llava_judge"):
        judge = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():   # its greedy answer is JUDGE_ANSWER, over and over, for any image and caption: every
        # token's embedding has 10 in coordinate 0, far above what the layer adds (weights of std 0.02), so the last
        # hidden state's coordinate 0 is positive, and the only row of lm_head that reads anything reads it
        judge.model.language_model.embed_tokens.weight[:, 0] = 10.0
        judge.lm_head.weight.zero_()
        judge.lm_head.weight[answer, 0] = 1.0
    judge.save_pretrained(directory)
    processor = CLIPImageProcessor(size={"shortest_edge": 112}, crop_size={"height": 112, "width": 112},
                                   image_mean=CLIP_MEAN, image_std=CLIP_STD)
    LlavaProcessor(image_processor=processor, tokenizer=tokenizer, patch_size=14, num_additional_image_tokens=1,
                   vision_feature_select_strategy="default",
                   chat_template=QWEN_CHAT.replace("IMAGE", "<image>\n")).save_pretrained(directory)


def clip_model(seed, name, config):
    from transformers import CLIPModel

    with seeded(seed, name):
        return CLIPModel(config).eval()


def clip_config(width, projection_dim, hidden_act):
    """A CLIPModel over the byte vocabulary seeing 224 px images in 14 px patches (ViT-L/14, ViT-H/14), logit
    scale 100 (ln 100 = 4.6052: the value trained CLIP models reach, where training clips it)."""
    from transformers import CLIPConfig

    vision = dict(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=1, num_attention_heads=2,
                  image_size=224, patch_size=14, hidden_act=hidden_act)
    return CLIPConfig(text_config=clip_text_config(width, layers=1, hidden_act=hidden_act), vision_config=vision,
                      projection_dim=projection_dim, logit_scale_init_value=math.log(100.0))


def clip_processor():
    """CLIP's image preprocessing at 224 px (shortest side resized bicubically, centre crop, CLIP mean and std)."""
    from transformers import CLIPImageProcessor, CLIPProcessor

    images = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}, resample=3,
                                image_mean=CLIP_MEAN, image_std=CLIP_STD)
    return CLIPProcessor(image_processor=images, tokenizer=clip_tokenizer())


def transformers_to_openclip(state_dict):
    """transformers' CLIPModel weights -> OpenCLIP's names and layouts (the format HPSv2 ships; the inverse of
    reward.openclip_to_transformers): q, k, v packed into one in_proj, projections stored as (width, embed)."""
    renames = {"vision_model.embeddings.patch_embedding.": "visual.conv1.",
               "vision_model.embeddings.class_embedding": "visual.class_embedding",
               "vision_model.embeddings.position_embedding.weight": "visual.positional_embedding",
               "vision_model.pre_layrnorm.": "visual.ln_pre.", "vision_model.post_layernorm.": "visual.ln_post.",
               "text_model.embeddings.token_embedding.": "token_embedding.",
               "text_model.embeddings.position_embedding.weight": "positional_embedding",
               "text_model.final_layer_norm.": "ln_final.", "logit_scale": "logit_scale",
               "vision_model.encoder.layers.": "visual.transformer.resblocks.",
               "text_model.encoder.layers.": "transformer.resblocks."}
    block = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "self_attn.out_proj": "attn.out_proj",
             "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
    out = {"visual.proj": state_dict["visual_projection.weight"].t().contiguous(),
           "text_projection": state_dict["text_projection.weight"].t().contiguous()}
    for key, value in state_dict.items():
        if key.endswith("position_ids") or key in ("visual_projection.weight", "text_projection.weight"):
            continue
        src = next(s for s in renames if key.startswith(s))
        rest = key[len(src):]
        if not src.endswith("layers."):
            out[renames[src] + rest] = value
            continue
        index, _, name = rest.partition(".")                      # '0', 'self_attn.q_proj.weight'
        base = f"{renames[src]}{index}."
        module, _, kind = name.rpartition(".")
        if module == "self_attn.q_proj":                          # k and v are taken with q
            qkv = [state_dict[f"{src}{index}.self_attn.{p}_proj.{kind}"] for p in "qkv"]
            out[f"{base}attn.in_proj_{kind}"] = torch.cat(qkv)
        elif module in block:
            out[f"{base}{block[module]}.{kind}"] = value
    return out


# --------------------------------------------------------------------------- the stand-ins, one per repository


def build_sd3(directory, seed):
    """stabilityai/stable-diffusion-3.5-medium: CLIP-L (32) + CLIP-G (64) + T5 (128); their CLIP hidden states are
    concatenated (96) and zero-padded to the T5 width, which is the joint attention width; pooled = 32 + 64."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    t5_tok = t5_tokenizer()
    with seeded(seed, "sd3/transformer"):
        transformer = SD3Transformer2DModel(
            sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=128, caption_projection_dim=32, pooled_projection_dim=96,
            pos_embed_max_size=128, dual_attention_layers=(0,), qk_norm="rms_norm").eval()
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae_8x(seed, "sd3/vae", 1.5305, 0.0609),
        text_encoder=clip_text_encoder(seed, "sd3/clip_l", 32, True), tokenizer=clip_tokenizer(),
        text_encoder_2=clip_text_encoder(seed, "sd3/clip_g", 64, True), tokenizer_2=clip_tokenizer(),
        text_encoder_3=t5_encoder(seed, "sd3/t5", 128, len(t5_tok)), tokenizer_3=t5_tok)
    pipe.save_pretrained(directory)


def build_flux(directory, seed):
    """black-forest-labs/FLUX.1-dev: CLIP-L (pooled, 32) + T5 (64, the joint attention width); 2 heads of 16 with
    rotary axes (4, 6, 6) summing to the head dim; 2x2-packed latents, so 64 input channels."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    t5_tok = t5_tokenizer()
    with seeded(seed, "flux/transformer"):
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=(4, 6, 6)).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxPipeline(
        scheduler=scheduler, vae=vae_8x(seed, "flux/vae", 0.3611, 0.1159),
        text_encoder=clip_text_encoder(seed, "flux/clip_l", 32, False), tokenizer=clip_tokenizer(),
        text_encoder_2=t5_encoder(seed, "flux/t5", 64, len(t5_tok)), tokenizer_2=t5_tok, transformer=transformer)
    pipe.save_pretrained(directory)


def qwen25_vl(seed, name, tokenizer, width=32):
    """Qwen2.5-VL (Qwen-Image's text encoder): a one-layer Qwen2 language model with 3D rotary sections (mrope) and a
    one-block vision tower, the image and vision tokens at the tokenizer's ids."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = dict(zip(QWEN_SPECIAL, tokenizer.convert_tokens_to_ids(QWEN_SPECIAL)))
    text = dict(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096, bos_token_id=None,
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=width,
                  fullatt_block_indexes=[0])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"])
    with seeded(seed, name):
        return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_qwen_image(directory, seed):
    """Qwen/Qwen-Image: QwenImageTransformer2DModel (2x2 patches of 16 latent channels -> 64 inputs, 16 out; rotary
    axes (4, 6, 6) over a head of 16) reading Qwen2.5-VL's 32-wide last hidden states; the video VAE (causal 3D
    convolutions, 8x down in space) with Qwen-Image's per-channel latent means and stds; its scheduler's exponential
    dynamic shift (base 0.5, max 0.9 over 256-8192 tokens, shift terminal 0.02)."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)

    tokenizer = qwen_tokenizer()
    with seeded(seed, "qwen_image/transformer"):
        transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                                  axes_dims_rope=(4, 6, 6)).eval()
    with seeded(seed, "qwen_image/vae"):
        vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                     temperal_downsample=[False, True, True]).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                                base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                                time_shift_type="exponential")
    QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=qwen25_vl(seed, "qwen_image/text_encoder", tokenizer),
                      tokenizer=tokenizer, transformer=transformer).save_pretrained(directory)


def qwen3(seed, name, tokenizer, width=16, layers=28):
    """Qwen3 (FLUX.2 [klein]'s text encoder) with 28 layers as Qwen3-0.6B, since klein reads hidden layers 9, 18, 27."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=1024, bos_token_id=None, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), tie_word_embeddings=True)
    with seeded(seed, name):
        return Qwen3ForCausalLM(config).eval()


def flux2_klein_builder(distilled):
    def build(directory, seed):
        """black-forest-labs/FLUX.2-klein(-base)-4B: Flux2Transformer2DModel (one double and one single block,
        2x2-patchified 32-channel latents -> 128 inputs, 4D rotary axes (4, 4, 4, 4), no guidance embedding) reading
        three stacked Qwen3 layers (3 x 16 = 48 wide); FLUX.2's VAE with its batch norm over the 128 patchified
        channels, running statistics drawn away from (0, 1) so that the denormalisation matters; the distilled
        variant says so in model_index.json (is_distilled: no CFG)."""
        from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline,
                               Flux2Transformer2DModel)

        tokenizer = qwen_tokenizer(extra=["<think>", "</think>"])
        tokenizer.chat_template = QWEN_CHAT.replace("IMAGE", "").replace(
            "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n{% if enable_thinking is defined and not "
            "enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
        with seeded(seed, "flux2_klein/transformer"):
            transformer = Flux2Transformer2DModel(patch_size=1, in_channels=128, num_layers=1, num_single_layers=1,
                                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48,
                                                  axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False).eval()
        with seeded(seed, "flux2_klein/vae"):
            vae = AutoencoderKLFlux2(block_out_channels=(8, 16, 16, 32), layers_per_block=1, latent_channels=32,
                                     norm_num_groups=8, use_quant_conv=False, use_post_quant_conv=False).eval()
            vae.bn.running_mean.normal_(0, 0.5)
            vae.bn.running_var.uniform_(0.5, 2.0)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
                                                    time_shift_type="exponential")
        text_encoder = qwen3(seed, "flux2_klein/text_encoder", tokenizer)
        Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                           transformer=transformer, is_distilled=distilled).save_pretrained(directory)
    return build


def build_vit_h(directory, seed):
    """laion/CLIP-ViT-H-14-laion2B-s32B-b79K: the base of PickScore and HPSv2.1; config (read by the hpsv2
    reward), weights and processor. OpenCLIP's ViT-H uses the exact GELU."""
    clip_model(seed, "vit_h", clip_config(32, 32, "gelu")).save_pretrained(directory)
    clip_processor().save_pretrained(directory)


def build_pickscore(directory, seed):
    """yuvalkirstain/PickScore_v1: a fine-tune of the ViT-H above, so the same config with other weights; like the
    real repository it is loaded with the processor of the laion one."""
    clip_model(seed, "pickscore", clip_config(32, 32, "gelu")).save_pretrained(directory)


def build_clip_l(directory, seed):
    """openai/clip-vit-large-patch14 (CLIPScore, aesthetic): quick GELU like OpenAI's models; the real 768-wide
    projection, because the aesthetic head reads 768 features."""
    clip_model(seed, "clip_l", clip_config(32, 768, "quick_gelu")).save_pretrained(directory)
    clip_processor().save_pretrained(directory)


def build_hpsv2(directory, seed):
    """xswu/HPSv2 HPS_v2.1_compressed.pt: {'state_dict': OpenCLIP weights in float16} of a model with the laion
    config above (reward.load_hpsv2 builds the CLIPModel from that config and converts these weights)."""
    model = clip_model(seed, "hpsv2", clip_config(32, 32, "gelu"))
    state_dict = {k: v.half() for k, v in transformers_to_openclip(model.state_dict()).items()}
    torch.save({"state_dict": state_dict}, os.path.join(directory, reward.HPS_FILE))


def build_aesthetic(directory, seed):
    """camenduru/improved-aesthetic-predictor sac+logos+ava1-l14-linearMSE.pth: the head's plain state dict. Weights
    drawn so the score spreads about 1 around 5.5, the real head's typical value, instead of the default
    initialisation's ~1e-3 around 0 (an affine map of a unit vector: each layer keeps the scale of its input)."""
    with seeded(seed, "aesthetic"):
        mlp = reward.AestheticMLP()
        linears = [m for m in mlp.layers if isinstance(m, torch.nn.Linear)]
        for i, layer in enumerate(linears):
            torch.nn.init.normal_(layer.weight, std=1.0 if i == 0 else layer.in_features ** -0.5)
            torch.nn.init.zeros_(layer.bias)
        torch.nn.init.constant_(linears[-1].bias, 5.5)
    torch.save(mlp.state_dict(), os.path.join(directory, reward.AESTHETIC_FILE))


def build_mask2former(directory, seed):
    """facebook/mask2former-swin-small-coco-instance (the geneval reward's detector): a
    Mask2FormerForUniversalSegmentation over a Swin backbone with the real head's shape: the 80 COCO classes (plus
    no-object) named as in the real config, 100 queries, masks at a quarter of the input; widths of 16-32 and one or
    two layers per part."""
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig

    names = {i: name for i, name in enumerate(COCO_NAMES)}
    backbone = SwinConfig(embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2], window_size=7, drop_path_rate=0.0,
                          out_features=["stage1", "stage2", "stage3", "stage4"])
    config = Mask2FormerConfig(backbone_config=backbone, num_labels=80, num_queries=100, hidden_dim=32,
                               feature_size=32, mask_feature_size=32, encoder_layers=1, decoder_layers=2,
                               num_attention_heads=2, dim_feedforward=64, encoder_feedforward_dim=64, id2label=names,
                               label2id={name: i for i, name in names.items()})
    with seeded(seed, "mask2former"):
        Mask2FormerForUniversalSegmentation(config).eval().save_pretrained(directory)


# the real checkpoint's id2label: COCO's names (GenEval renames three of them: reward.GENEVAL_CLASSES)
COCO_NAMES = [{"computer mouse": "mouse", "tv remote": "remote", "computer keyboard": "keyboard"}.get(name, name)
              for name in reward.GENEVAL_CLASSES]


def bert_vocabulary():
    """A WordPiece vocabulary in bert-base-uncased's format: [PAD] at 0 (ImageReward's med_config pad_token_id),
    BERT's other special tokens, lowercase characters and digits, their ## continuations, a few whole words."""
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789") + list("!,.'-?\"")
    words = ["the", "of", "and", "in", "on", "with", "cat", "dog", "red", "blue", "photo", "house", "sea", "city"]
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + c for c in chars[:36]] + words


def build_bert_uncased(directory, seed):
    """bert-base-uncased (ImageReward's tokenizer): vocab.txt and tokenizer_config.json as in the real repository,
    with the small vocabulary above (the real one has 30522 entries; reward.py adds [DEC] and [ENC] to either)."""
    import json

    with open(os.path.join(directory, "vocab.txt"), "w") as f:
        f.write("\n".join(bert_vocabulary()) + "\n")
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"do_lower_case": True, "model_max_length": 512}, f)


def build_imagereward(directory, seed):
    """THUDM/ImageReward: ImageReward.pt, the package's state dict (blip.visual_encoder.* in timm's names,
    blip.text_encoder.*, the unused blip.vision_proj / text_proj, med.py's position_ids, mlp.layers.*) in
    float32, and med_config.json with the real file's keys. A ViT of width 64 (one head of BLIP's 64) and one
    layer at the real 224 px and 16 px patches; a one-layer BERT of width 32 over bert_vocabulary + [DEC] + [ENC].
    Names are written with reward.imagereward_key; tests/test_imagereward.py checks them against the key layout
    of the fixture that ImageReward's own code saved. Weights are drawn at scales that keep every part's output
    near unit size, so the score depends on the image and the prompt (the default BLIP inits start near zero)."""
    import json

    from transformers import BlipTextConfig, BlipVisionConfig

    med_config = {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
                  "hidden_dropout_prob": 0.1, "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
                  "layer_norm_eps": 1e-12, "max_position_embeddings": 64, "model_type": "bert",
                  "num_attention_heads": 2, "num_hidden_layers": 1, "pad_token_id": 0, "type_vocab_size": 2,
                  "vocab_size": len(bert_vocabulary()) + 2, "encoder_width": 768, "add_cross_attention": True}
    vision = BlipVisionConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=1, num_attention_heads=1,
                              image_size=224, patch_size=16, layer_norm_eps=reward.BLIP_VIT_EPS)
    text = BlipTextConfig(vocab_size=med_config["vocab_size"], hidden_size=32, encoder_hidden_size=64,
                          intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=64,
                          is_decoder=True, bos_token_id=None, eos_token_id=None, sep_token_id=None)
    with seeded(seed, "imagereward"):
        model = reward.ImageRewardModel(vision, text)
        for name, param in model.named_parameters():
            if name.endswith("weight") and param.dim() >= 2:           # Linear, Conv2d, Embedding: fan-in scaled
                torch.nn.init.normal_(param, std=param[0].numel() ** -0.5)
            elif name.endswith(("class_embedding", "position_embedding")):
                torch.nn.init.normal_(param, std=0.02)
        state_dict = {reward.imagereward_key(k, to_imagereward=True): v.detach().clone()
                      for k, v in model.state_dict().items()}
        for name, width in (("vision_proj", 64), ("text_proj", 32)):   # BLIP's contrastive projections to 256
            state_dict[f"blip.{name}.weight"], state_dict[f"blip.{name}.bias"] = torch.randn(256, width) / 8, \
                torch.zeros(256)
        state_dict["blip.text_encoder.embeddings.position_ids"] = torch.arange(64)[None]
    torch.save(state_dict, os.path.join(directory, reward.IMAGEREWARD_FILE))
    with open(os.path.join(directory, reward.IMAGEREWARD_CONFIG), "w") as f:
        json.dump(med_config, f, indent=2)


STANDINS = {
    MODEL_IDS["sd3"]: build_sd3,
    MODEL_IDS["flux"]: build_flux,
    MODEL_IDS["qwen-image"]: build_qwen_image,
    MODEL_IDS["flux2-klein"]: flux2_klein_builder(distilled=False),
    "black-forest-labs/FLUX.2-klein-4B": flux2_klein_builder(distilled=True),
    reward.PICKSCORE_PROCESSOR: build_vit_h,   # also reward.HPS_BACKBONE
    reward.PICKSCORE_MODEL: build_pickscore,
    reward.CLIPSCORE_MODEL: build_clip_l,      # also reward.AESTHETIC_CLIP
    reward.HPS_REPO: build_hpsv2,
    reward.AESTHETIC_REPO: build_aesthetic,
    reward.GENEVAL_DETECTOR: build_mask2former,
    reward.IMAGEREWARD_REPO: build_imagereward,
    reward.IMAGEREWARD_TOKENIZER: build_bert_uncased,
}


# --------------------------------------------------------------------------- the cache layout


def _source_digest():
    with open(os.path.abspath(__file__), "rb") as f:
        return hashlib.sha1(f.read()).hexdigest()


def _read(path):
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read()


def revision(repo, seed):
    """The snapshot's 40-hex 'commit': changes with the seed and with this file, so an edited builder rebuilds."""
    return hashlib.sha1(f"{repo}\n{seed}\n{_source_digest()}".encode()).hexdigest()


def write_repo(cache_dir, repo, build, seed):
    """One repository in the hub layout; returns False when the same revision is already complete there."""
    folder = os.path.join(cache_dir, "models--" + repo.replace("/", "--"))
    if os.path.isdir(folder) and not os.path.exists(os.path.join(folder, MARKER)):
        raise FileExistsError(f"{folder} holds a real download of {repo}, not a stand-in: use another directory")
    rev, ref = revision(repo, seed), os.path.join(folder, "refs", "main")
    snapshots = os.path.join(folder, "snapshots")
    if os.path.isdir(os.path.join(snapshots, rev)) and _read(ref) == rev:
        return False
    os.makedirs(os.path.join(folder, "refs"), exist_ok=True)
    os.makedirs(snapshots, exist_ok=True)
    with open(os.path.join(folder, MARKER), "w") as f:
        f.write("random-weight stand-in written by hub_standins.py\n")
    staging = tempfile.mkdtemp(prefix=".building-", dir=folder)  # outside snapshots/: never seen half-written
    try:
        build(staging, seed)
        for old in os.listdir(snapshots):   # an older stand-in (other seed or builder) of this repository
            shutil.rmtree(os.path.join(snapshots, old))
        os.replace(staging, os.path.join(snapshots, rev))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    with open(ref + ".tmp", "w") as f:   # refs/main last: a reader sees the old revision or the complete new one
        f.write(rev)
    os.replace(ref + ".tmp", ref)
    return True


def build_hub_cache(cache_dir, seed=0):
    """Write a stand-in for every repository in STANDINS into `cache_dir` (use it as HF_HUB_CACHE). Cheap to call
    again: a repository whose revision for this seed and this file is already complete is skipped."""
    os.makedirs(cache_dir, exist_ok=True)
    cache_dir = os.path.abspath(cache_dir)
    for repo, build in STANDINS.items():
        write_repo(cache_dir, repo, build, seed)
    return cache_dir


def disk_usage(directory):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write random-weight stand-ins of the hub models vgrpo uses.")
    parser.add_argument("directory", help="the cache directory to write (use it as HF_HUB_CACHE)")
    parser.add_argument("--seed", type=int, default=0, help="weights are a function of this seed")
    args = parser.parse_args(argv)
    from transformers.utils import logging

    logging.disable_progress_bar()   # one bar per saved model would bury the two lines that matter
    start = time.time()
    path = build_hub_cache(args.directory, args.seed)
    print(f"{len(STANDINS)} stand-ins (seed {args.seed}) in {path}: {disk_usage(path) / 2**20:.1f} MiB, "
          f"{time.time() - start:.0f} s\n" + "\n".join(f"  {repo}" for repo in STANDINS))
    print(f"use them with:\n  HF_HUB_CACHE={path} HF_HUB_OFFLINE=1 python vgrpo.py --model sd3 --reward pickscore "
          "--mixed-precision no --resolution 64 --sample-steps 4 --prompts-per-step 2 --group-size 4 --iterations 2")


if __name__ == "__main__":
    main()
