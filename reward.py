"""Reward models for vgrpo, behind one small contract.

    fn = load_reward("pickscore:1,clipscore:0.5", device, dtype)   # dtype: the reward models' (None: float32)
    r = fn(images, prompts)     # images: float (B, 3, H, W) in [0, 1]; prompts: list of B str
                                # r: torch.float32 tensor of shape (B,), on the CPU

    r = fn(images, prompts, metadata)   # optional: a list of B dicts (a jsonl prompt file's rows, GenEval
                                        # format); it reaches the rewards whose signature has `metadata`

A spec is a comma-separated list of `name[:weight]`; the reward is the weighted sum. Each name maps to
a loader in REWARDS that does its own (heavy) imports, so importing this module is cheap and a reward
you do not use never needs its packages. Model-based rewards can also be built from a model and a
processor you already hold (`clip_similarity_reward`), which is how the tests run them on tiny random
CLIP models without downloading anything.

Registry names and their scale on a base model (SD3.5-M / FLUX.1-dev), so that weights can be chosen:
pickscore ~0.87, clipscore ~0.3, hpsv2 ~0.28, aesthetic ~5.5, imagereward ~1.0, ocr ~0.6, jpeg ~-0.2,
geneval (0 or 1 per image) ~0.63 and geneval_partial at most 1 (a count clause < 0 past twice its count) on SD3.5-M
(geneval_partial_jpeg: the same on quality-75 JPEGs of the images, as Flow-GRPO's server scores them),
unifiedreward 0 or 0.2-1 (a served judge: unifiedreward@http://host:port/v1); on the pretrained digits model:
digit in [0, 1] ~0.33, digit_correct and digit_knn 0 or 1 per image.
Optional package: ocr needs `pip install rapidocr-onnxruntime`; a missing one raises RewardError naming it.
imagereward needs no package of its own: it runs ImageReward's checkpoint on transformers' BLIP (load_imagereward).
"""

import inspect
import io
import math
import os
import re

import torch

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
CLIPSCORE_MODEL = "openai/clip-vit-large-patch14"
HPS_REPO, HPS_FILE = "xswu/HPSv2", "HPS_v2.1_compressed.pt"
HPS_BACKBONE = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"   # the OpenCLIP ViT-H-14 that HPSv2.1 fine-tunes
AESTHETIC_CLIP = "openai/clip-vit-large-patch14"
# The LAION aesthetic predictor's weights, as mirrored on the Hugging Face hub; override with the environment
# variables VGRPO_AESTHETIC_REPO / VGRPO_AESTHETIC_FILE (a local .pth path works as VGRPO_AESTHETIC_FILE too).
AESTHETIC_REPO = os.environ.get("VGRPO_AESTHETIC_REPO", "camenduru/improved-aesthetic-predictor")
AESTHETIC_FILE = os.environ.get("VGRPO_AESTHETIC_FILE", "sac+logos+ava1-l14-linearMSE.pth")
HF_INCLUDE_CONFIGS = " --include '*.json' '*.txt'"   # `hf download` of a repository's configs, processor and tokenizer


class RewardError(Exception):
    """A reward could not be built or returned something unusable; the message names the reward."""


def to_uint8_images(images):
    """(B, 3, H, W) floats in [0, 1] -> list of B PIL images (the rounding every reward sees)."""
    from PIL import Image

    arr = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a) for a in arr]


# --------------------------------------------------------------------------- verifiable rewards


def jpeg_reward(images, prompts):
    """JPEG compressibility (DDPO): minus the JPEG size (quality 95) in kB, divided by 500.

    Scale: a 512 px SD3.5 image is about 40-120 kB, so about -0.08 to -0.24; a 32 px image of the tiny
    model is about 1 kB (-0.002) with an in-group spread near 3e-5, below the advantage's 1e-4
    epsilon: weight it up for small images (the tiny test models' default is `jpeg:100`).
    """
    sizes = []
    for im in to_uint8_images(images):
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=95)
        sizes.append(buf.tell() / 1000.0)
    return -torch.tensor(sizes, dtype=torch.float32) / 500.0


def load_jpeg(device, dtype=None):
    """JPEG compressibility (jpeg_reward). Scale: about -0.08 to -0.24 for 512 px SD3.5 images."""
    return jpeg_reward


# --------------------------------------------------------------------------- CLIP-similarity rewards


def _features(out):
    # transformers >= 5 returns a model output whose pooler_output holds the projected features
    return out if isinstance(out, torch.Tensor) else out.pooler_output


# PIL's resampling filters (the processors' `resample`) that torch reproduces: with antialias=True its kernels are
# PIL's (cubic a = -0.5, support widened by the scale when shrinking); nearest, box, hamming and lanczos are not
_TORCH_MODES = {2: "bilinear", 3: "bicubic"}


def clip_pixel_values(images, image_processor, round_crop_offset=False):
    """(B, 3, H, W) floats in [0, 1] -> a CLIP model's pixel_values, float32, on the images' device.

    Tensor ops that redo what `image_processor` (CLIPImageProcessor) does to the uint8 pictures: the same uint8
    rounding, the shortest side resized to `size` with its `resample` filter, the centre `crop_size`, rescale and
    normalisation with its own mean and std. PIL resizes a uint8 picture one axis at a time, width first, and
    rounds and clips to uint8 after each pass; doing the same here brings the result within 2 uint8 levels of
    PIL's, on under 1% of the values (bicubic, test_rewards.py); one pass is up to 24 levels off where enlarged
    detail overshoots [0, 255], and torch's bicubic without antialias (a = -0.75, fixed support) up to 171.
    The centre crop's offset is rounded down, as transformers' processors do; round_crop_offset=True rounds it to
    nearest (Python's round, half to even), as torchvision's CenterCrop in open_clip's preprocessing (GenEval's).
    """
    p = image_processor
    x = (images.detach().float().clamp(0, 1) * 255).round()           # the uint8 picture a saved image shows
    h, w = x.shape[-2:]
    if p.do_resize:
        short = p.size.get("shortest_edge")
        if short:                      # the long side follows as int(size * long / short), as the processor does
            nh, nw = (short, int(short * w / h)) if h <= w else (int(short * h / w), short)
        else:
            nh, nw = p.size["height"], p.size["width"]
        mode = _TORCH_MODES.get(int(p.resample))
        if mode is None:
            raise RewardError(f"image processor resample={p.resample!r}: only bilinear and bicubic run on tensors")
        for size, changes in (((h, nw), nw != w), ((nh, nw), nh != h)):   # width, then height
            if changes:
                x = torch.nn.functional.interpolate(x, size=size, mode=mode, antialias=True, align_corners=False)
                x = x.clamp(0, 255).round()
        h, w = nh, nw
    if p.do_center_crop:
        ch, cw = p.crop_size["height"], p.crop_size["width"]
        if ch > h or cw > w:
            raise RewardError(f"crop {ch}x{cw} is larger than the resized image {h}x{w}")
        top, left = (int(round((h - ch) / 2)), int(round((w - cw) / 2))) if round_crop_offset else \
            ((h - ch) // 2, (w - cw) // 2)
        x = x[..., top:top + ch, left:left + cw]
    if p.do_rescale:
        x = x * p.rescale_factor
    if p.do_normalize:
        mean, std = (torch.tensor(v, device=x.device).view(-1, 1, 1) for v in (p.image_mean, p.image_std))
        x = (x - mean) / std
    return x


def clip_similarity_reward(model, processor, device, use_logit_scale, divide_by=1.0, dtype=torch.float32):
    """Reward = [logit_scale.exp() *] cos(text embedding, image embedding) / divide_by, for any CLIPModel.

    Images are preprocessed on `device` as the processor would (clip_pixel_values) and never visit the CPU;
    the model runs in `dtype` (which one: load_reward), the cosine in float32.
    """
    # logit_scale ~ log(100) is read before the cast: in bf16 it would become 4.594, i.e. exp() = 98.9, not 100
    logit_scale = model.logit_scale.detach().float().exp().to(device)
    dtype = dtype or torch.float32
    model = model.to(device, dtype).eval().requires_grad_(False)
    max_length = min(processor.tokenizer.model_max_length, model.config.text_config.max_position_embeddings)

    @torch.no_grad()
    def fn(images, prompts):
        pixels = clip_pixel_values(images.to(device), processor.image_processor).to(dtype)
        text = processor(text=list(prompts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        img = _features(model.get_image_features(pixel_values=pixels))
        txt = _features(model.get_text_features(input_ids=text["input_ids"].to(device),
                                                attention_mask=text["attention_mask"].to(device)))
        cos = torch.nn.functional.cosine_similarity(img.float(), txt.float(), dim=-1)
        scale = logit_scale if use_logit_scale else 1.0
        fn.last_image_features = img.float()   # kept for the evaluation's diversity in this embedding
        return (scale * cos / divide_by).float().cpu()

    return fn


def lacks_vocabulary(tokenizer):
    """Whether `tokenizer` is the bare one transformers builds, without a word of warning, when a repository's
    vocabulary files are absent (offline, or a partial download): every prompt then becomes the unknown token (CLIP,
    T5, BERT) or no token at all (Qwen's byte-level BPE). A plain English probe tells it from any real tokenizer."""
    ids = tokenizer("a photo of a cat", add_special_tokens=False)["input_ids"]
    return not ids or (tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids)


def _from_hub(reward_name, repo, load, include=""):
    """load(repo), a transformers / diffusers `from_pretrained`; a repository missing from the cache (or broken in
    it, a tokenizer without its vocabulary included) becomes one RewardError naming it and the command that fetches
    it (`include`: `hf download`'s option naming the files that suffice)."""
    from safetensors import SafetensorError     # a weights file cut short
    from transformers import PreTrainedTokenizerBase

    fetch = f"download it first (`hf download {repo}{include}`) or run with network access"
    try:
        loaded = load(repo)
    except (OSError, ValueError, SafetensorError) as e:
        raise RewardError(f"reward '{reward_name}' needs {repo}, which could not be loaded ({type(e).__name__}); "
                          f"{fetch}") from None
    tokenizer = getattr(loaded, "tokenizer", loaded)        # a processor's, or the tokenizer itself
    if isinstance(tokenizer, PreTrainedTokenizerBase) and lacks_vocabulary(tokenizer):
        raise RewardError(f"reward '{reward_name}' needs {repo}, whose tokenizer has no vocabulary in the cache "
                          f"(a partial download: every prompt would read as unknown tokens); {fetch}")
    return loaded


def _load_clip(model_id, processor_id, reward_name, device):
    from transformers import CLIPModel, CLIPProcessor

    model = _from_hub(reward_name, model_id, CLIPModel.from_pretrained)
    include = "" if processor_id == model_id else HF_INCLUDE_CONFIGS     # only the processor of another repository
    return model, _from_hub(reward_name, processor_id, CLIPProcessor.from_pretrained, include)


def load_pickscore(device, dtype=None):
    """PickScore (Kirstain et al. 2023): logit_scale.exp() * cos / 26.

    Scale: raw PickScore logits sit near 21-23 for SD3.5 / FLUX images, so values near 0.81-0.88: the division by 26
    is Flow-GRPO's and DiffusionNFT's training reward; the V-GRPO, DiffusionNFT and Flow-GRPO tables report the logit
    / 100 (0.20-0.25).
    """
    model, processor = _load_clip(PICKSCORE_MODEL, PICKSCORE_PROCESSOR, "pickscore", device)
    return clip_similarity_reward(model, processor, device, use_logit_scale=True, divide_by=26.0, dtype=dtype)


def load_clipscore(device, dtype=None):
    """CLIPScore with openai/clip-vit-large-patch14: the plain cosine (= logits / 100). Scale: about 0.25-0.35."""
    model, processor = _load_clip(CLIPSCORE_MODEL, CLIPSCORE_MODEL, "clipscore", device)
    return clip_similarity_reward(model, processor, device, use_logit_scale=False, dtype=dtype)


def _hub_file(repo, filename, reward_name):
    """A file from the Hugging Face hub, with one clear error if unavailable (never a file of that name in the
    working directory: an ImageReward.pt or med_config.json lying there would be used without a word)."""
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo, filename)
    except Exception as e:  # offline, missing, gated: huggingface_hub raises many types
        raise RewardError(f"reward '{reward_name}' needs {filename} from {repo}, which could not be loaded "
                          f"({type(e).__name__}); download it first (`hf download {repo} {filename}`) "
                          "or run with network access") from None


def _read_checkpoint(path, reward_name):
    """torch.load of a downloaded checkpoint: a truncated or corrupt file becomes one RewardError naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (zip, unpickling and EOF errors, depending on where the file breaks)
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        raise RewardError(f"reward '{reward_name}': {path} could not be read ({type(e).__name__}: {first_line}); if "
                          "its download was cut short, delete it and download it again") from None


def openclip_to_transformers(state_dict):
    """An OpenCLIP ViT state dict (open_clip.model.CLIP) -> the same weights under transformers' CLIPModel names.

    The architectures are the same network: OpenCLIP packs q, k, v into one `in_proj` of nn.MultiheadAttention
    and stores the two projections as (width, embed) matrices used as `x @ proj`, transformers keeps three
    Linear layers and (embed, width) weights. This is what lets HPSv2.1 run without open_clip, whose package
    imports torchvision.
    """
    prefixes = [("visual.transformer.resblocks.", "vision_model.encoder.layers."),
                ("transformer.resblocks.", "text_model.encoder.layers.")]
    renames = {"visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
               "visual.class_embedding": "vision_model.embeddings.class_embedding",
               "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
               "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
               "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
               "visual.ln_post.weight": "vision_model.post_layernorm.weight",
               "visual.ln_post.bias": "vision_model.post_layernorm.bias",
               "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
               "positional_embedding": "text_model.embeddings.position_embedding.weight",
               "ln_final.weight": "text_model.final_layer_norm.weight",
               "ln_final.bias": "text_model.final_layer_norm.bias",
               "logit_scale": "logit_scale"}
    transposed = {"visual.proj": "visual_projection.weight", "text_projection": "text_projection.weight"}
    block = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
             "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
    out = {}
    for key, value in state_dict.items():
        if key in renames:
            out[renames[key]] = value
        elif key in transposed:
            out[transposed[key]] = value.t()
        else:
            src, dst = next(((s, d) for s, d in prefixes if key.startswith(s)), (None, None))
            if src is None:
                raise RewardError(f"unexpected key in an OpenCLIP checkpoint: {key}")
            index, _, rest = key[len(src):].partition(".")   # '3', 'attn.in_proj_weight'
            base = f"{dst}{index}."
            if rest.startswith("attn.in_proj_"):                 # (3 width, ...) -> q, k, v
                kind = rest[len("attn.in_proj_"):]
                for part, chunk in zip("qkv", value.chunk(3, dim=0)):
                    out[f"{base}self_attn.{part}_proj.{kind}"] = chunk
            else:
                name, _, kind = rest.rpartition(".")
                if name not in block:
                    raise RewardError(f"unexpected key in an OpenCLIP checkpoint: {key}")
                out[f"{base}{block[name]}.{kind}"] = value
    return out


def load_hpsv2(device, dtype=None):
    """HPSv2.1 (Wu et al. 2023): OpenCLIP ViT-H-14 fine-tuned on human preferences; reward = the raw cosine of
    the L2-normalised image and text embeddings (HPSv2's `image_features @ text_features.T`, no logit scale).

    Scale: about 0.25-0.30 for SD3.5-M / FLUX.1-dev images, the numbers the papers' tables report; 1 / 0.3
    is the usual weight when it is mixed with rewards near 1. Runs as a transformers CLIPModel (config and
    processor of the laion ViT-H-14 base, weights converted by openclip_to_transformers). HPSv2 resizes the
    longest side and pads; for the square images trained here that is the processor's resize and centre crop.
    """
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor

    checkpoint = _read_checkpoint(_hub_file(HPS_REPO, HPS_FILE, "hpsv2"), "hpsv2")
    state_dict = checkpoint.get("state_dict", checkpoint)
    state_dict = {k.removeprefix("module."): v.float() for k, v in state_dict.items()}
    # the backbone's config and processor only: the weights are HPSv2's
    config = _from_hub("hpsv2", HPS_BACKBONE, CLIPConfig.from_pretrained, HF_INCLUDE_CONFIGS)
    processor = _from_hub("hpsv2", HPS_BACKBONE, CLIPProcessor.from_pretrained, HF_INCLUDE_CONFIGS)
    # OpenCLIP's ViT-H-14 uses the exact GELU (only OpenAI's CLIP models use quick_gelu)
    config.text_config.hidden_act = config.vision_config.hidden_act = "gelu"
    model = CLIPModel(config)
    model.load_state_dict(openclip_to_transformers(state_dict))
    return clip_similarity_reward(model, processor, device, use_logit_scale=False, dtype=dtype)


# --------------------------------------------------------------------------- aesthetic and ImageReward


class AestheticMLP(torch.nn.Module):
    """The LAION aesthetic predictor head (sac+logos+ava1-l14-linearMSE): five Linear layers and no
    nonlinearity, so it is an affine map of the CLIP ViT-L/14 embedding trained with MSE on 1-10 ratings.
    Parameter names (`layers.0.weight`, ...) match the released .pth."""

    def __init__(self, dim=768):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(dim, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128), torch.nn.Dropout(0.2),
            torch.nn.Linear(128, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.layers(x)


def aesthetic_reward(model, processor, mlp, device, dtype=torch.float32):
    """Reward = mlp(image embedding / |image embedding|) for a CLIPModel and an AestheticMLP; the prompt is unused.
    The CLIP model runs in `dtype` on `device` (images preprocessed there, clip_pixel_values); the MLP head is
    tiny and stays float32."""
    model = model.to(device, dtype or torch.float32).eval().requires_grad_(False)
    mlp = mlp.to(device, torch.float32).eval().requires_grad_(False)
    image_processor = getattr(processor, "image_processor", processor)

    @torch.no_grad()
    def fn(images, prompts):
        pixels = clip_pixel_values(images.to(device), image_processor).to(model.dtype)
        emb = _features(model.get_image_features(pixel_values=pixels)).float()
        emb = emb / emb.norm(dim=-1, keepdim=True)
        return mlp(emb).squeeze(-1).float().cpu()

    return fn


def load_aesthetic(device, dtype=None):
    """LAION aesthetic score: CLIP ViT-L/14 image embedding, L2-normalised, into the linear MLP above.

    Scale: the 1-10 rating scale, about 5.0-5.5 for SD3.5-M and 5.5-6.5 for FLUX.1-dev images; kept raw (not
    divided by 10) because that is what the papers' tables report, so weight it about 0.1 next to rewards near 1.
    """
    model, processor = _load_clip(AESTHETIC_CLIP, AESTHETIC_CLIP, "aesthetic", device)
    mlp = AestheticMLP()
    local = "VGRPO_AESTHETIC_FILE" in os.environ and os.path.isfile(AESTHETIC_FILE)   # it may name a local .pth
    path = AESTHETIC_FILE if local else _hub_file(AESTHETIC_REPO, AESTHETIC_FILE, "aesthetic")
    state_dict = _read_checkpoint(path, "aesthetic")
    mlp.load_state_dict(state_dict.get("state_dict", state_dict))
    return aesthetic_reward(model, processor, mlp, device, dtype)


# ImageReward-v1.0 in-process on transformers' BLIP. THUDM/ImageReward's ImageReward.pt is the state dict of the
# package's `ImageReward` module: BLIP's ViT-L/16 (timm's ViT as BLIP builds it, LayerNorm eps 1e-6, 16 heads of 64)
# at 224 px, BLIP's BERT-base with cross-attention to the image tokens (med.py; its med_config.json: vocab 30524 =
# bert-base-uncased + [DEC] + [ENC], LayerNorm eps 1e-12), and an MLP head of the aesthetic predictor's layout on the
# text's first ([CLS]) output. transformers' BlipVisionModel and BlipTextModel are ports of those two modules.
IMAGEREWARD_REPO, IMAGEREWARD_FILE, IMAGEREWARD_CONFIG = "THUDM/ImageReward", "ImageReward.pt", "med_config.json"
IMAGEREWARD_TOKENIZER = "bert-base-uncased"
IMAGEREWARD_MEAN, IMAGEREWARD_STD = 0.16717362830052426, 1.0333394966054072   # the package's standardisation
IMAGEREWARD_TOKENS = 35           # its score(): padding="max_length", truncation=True, max_length=35
IMAGEREWARD_PIXEL_MEAN = (0.48145466, 0.4578275, 0.40821073)    # its transform normalises with CLIP's mean and std
IMAGEREWARD_PIXEL_STD = (0.26862954, 0.26130258, 0.27577711)
BLIP_VIT_HEAD_DIM = 64            # BLIP's ViTs (B/16 768 / 12, L/16 1024 / 16); the head count is not in the weights
BLIP_VIT_EPS = 1e-6               # timm's ViT LayerNorm as BLIP builds it (BlipVisionConfig's default is 1e-5)
# left over after renaming and allowed to be: BLIP's contrastive projections, which the score does not use, and
# med.py's position_ids buffer (persistent there, recomputed by transformers)
IMAGEREWARD_UNUSED = ("blip.vision_proj.", "blip.text_proj.", "blip.text_encoder.embeddings.position_ids")
# ImageReward.pt's names -> ImageRewardModel's, by prefix: the ViT's take timm's names to BlipVisionModel's (the
# same fused qkv layout), BLIP's BERT is BlipTextModel name for name, the head's `layers.*` are AestheticMLP's
_IMAGEREWARD_NAMES = [("blip.visual_encoder.cls_token", "vision.embeddings.class_embedding"),
                      ("blip.visual_encoder.pos_embed", "vision.embeddings.position_embedding"),
                      ("blip.visual_encoder.patch_embed.proj.", "vision.embeddings.patch_embedding."),
                      ("blip.visual_encoder.norm.", "vision.post_layernorm."),
                      ("blip.visual_encoder.blocks.", "vision.encoder.layers."),
                      ("blip.text_encoder.", "text."), ("mlp.", "head.")]
_BLIP_VIT_BLOCK_NAMES = [("norm1.", "layer_norm1."), ("attn.qkv.", "self_attn.qkv."),
                         ("attn.proj.", "self_attn.projection."), ("norm2.", "layer_norm2."), ("mlp.", "mlp.")]


def imagereward_key(key, to_imagereward=False):
    """One of ImageReward.pt's keys -> ImageRewardModel's (or back); None for a key outside both layouts."""
    pairs = [(b, a) for a, b in _IMAGEREWARD_NAMES] if to_imagereward else _IMAGEREWARD_NAMES
    blocks = [(b, a) for a, b in _BLIP_VIT_BLOCK_NAMES] if to_imagereward else _BLIP_VIT_BLOCK_NAMES
    for src, dst in pairs:
        if key.startswith(src):
            rest = key[len(src):]
            if not src.endswith(("blocks.", "layers.")):
                return dst + rest
            index, _, name = rest.partition(".")                    # '3', 'attn.qkv.weight'
            inner = next((d + name[len(s):] for s, d in blocks if name.startswith(s)), None)
            return None if inner is None or not index.isdigit() else f"{dst}{index}.{inner}"
    return None


class ImageRewardModel(torch.nn.Module):
    """ImageReward's scorer: image tokens from the ViT, the prompt's BERT cross-attending to all of them, the head
    on the [CLS] output, standardised. The head stays float32 (ImageReward casts the features to float first)."""

    def __init__(self, vision_config, text_config):
        from transformers import BlipTextModel, BlipVisionModel

        super().__init__()
        self.vision = BlipVisionModel(vision_config)
        self.text = BlipTextModel(text_config, add_pooling_layer=False)
        self.head = AestheticMLP(text_config.hidden_size)
        self.image_size = vision_config.image_size

    def forward(self, pixel_values, input_ids, attention_mask):
        image_tokens = self.vision(pixel_values=pixel_values).last_hidden_state
        # is_decoder=False: bidirectional self-attention, as ImageReward runs its BERT (the config's is_decoder only
        # makes transformers build the cross-attention layers); no encoder mask: every image token is attended to
        out = self.text(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image_tokens,
                        is_decoder=False)
        features = out.last_hidden_state[:, 0].float()
        return (self.head(features).squeeze(-1) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD


def _imagereward_error(source, what):
    return RewardError(f"reward 'imagereward': {source} is not ImageReward's checkpoint ({what}); it needs "
                       f"{IMAGEREWARD_FILE} and {IMAGEREWARD_CONFIG} of {IMAGEREWARD_REPO} "
                       f"(`hf download {IMAGEREWARD_REPO} {IMAGEREWARD_FILE} {IMAGEREWARD_CONFIG}`)")


def imagereward_model(state_dict, med_config, vision_heads=None, source=IMAGEREWARD_FILE):
    """ImageRewardModel from ImageReward.pt's state dict and med_config.json's dict, every weight checked.

    ImageReward builds its ViT in code (ViT-L/16 at 224 px), so its sizes are read from the weights' shapes, with
    heads of BLIP_VIT_HEAD_DIM unless `vision_heads` says otherwise; the BERT's come from med_config, whose
    encoder width BLIP replaces with the ViT's. Every key must land in the model and every model weight must come
    from the file, except IMAGEREWARD_UNUSED: anything else is a RewardError of one line.
    """
    from transformers import BlipTextConfig, BlipVisionConfig

    renamed, unexpected = {}, []
    for key, value in state_dict.items():
        new = None if key.startswith(IMAGEREWARD_UNUSED) else imagereward_key(key)
        if new is not None:
            renamed[new] = value.float() if value.is_floating_point() else value
        elif not key.startswith(IMAGEREWARD_UNUSED):
            unexpected.append(key)
    needed = ["vision.embeddings.class_embedding", "vision.embeddings.position_embedding",
              "vision.embeddings.patch_embedding.weight", "vision.encoder.layers.0.mlp.fc1.weight"]
    absent = [imagereward_key(k, to_imagereward=True) for k in needed if k not in renamed]
    if absent:
        raise _imagereward_error(source, f"no {', '.join(absent)}")
    width, positions = renamed[needed[0]].shape[-1], renamed[needed[1]].shape[1]
    patch = renamed[needed[2]].shape[-1]
    layers = 1 + max(int(k.split(".")[3]) for k in renamed if k.startswith("vision.encoder.layers."))
    heads = vision_heads or max(1, width // BLIP_VIT_HEAD_DIM)
    vision = BlipVisionConfig(hidden_size=width, intermediate_size=renamed[needed[3]].shape[0],
                              num_hidden_layers=layers, num_attention_heads=heads,
                              image_size=round((positions - 1) ** 0.5) * patch, patch_size=patch, hidden_act="gelu",
                              layer_norm_eps=BLIP_VIT_EPS)
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "max_position_embeddings", "hidden_act", "layer_norm_eps", "pad_token_id")
    if [k for k in sizes if k not in med_config]:
        raise _imagereward_error(source, f"{IMAGEREWARD_CONFIG} lacks {[k for k in sizes if k not in med_config]}")
    # is_decoder=True builds the cross-attention layers; generation ids are unused (None keeps tiny vocabularies valid)
    text = BlipTextConfig(**{k: med_config[k] for k in sizes}, encoder_hidden_size=width, is_decoder=True,
                          use_cache=False, bos_token_id=None, eos_token_id=None, sep_token_id=None)
    model = ImageRewardModel(vision, text)
    try:
        result = model.load_state_dict(renamed, strict=False)
    except RuntimeError as e:                                       # shapes that disagree with med_config or heads
        raise _imagereward_error(source, str(e).strip().splitlines()[-1].strip()) from None
    unexpected += [imagereward_key(k, True) or k for k in result.unexpected_keys]
    missing = [imagereward_key(k, True) or k for k in result.missing_keys]
    if missing or unexpected:
        raise _imagereward_error(source, f"{len(missing)} keys missing {missing[:3]}, "
                                         f"{len(unexpected)} unexpected {unexpected[:3]}")
    return model.eval().requires_grad_(False)


def imagereward_tokenizer(tokenizer):
    """bert-base-uncased as BLIP's init_tokenizer sets it up for ImageReward: [DEC] added as the bos token and [ENC]
    as an additional special token (ids 30522 and 30523 of med_config's 30524). Prompts never produce them unless
    they contain the literal text, and then ImageReward's tokenizer does the same."""
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer


def imagereward_pixel_values(images, size=224):
    """(B, 3, H, W) floats in [0, 1] -> ImageReward's pixel values (B, 3, size, size), float32, on the CPU.

    ImageReward's transform on the uint8 picture: torchvision's Resize(size, bicubic), the shorter side to `size`
    and the longer to int(size * long / short), untouched when already so; CenterCrop(size), whose offsets
    torchvision rounds with Python's round (half to even); ToTensor; CLIP's mean and std. torchvision resizes a
    PIL image with PIL, so PIL does it here too and the pixels are ImageReward's exactly (tensor resampling is up
    to 2 levels off, clip_pixel_values); about a millisecond per image, next to the ViT-L's forward.
    """
    import numpy as np
    from PIL import Image

    pictures = []
    for picture in to_uint8_images(images):
        w, h = picture.size
        new_long = int(size * max(w, h) / min(w, h))
        nw, nh = (size, new_long) if w <= h else (new_long, size)
        if (nw, nh) != (w, h):
            picture = picture.resize((nw, nh), Image.BICUBIC)
        top, left = int(round((nh - size) / 2.0)), int(round((nw - size) / 2.0))
        pictures.append(torch.from_numpy(np.asarray(picture.crop((left, top, left + size, top + size))).copy()))
    x = torch.stack(pictures).permute(0, 3, 1, 2).float() / 255
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (IMAGEREWARD_PIXEL_MEAN, IMAGEREWARD_PIXEL_STD))
    return (x - mean) / std


def imagereward_reward(model, tokenizer, device, dtype=torch.float32):
    """Reward = ImageReward's standardised score for an ImageRewardModel and its tokenizer, the batch in one
    forward: the ViT and BERT run in `dtype` on `device`, the head in float32."""
    dtype = dtype or torch.float32
    model.eval().requires_grad_(False)
    model.vision.to(device, dtype)
    model.text.to(device, dtype)
    model.head.to(device, torch.float32)

    @torch.no_grad()
    def fn(images, prompts):
        pixels = imagereward_pixel_values(images, model.image_size).to(device, dtype)
        tokens = tokenizer(list(prompts), padding="max_length", truncation=True, max_length=IMAGEREWARD_TOKENS,
                           return_tensors="pt")
        scores = model(pixels, tokens["input_ids"].to(device), tokens["attention_mask"].to(device))
        return scores.float().cpu()

    return fn


def load_imagereward(device, dtype=None):
    """ImageReward-v1.0 (Xu et al. 2023): BLIP ViT-L + BERT cross-attention + MLP, trained on 137k expert
    comparisons; the score is standardised as the package reports it (mean 0, std 1 over its training set).

    Scale: about 0.9-1.0 for SD3.5-M / FLUX.1-dev images, 1.3-1.6 after preference RL.
    Runs in-process on transformers' BLIP (no `image-reward` package, whose imports need torchvision and
    transformers 4): ImageReward.pt and med_config.json from THUDM/ImageReward, the bert-base-uncased tokenizer.
    tests/test_imagereward.py checks it against ImageReward's own code (tests/fixtures/imagereward).
    """
    import json

    from transformers import BertTokenizer

    path = _hub_file(IMAGEREWARD_REPO, IMAGEREWARD_FILE, "imagereward")
    with open(_hub_file(IMAGEREWARD_REPO, IMAGEREWARD_CONFIG, "imagereward")) as f:
        med_config = json.load(f)
    tokenizer = imagereward_tokenizer(_from_hub("imagereward", IMAGEREWARD_TOKENIZER, BertTokenizer.from_pretrained,
                                                HF_INCLUDE_CONFIGS))    # the tokenizer alone
    if len(tokenizer) != med_config.get("vocab_size"):
        raise RewardError(f"reward 'imagereward': the {IMAGEREWARD_TOKENIZER} tokenizer has {len(tokenizer)} tokens "
                          f"with [DEC] and [ENC], but {IMAGEREWARD_CONFIG}'s vocab_size is "
                          f"{med_config.get('vocab_size')}")
    model = imagereward_model(_read_checkpoint(path, "imagereward"), med_config, source=path)
    return imagereward_reward(model, tokenizer, device, dtype)


# --------------------------------------------------------------------------- handwritten digits (the CPU demo's task)

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
NO_DIGIT = 10  # the classifier's eleventh class: images that are no digit at all
DIGITS_JUDGES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits", "classifiers.safetensors")


def digit_ink(images):
    """(B, 3, H, W) in [0, 1], dark ink on white -> (B, 1, 16, 16): the ink of each cell of a 16 x 16 grid in [0, 1]
    (the demo's own resolution, where this is 1 - grey), after the uint8 rounding every reward sees."""
    gray = ((images.detach().float().clamp(0, 1) * 255).round() / 255).mean(1, keepdim=True)
    return torch.nn.functional.adaptive_avg_pool2d(1 - gray, 16)


class DigitJudge:
    """The two judges digits/pretrain.py trains on the UCI digits, plain tensors in one safetensors file.

    A small CNN (three 3x3 convolutions, 35k weights) over eleven classes: the ten digits and "no digit", the
    latter trained on made-up non-digits (bars, blobs, two digits overlaid, speckle). Its probability of the
    prompted digit is the training reward; the eleventh class is what keeps the reward from being maximised by a
    thick bar that a classifier of ten digits would call a 2 (a logistic regression was, within 20 iterations).
    A k-nearest-neighbour vote over the training images' ink, an independent second opinion: it counts an image
    only when its nearest training image is no farther than 1.25 times the farthest any held-out real digit is
    from its own, so an image that is like no handwritten digit never counts, whatever its neighbours vote."""

    def __init__(self, tensors):
        self.cnn = {k.removeprefix("cnn."): v.float() for k, v in tensors.items() if k.startswith("cnn.")}
        self.ink, self.labels = tensors["knn.ink"].float(), tensors["knn.labels"]
        self.k, self.max_distance = int(tensors["knn.k"]), float(tensors["knn.max_distance"])

    @classmethod
    def load(cls, path=DIGITS_JUDGES):
        from safetensors.torch import load_file

        if not os.path.isfile(path):
            raise RewardError(f"the digit rewards need {path}: it ships with the repository "
                              "(python digits/pretrain.py makes it again)")
        return cls(load_file(path))

    def logits(self, ink):
        """The CNN on ink (B, 1, 16, 16) -> (B, 11)."""
        F, w = torch.nn.functional, self.cnn
        x = F.relu(F.conv2d(ink, w["0.weight"], w["0.bias"], padding=1))
        x = F.relu(F.conv2d(x, w["2.weight"], w["2.bias"], stride=2, padding=1))
        x = F.relu(F.conv2d(x, w["4.weight"], w["4.bias"], stride=2, padding=1))
        return F.linear(x.flatten(1), w["7.weight"], w["7.bias"])

    @torch.no_grad()
    def probabilities(self, images):
        """(B, 11): the CNN's probability of each digit and, last, of no digit."""
        return torch.softmax(self.logits(digit_ink(images).cpu()), dim=1)

    def predict(self, images):
        """The CNN's most probable class: a digit, or NO_DIGIT."""
        return self.probabilities(images).argmax(1)

    def knn_predict(self, images):
        """The most frequent digit among the k nearest training images (Euclidean on the ink; a tie goes to the
        digit whose nearest image is nearest), or NO_DIGIT when even the nearest is farther than max_distance."""
        distances = torch.cdist(digit_ink(images).cpu().flatten(1), self.ink)
        nearest = distances.topk(self.k, largest=False)                 # (B, k), nearest first
        votes = torch.nn.functional.one_hot(self.labels[nearest.indices], 10).sum(1).float()
        first_seen = torch.full((len(images), 10), float(self.k))
        for j in reversed(range(self.k)):                               # rank of each digit's nearest image
            first_seen.scatter_(1, self.labels[nearest.indices[:, j:j + 1]], float(j))
        vote = (votes - first_seen / (self.k + 1)).argmax(1)
        return vote.masked_fill(nearest.values[:, 0] > self.max_distance, NO_DIGIT)


def prompted_digit(prompt, metadata=None):
    """The digit a prompt asks for: metadata["digit"] when the prompt file gives it, else the one digit word
    ("seven") or numeral ("7") in the prompt; RewardError when there is none or more than one."""
    if metadata and metadata.get("digit") is not None:
        if type(metadata["digit"]) is not int or not 0 <= metadata["digit"] <= 9:
            raise RewardError(f'digit rewards: prompt {prompt!r} gives "digit": {metadata["digit"]!r}, not 0-9')
        return metadata["digit"]
    words = re.findall(r"[a-z]+|\d", prompt.lower())
    found = {DIGIT_WORDS.index(w) if w in DIGIT_WORDS else int(w) for w in words if w in DIGIT_WORDS or w.isdigit()}
    if len(found) != 1:
        raise RewardError(f"digit rewards: prompt {prompt!r} names {'no digit' if not found else 'several digits'}; "
                          'name one ("seven" or "7") or give it as {"digit": 7} in a .jsonl prompt file')
    return found.pop()


def digit_reward(kind, judge):
    """kind "probability": the CNN's probability of the prompted digit (the training reward: graded, so a group of
    images that are all wrong still has an order); "correct": 1 where its most probable class is the prompted
    digit, else 0 (accuracy, for evaluation); "knn": the same with the k-NN vote (the second opinion: a gain the
    k-NN does not share is the CNN being fooled)."""

    def fn(images, prompts, metadata=None):
        wanted = torch.tensor([prompted_digit(p, metadata[i] if metadata else None) for i, p in enumerate(prompts)])
        if kind == "probability":
            return judge.probabilities(images).gather(1, wanted[:, None]).squeeze(1)
        predicted = judge.predict(images) if kind == "correct" else judge.knn_predict(images)
        return (predicted == wanted).float()

    return fn


def load_digit(device, dtype=None):
    """The prompted digit's probability under a small CNN with a "no digit" class (DigitJudge; the CPU demo's
    reward). Scale: [0, 1]; the pretrained digits model scores about 0.33 on held-out prompts."""
    return digit_reward("probability", DigitJudge.load())


def load_digit_correct(device, dtype=None):
    """1 if the CNN reads the prompted digit, else 0: accuracy, for evaluation. Scale: [0, 1]."""
    return digit_reward("correct", DigitJudge.load())


def load_digit_knn(device, dtype=None):
    """1 if a 5-nearest-neighbour vote over the training digits reads the prompted digit in an image that is near
    one of them: an independent check of `digit`'s gains (reward hacking). Scale: [0, 1]."""
    return digit_reward("knn", DigitJudge.load())


# --------------------------------------------------------------------------- GenEval (compositional prompts)
# GenEval (Ghosh et al. 2023) scores an image against its prompt's metadata ({"tag", "include", "exclude"}) with an
# object detector and a CLIP colour classifier. Here both run in-process on transformers alone: Mask2Former Swin-S
# trained on COCO instances (the architecture of GenEval's mmdetection model; its weights are the original authors'
# training, not mmdetection's, so scores are close to the official ones, not equal) and CLIP ViT-L/14 (the same
# OpenAI weights as GenEval's open_clip model). GenEval's rules are written below from its evaluation code.

GENEVAL_DETECTOR = "facebook/mask2former-swin-small-coco-instance"
GENEVAL_CLIP = "openai/clip-vit-large-patch14"
# the 80 COCO classes in the detector's index order, under the names GenEval's prompts use
GENEVAL_CLASSES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow", "elephant",
    "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard",
    "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange", "broccoli",
    "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch", "potted plant", "bed", "dining table", "toilet",
    "tv", "laptop", "computer mouse", "tv remote", "computer keyboard", "cell phone", "microwave", "oven", "toaster",
    "sink", "refrigerator", "book", "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush")
GENEVAL_COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
COLOR_TEMPLATES = ("a photo of a {color} {object}", "a photo of a {color}-colored {object}",
                   "a photo of a {color} object")
DETECTION_THRESHOLD, COUNTING_THRESHOLD, MAX_OBJECTS, POSITION_SHRINK = 0.3, 0.9, 16, 0.1


def geneval_objects(detections, tag):
    """Detections [(class name, score, box, mask)] -> {class: [(box, mask), ...]}: per class those scoring above 0.3
    (0.9 for the counting tag), best first, at most 16, with no non-maximum suppression (GenEval's settings). The
    scores are the detector's float32 and are compared in float32, as GenEval compares its numpy array with the
    threshold: a score of exactly float32(0.3) is above the double 0.3, not above the threshold."""
    import numpy as np

    threshold = np.float32(COUNTING_THRESHOLD if tag == "counting" else DETECTION_THRESHOLD)
    objects = {}
    for name, score, box, mask in sorted(detections, key=lambda d: -d[1]):
        if np.float32(score) > threshold and len(objects.setdefault(name, [])) < MAX_OBJECTS:
            objects[name].append((box, mask))
    return {name: found for name, found in objects.items() if found}


def relative_position(a, b):
    """GenEval's relations of box a to box b ([x0, y0, x1, y1], y down): the centre offset a - b shrunk, per axis, by
    0.1 x the two boxes' summed size (clamped at 0), divided by the unshrunk offset's length; 'left of' / 'right of'
    where its x is below -0.5 / above 0.5, 'above' / 'below' for y. Boxes that (nearly) coincide have no relation."""
    centre = lambda box: ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2)  # noqa: E731
    (ax, ay), (bx, by) = centre(a), centre(b)
    offset = (ax - bx, ay - by)
    size = (abs(a[2] - a[0]) + abs(b[2] - b[0]), abs(a[3] - a[1]) + abs(b[3] - b[1]))
    shrunk = [math.copysign(max(abs(o) - POSITION_SHRINK * s, 0.0), o) for o, s in zip(offset, size)]
    if all(abs(v) < 1e-3 for v in shrunk):
        return set()
    length = math.hypot(*offset)
    dx, dy = shrunk[0] / length, shrunk[1] / length
    return ({"left of"} if dx < -0.5 else set()) | ({"right of"} if dx > 0.5 else set()) | \
        ({"above"} if dy < -0.5 else set()) | ({"below"} if dy > 0.5 else set())


GENEVAL_RELATIONS = ("left of", "right of", "above", "below")


def geneval_clause_problem(clause, kind, index):
    """What makes one include / exclude clause unusable, or None (geneval_metadata_problem's, clause by clause)."""
    where = f"{kind} clause {index}"
    if not isinstance(clause, dict):
        return f'{where}: {clause!r} is not an object {{"class": ..., "count": ...}}'
    if clause.get("class") not in GENEVAL_CLASSES:
        return f"{where}: class {clause.get('class')!r} is none of GenEval's 80 (reward.GENEVAL_CLASSES)"
    count = clause.get("count")
    if type(count) is not int or count < 1:
        return f"{where}: count {count!r} is not a whole number >= 1"
    if "color" in clause and clause["color"] not in GENEVAL_COLORS:
        return f"{where}: color {clause['color']!r} is none of {', '.join(GENEVAL_COLORS)}"
    position = clause.get("position")
    if "position" in clause and not (kind == "include" and isinstance(position, list) and len(position) == 2
                                     and position[0] in GENEVAL_RELATIONS and type(position[1]) is int
                                     and 0 <= position[1] < index):
        return (f"{where}: position {position!r} is not [relation, j] with a relation of "
                f"{', '.join(GENEVAL_RELATIONS)} and j an earlier include clause")
    return None


def geneval_metadata_problem(metadata):
    """What makes one prompt's GenEval metadata unusable, as a message, or None. A class, colour or relation GenEval
    does not know would never be found (the prompt would score 0 every time and never train), and a position refers
    to an earlier include clause."""
    include = metadata.get("include") if isinstance(metadata, dict) else None
    if not isinstance(include, list) or not include:
        return 'no "include" clauses'
    exclude = metadata.get("exclude", [])
    if not isinstance(exclude, list):
        return f'"exclude" is {exclude!r}, not a list of clauses'
    problems = [geneval_clause_problem(clause, kind, i)
                for kind, clauses in (("include", include), ("exclude", exclude)) for i, clause in enumerate(clauses)]
    return next(filter(None, problems), None)


def geneval_rules(metadata, objects, colours_of):
    """GenEval's verdict on one image -> (correct, partial).

    metadata: {"tag", "include": [{"class", "count", "color"?, "position"?: [relation, j]}], "exclude": [...]}.
    objects: geneval_objects' {class: [(box, mask), ...]}; colours_of(class, found) -> a colour name per object.
    correct is GenEval's own score (geneval_correct); partial the score Flow-GRPO's reward server trains on
    (geneval_partial_score)."""
    return geneval_correct(metadata, objects, colours_of), geneval_partial_score(metadata, objects, colours_of)


def geneval_correct(metadata, objects, colours_of):
    """GenEval's evaluation: True when every include clause finds at least its `count` objects (the best `count`
    of its class), when it names a colour at least `count` of those have it, when it names a position [relation, j]
    each of them stands in that relation to every object of clause j (which must itself have held), and no exclude
    clause finds `count` or more."""
    correct, matched = True, []
    for clause in metadata.get("include", []):
        found = objects.get(clause["class"], [])[:clause["count"]]
        ok = len(found) >= clause["count"]
        if ok and "color" in clause:
            ok = colours_of(clause["class"], found).count(clause["color"]) >= clause["count"]
        if ok and "position" in clause:
            relation, target = clause["position"]
            anchors = matched[target]
            ok = anchors is not None and all(relation in relative_position(box, other)
                                             for box, _ in found for other, _ in anchors)
        correct = correct and ok
        matched.append(found if ok else None)
    return correct and all(len(objects.get(c["class"], [])) < c["count"] for c in metadata.get("exclude", []))


def geneval_partial_score(metadata, objects, colours_of):
    """The partial credit of Flow-GRPO's GenEval reward server, term for term (so that training runs compare): for
    each include clause, 1 - |count - found| / count over all the detections of its class (negative past twice the
    count); then, if it names a colour or a position, one more term: 0 when the count is not exact, else for a colour
    1 - |count - right colours| / count, for a position 0 when clause j did not hold exactly, else 1, preceded by a 0
    when some object is not in the relation (the server's loop appends both). The mean of the terms; exclude
    clauses do not count. A clause holds exactly when its count is exact and its colour or position checks pass."""
    terms, matched = [], []
    for clause in metadata.get("include", []):
        found, count = objects.get(clause["class"], []), clause["count"]
        terms.append(1 - abs(count - len(found)) / count)
        ok = len(found) == count
        if not ok:
            terms += [0.0] if "color" in clause or "position" in clause else []
        elif "color" in clause:
            right = colours_of(clause["class"], found).count(clause["color"])
            terms.append(1 - abs(count - right) / count)
            ok = right == count
        if ok and "position" in clause:
            relation, target = clause["position"]
            if matched[target] is None:
                ok = False
                terms.append(0.0)
            else:
                ok = all(relation in relative_position(box, other) for box, _ in found for other, _ in matched[target])
                terms += [1.0] if ok else [0.0, 1.0]
        matched.append(found if ok else None)
    return sum(terms) / len(terms) if terms else 0.0


def detector_input(images, scale=(1333, 800), divisor=32):
    """(B, 3, H, W) in [0, 1] -> (pixel values (B, 3, H', W') padded to a multiple of `divisor`, (h, w) resized): as
    GenEval's detector reads an image: the uint8 picture resized keeping its aspect ratio to fit `scale` (bilinear,
    no antialiasing, rounded to uint8, as OpenCV), ImageNet's mean and std, zero padding at the bottom and right."""
    x = (images.detach().float().clamp(0, 1) * 255).round()
    h, w = x.shape[-2:]
    factor = min(max(scale) / max(h, w), min(scale) / min(h, w))
    size = (int(h * factor + 0.5), int(w * factor + 0.5))
    if size != (h, w):
        x = torch.nn.functional.interpolate(x, size=size, mode="bilinear", align_corners=False).clamp(0, 255).round()
    mean = torch.tensor([123.675, 116.28, 103.53], device=x.device).view(1, 3, 1, 1)
    std = torch.tensor([58.395, 57.12, 57.375], device=x.device).view(1, 3, 1, 1)
    x = (x - mean) / std
    pad = (-size[1] % divisor, -size[0] % divisor)
    return torch.nn.functional.pad(x, (0, pad[0], 0, pad[1])), size


def mask2former_detections(class_logits, mask_logits, resized, image_size, top_k=100):
    """One image's Mask2Former outputs -> [(class index, score, box, mask)] as GenEval's detector post-processes them.

    class_logits (Q, C + 1), the last the no-object class; mask_logits (Q, h, w) at a quarter of the padded input.
    The top_k (query, class) pairs by class probability; each mask's logits upsampled to the padded input, cropped
    to the resized image, resized to the image (bilinear) and thresholded at 0; score = class probability x the mean
    mask probability inside the mask; box = [x min, y min, x max + 1, y max + 1] of the mask (zeros if empty)."""
    probs = class_logits.float().softmax(-1)[:, :-1]
    n_classes = probs.shape[1]
    scores, flat = probs.flatten().topk(min(top_k, probs.numel()))
    queries, labels = flat // n_classes, flat % n_classes
    padded = (mask_logits.shape[-2] * 4, mask_logits.shape[-1] * 4)
    logits = torch.nn.functional.interpolate(mask_logits[queries][:, None].float(), size=padded, mode="bilinear",
                                             align_corners=False)[:, :, :resized[0], :resized[1]]
    logits = torch.nn.functional.interpolate(logits, size=image_size, mode="bilinear", align_corners=False)[:, 0]
    masks = logits > 0
    mask_score = (logits.sigmoid() * masks).flatten(1).sum(1) / (masks.flatten(1).sum(1) + 1e-6)
    # the boxes of all masks at once and one transfer to the host (per-mask .item() calls would sync 400 times)
    rows, cols = masks.any(2), masks.any(1)                                      # (K, H), (K, W)
    y0, y1 = _first_and_last(rows)
    x0, x1 = _first_and_last(cols)
    boxes = torch.stack([x0, y0, x1 + 1, y1 + 1], 1).masked_fill(~rows.any(1, keepdim=True), 0)
    return [(label, score, tuple(box), mask) for label, score, box, mask in
            zip(labels.tolist(), (scores * mask_score).tolist(), boxes.tolist(), masks)]


def _first_and_last(flags):
    """(K, N) booleans -> (first, last) index of a True in each row (N and -1 where there is none)."""
    index = torch.arange(flags.shape[1], device=flags.device)
    return torch.where(flags, index, flags.shape[1]).amin(1), torch.where(flags, index, -1).amax(1)


class GenEval:
    """GenEval's judge, in-process: a Mask2Former detector and a CLIP colour classifier, any device and dtype."""

    def __init__(self, detector, clip, clip_processor, device, dtype=torch.float32):
        self.detector = detector.to(device, dtype).eval().requires_grad_(False)
        self.clip = clip.to(device, dtype).eval().requires_grad_(False)
        self.processor, self.device, self.dtype = clip_processor, device, dtype
        self.colour_classifiers = {}   # class name -> (10, D) normalised text embeddings, one per colour
        self.last = None               # (images, metadata, verdict) of the last call

    @torch.no_grad()
    def colour_classifier(self, name):
        if name not in self.colour_classifiers:
            texts = [t.format(color=c, object=name) for c in GENEVAL_COLORS for t in COLOR_TEMPLATES]
            tokens = self.processor.tokenizer(texts, padding=True, return_tensors="pt").to(self.device)
            emb = _features(self.clip.get_text_features(**tokens)).float()
            emb = emb / emb.norm(dim=-1, keepdim=True)
            emb = emb.view(len(GENEVAL_COLORS), len(COLOR_TEMPLATES), -1).mean(1)
            self.colour_classifiers[name] = emb / emb.norm(dim=-1, keepdim=True)
        return self.colour_classifiers[name]

    @torch.no_grad()
    def colours(self, picture, name, found):
        """The colour of each found object: its mask pasted on a #999 background, cropped to its box, classified by
        CLIP zero-shot over GenEval's 10 colours (its 3 templates averaged per colour)."""
        pixels = self.colour_pixels(picture, found)
        img = _features(self.clip.get_image_features(pixel_values=pixels.to(self.device, self.dtype)))
        img = img.float() / img.float().norm(dim=-1, keepdim=True)
        return [GENEVAL_COLORS[i] for i in (img @ self.colour_classifier(name).T).argmax(1).tolist()]

    def colour_pixels(self, picture, found):
        """CLIP's input for each found object: its mask over #999 grey, cropped to its box, preprocessed as open_clip
        does (the centre crop's offset rounded to nearest, as torchvision's CenterCrop)."""
        crops = []
        for (x0, y0, x1, y1), mask in found:
            pasted = torch.where(mask[None].to(picture.device), picture, torch.full_like(picture, 153 / 255))
            crop = pasted[:, int(y0):max(int(y1), int(y0) + 1), int(x0):max(int(x1), int(x0) + 1)]
            crops.append(clip_pixel_values(crop[None], self.processor.image_processor, round_crop_offset=True))
        return torch.cat(crops)

    @torch.no_grad()
    def judge(self, images, metadata):
        """-> (correct (B,), partial (B,)) float tensors: geneval_rules on each image and its metadata. The last
        verdict is kept, so that geneval and geneval_partial in one spec detect each image once."""
        if self.last is not None and self.last[0] is images and self.last[1] == metadata:
            return self.last[2]
        problem = next(filter(None, map(geneval_metadata_problem, metadata)), None)
        if problem:
            raise RewardError("reward 'geneval' needs GenEval metadata for every prompt (a .jsonl prompt file "
                              'whose lines hold "tag", "include" and "exclude", as prompts/geneval_train.jsonl): '
                              f"{problem}")
        correct, partial = [], []
        for image, meta, found in zip(images, metadata, self.detect(images)):
            objects = geneval_objects([(GENEVAL_CLASSES[c], s, b, m) for c, s, b, m in found], meta.get("tag"))
            picture = (image.detach().to(self.device, torch.float32).clamp(0, 1) * 255).round() / 255
            asked = {}  # both rules ask about the best n objects of a class: classify their colours once

            def colours_of(name, objs):
                if (name, len(objs)) not in asked:
                    asked[name, len(objs)] = self.colours(picture, name, objs)
                return asked[name, len(objs)]

            ok, credit = geneval_rules(meta, objects, colours_of)
            correct.append(float(ok))
            partial.append(credit)
        self.last = (images, metadata, (torch.tensor(correct), torch.tensor(partial)))
        return self.last[2]

    @torch.no_grad()
    def detect(self, images, batch_size=8):
        """(B, 3, H, W) -> each image's mask2former_detections, lazily: batch_size images per detector pass, so
        that only one batch's masks (100 per image at the image's size) are alive at a time."""
        for start in range(0, len(images), batch_size):
            pixels, resized = detector_input(images[start:start + batch_size].to(self.device))
            out = self.detector(pixel_values=pixels.to(self.dtype))
            yield from [mask2former_detections(c, m, resized, tuple(images.shape[-2:]))
                        for c, m in zip(out.class_queries_logits, out.masks_queries_logits)]


_GENEVAL = {}  # (device, dtype) -> GenEval: geneval and geneval_partial in one run share the models


def load_geneval_judge(device, dtype=None):
    key = (str(device), dtype)
    if key not in _GENEVAL:
        from transformers import Mask2FormerForUniversalSegmentation

        try:
            detector = _from_hub("geneval", GENEVAL_DETECTOR, Mask2FormerForUniversalSegmentation.from_pretrained)
        except ImportError as e:
            raise RewardError(f"reward 'geneval' needs {e.name or 'scipy'} (transformers' Mask2Former imports it): "
                              "pip install scipy") from None
        clip, processor = _load_clip(GENEVAL_CLIP, GENEVAL_CLIP, "geneval", device)
        _GENEVAL[key] = GenEval(detector, clip, processor, device, dtype or torch.float32)
    return _GENEVAL[key]


def geneval_reward(judge, partial):
    def fn(images, prompts, metadata=None):
        correct, credit = judge.judge(images, metadata or [None] * len(images))
        return credit if partial else correct

    return fn


def load_geneval(device, dtype=None):
    """GenEval's own per-image score: 1 if every clause of the prompt's metadata holds, else 0 (what GenEval
    reports, for evaluation and the benchmark). Scale: [0, 1]; SD3.5-M about 0.63 on GenEval's prompts, 0.91 after
    the paper's curriculum. Needs the prompts' GenEval metadata (a .jsonl prompt file)."""
    return geneval_reward(load_geneval_judge(device, dtype), partial=False)


def load_geneval_partial(device, dtype=None):
    """GenEval with partial credit, the reward the GenEval stages train on (Flow-GRPO's and DiffusionNFT's): the
    mean over the metadata's clauses of how much of each holds, so a group of images none of which is fully right
    still has an order (a 0/1 reward leaves it all equal, with zero advantages). Scale: at most 1; a count clause
    goes below 0 when more than twice its count is found (it scores 1 - abs(count - found) / count), and so can the
    mean."""
    return geneval_reward(load_geneval_judge(device, dtype), partial=True)


def jpeg_round_trip(images, quality=75):
    """(B, 3, H, W) in [0, 1] -> the same images after JPEG encoding at `quality` and decoding (PIL), on their
    device: what Flow-GRPO's GenEval server scores, since its client sends each image as a quality-75 JPEG."""
    from PIL import Image

    decoded = []
    for im in to_uint8_images(images):
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=quality)
        decoded.append(torch.frombuffer(bytearray(Image.open(buf).convert("RGB").tobytes()), dtype=torch.uint8))
    h, w = images.shape[-2:]
    return torch.stack(decoded).view(-1, h, w, 3).permute(0, 3, 1, 2).to(images.device, torch.float32) / 255


def load_geneval_partial_jpeg(device, dtype=None):
    """geneval_partial on the images as Flow-GRPO's GenEval server receives them, JPEG-encoded at quality 75
    (about 30 ms per 512 px image on a CPU core, well below the detector's pass): for a training run meant to compare
    with Flow-GRPO's. Scale: as geneval_partial's."""
    partial = geneval_reward(load_geneval_judge(device, dtype), partial=True)

    def fn(images, prompts, metadata=None):
        return partial(jpeg_round_trip(images), prompts, metadata)

    return fn


# --------------------------------------------------------------------------- OCR (text rendering)


def edit_distance(a, b):
    """Levenshtein distance: the fewest single-character insertions, deletions and substitutions turning a into b."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


_QUOTED = [re.compile(p) for p in (r'"([^"]*)"', r"“([^”]*)”", r"(?<!\w)'(.*?)'(?!\w)", r"‘([^’]*)’")]


def quoted_text(prompt):
    """The text a prompt asks to render: the first "..." span, else “...”, else '...' (an apostrophe inside a word
    does not open or close one), else ‘...’; None when the prompt quotes nothing."""
    for pattern in _QUOTED:
        match = pattern.search(prompt)
        if match:
            return match.group(1)
    return None


def ocr_score(recognized, target):
    """1 - edit distance / len(target), clipped to [0, 1], after lower-casing and removing all whitespace; 1 when the
    target occurs whole in what was read, as in Flow-GRPO's and DiffusionNFT's OCR reward (other text in the image,
    a sign's border or a second line, costs nothing). An empty target scores 0: there is nothing to read."""
    recognized, target = ("".join(s.lower().split()) for s in (recognized, target))
    if not target:
        return 0.0
    if target in recognized:
        return 1.0
    return max(0.0, 1.0 - edit_distance(recognized, target) / len(target))


def ocr_target(prompt, metadata):
    """The text an image for `prompt` should show: metadata["text"] where the prompt file gives one, else the prompt's
    quoted text; None where neither holds anything but whitespace."""
    target = (metadata or {}).get("text")
    target = quoted_text(prompt) if target is None else target
    return target if target is not None and target.strip() else None


def ocr_reward(read_text):
    """OCR reward from any recogniser `read_text(PIL image) -> str`, against ocr_target; a prompt without a target
    scores 0 (so its whole group has equal rewards and zero advantage: it does not train, but it does not break the
    batch)."""

    def fn(images, prompts, metadata=None):
        rewards = []
        for i, (image, prompt) in enumerate(zip(to_uint8_images(images), prompts)):
            target = ocr_target(prompt, metadata[i] if metadata else None)
            rewards.append(0.0 if target is None else ocr_score(read_text(image), target))
        return torch.tensor(rewards, dtype=torch.float32)

    return fn


def load_ocr(device, dtype=None):
    """OCR reward (Flow-GRPO's text-rendering task) with RapidOCR: PP-OCRv4 detection and recognition in ONNX,
    shipped inside the wheel, so it runs offline on the CPU. Texts of all detected boxes are joined in the
    engine's reading order (top to bottom, left to right) before scoring.

    Scale: [0, 1]; about 0.6 for SD3.5-M on the Flow-GRPO text-rendering prompts, above 0.9 after RL.
    """
    try:
        import numpy as np
        from rapidocr_onnxruntime import RapidOCR
    except ImportError:
        raise RewardError("reward 'ocr' needs rapidocr-onnxruntime: pip install rapidocr-onnxruntime") from None
    engine = RapidOCR()

    def read_text(image):
        result, _ = engine(np.asarray(image))
        return "".join(text for _, text, _ in result or [])

    return ocr_reward(read_text)


def prompt_file_problem(reward_names, prompts, metadata):
    """The first prompt that a reward of `reward_names` cannot score, as a message, or None: checked when a run
    starts, so that a prompt the training would draw hours in fails at once. GenEval needs usable metadata on every
    prompt, the digit rewards one digit per prompt; the ocr reward needs some prompt with a text to render (one
    without scores 0, which is allowed, but a file of them trains on nothing)."""
    geneval = set(reward_names) & {"geneval", "geneval_partial", "geneval_partial_jpeg"}
    digits = set(reward_names) & {"digit", "digit_correct", "digit_knn"}
    for number, (prompt, meta) in enumerate(zip(prompts, metadata), 1):
        if geneval:
            problem = geneval_metadata_problem(meta)
            if problem:
                return f"prompt {number} ({prompt!r}) has no usable GenEval metadata: {problem}"
        if digits:
            try:
                prompted_digit(prompt, meta)
            except RewardError as e:
                return f"prompt {number}: {e}"
    if "ocr" in reward_names and not any(ocr_target(prompt, meta) is not None
                                         for prompt, meta in zip(prompts, metadata)):
        return ('no prompt quotes a text to render (nor gives it as {"text": ...}): the ocr reward would be 0 for '
                "every image")
    return None


# --------------------------------------------------------------------------- remote and user rewards


def http_reward(url, timeout=120.0, retries=3, backoff=2.0):
    """A reward served over HTTP (GenEval, anything you serve). Protocol, JSON only:
    POST {"prompts": [...], "metadata": [...], "images": ["<base64 PNG>", ...]} -> {"rewards": [float, ...]}.
    Failures are retried and named as post_json says."""
    import base64

    def fn(images, prompts, metadata=None):
        encoded = []
        for im in to_uint8_images(images):
            buf = io.BytesIO()
            im.save(buf, format="PNG")
            encoded.append(base64.b64encode(buf.getvalue()).decode("ascii"))
        body = {"prompts": list(prompts), "metadata": metadata or [{} for _ in prompts], "images": encoded}
        answer = post_json(url, body, "reward server", timeout, retries, backoff)
        try:
            return torch.tensor([float(x) for x in answer["rewards"]], dtype=torch.float32)
        except (KeyError, TypeError, ValueError):
            raise RewardError(f"reward server {url} answered something that is not "
                              f'{{"rewards": [float, ...]}}: {str(answer)[:120]}') from None

    return fn


# UnifiedReward (CodeGoat24/UnifiedReward), a VLM judge, as the peers query it: one chat request per image on any
# OpenAI-compatible server (vLLM, SGLang, `transformers serve`). The instructions are the ones its checkpoints were
# trained with, verbatim, as data: Flow-GRPO's and DiffusionNFT's client (rewards.py, unifiedreward_score_sglang) for
# the LLaVA-based judges, UnifiedReward's own inference script for its Qwen-VL ones. The image travels as a content
# part, so the server's chat template places its image tokens (Flow-GRPO's SGLang client also writes a literal
# "<image>\n" at the start of the text, which a server that expands "<image>" itself would count twice).
UNIFIEDREWARD_CRITERIA = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with the provided "
    "caption. Consider the accuracy of depicted objects, their relationships, and attributes as described in the "
    "caption.\n2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail "
    "preservation, color accuracy, and overall aesthetic appeal.\n")
UNIFIEDREWARD_ASK = {
    "llava": "Based on the above criteria, assign a score from 1 to 5 after 'Final Score:'.\n",
    "qwen": "Extract key elements from the provided text caption, evaluate their presence in the generated image "
            "using the format: 'element (type): value' (where value=0 means not generated, and value=1 means "
            "generated), and assign a score from 1 to 5 after 'Final Score:'.\n"}
UNIFIEDREWARD_SCORE = re.compile(r"Final Score:\s*([1-5](?:\.\d+)?)")   # the peers' pattern; 1-5, divided by 5
UNIFIEDREWARD_SIDE = 512          # the peers resize every image to 512 x 512 before encoding it
UNIFIEDREWARD_OPTIONS = {"model": str, "instruction": str, "max_tokens": int, "concurrency": int, "timeout": float,
                         "retries": int}


def unifiedreward_instruction(prompt, kind):
    """The judge's instruction for `prompt`: kind "qwen", the Qwen-VL judges' wording, or "llava", the LLaVA judges'
    (UnifiedReward-7b-v1.5, which the peers serve with SGLang)."""
    ask = UNIFIEDREWARD_ASK[kind]
    return f"{UNIFIEDREWARD_CRITERIA}{ask}Your task is provided as follows:\nText Caption: [{prompt}]"


def unifiedreward_score(answer):
    """The judge's answer -> its first 'Final Score' / 5, or None when the answer has none (the peers then score the
    image 0). The peers' pattern reads one digit 1-5 and any decimals: 'Final Score: 5.5' is 1.1, 'Final Score: 10'
    is 0.2 (its first digit)."""
    match = UNIFIEDREWARD_SCORE.search(answer or "")
    return float(match.group(1)) / 5 if match else None


def parse_unifiedreward_spec(spec):
    """'unifiedreward@http://host:8000/v1?model=ID&max_tokens=512' -> (base URL, {option: value}). The URL is the
    API's base, as an OpenAI client's base_url (vLLM and SGLang: http://host:port/v1)."""
    import urllib.parse

    url = spec.split("@", 1)[1]
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018 - a port that is not a number (a weight after it without a path) fails here
    except ValueError:
        raise ValueError(f"{spec}: the port is not a number (a weight goes after the path: .../v1:0.5)") from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{spec}: expected unifiedreward@http(s)://host:port/v1[?model=ID]")
    options = {}
    for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if key not in UNIFIEDREWARD_OPTIONS:
            raise ValueError(f"{spec}: unknown option '{key}'; valid: {', '.join(UNIFIEDREWARD_OPTIONS)}")
        try:
            options[key] = UNIFIEDREWARD_OPTIONS[key](value)
        except ValueError:
            raise ValueError(f"{spec}: {key}={value!r} is not a {UNIFIEDREWARD_OPTIONS[key].__name__}") from None
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", "")), options


RETRIED_HTTP = (408, 425, 429)   # besides 5xx: time-outs, too early, too many requests


def post_json(url, body, what, timeout=120.0, retries=3, backoff=2.0, headers=None):
    """POST a JSON body (GET without one) -> the decoded JSON answer. Refusals, time-outs, 5xx and RETRIED_HTTP
    answers are retried `retries` times after backoff, 2 backoff, 4 backoff ... seconds; another 4xx (a wrong model
    name, an unknown field) and an answer that is not JSON are final. Every failure is a RewardError naming `what`, the
    URL and the server's own words. Nothing is ever unpickled from the network."""
    import http.client
    import json
    import time
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **(headers or {})}
    data, error, answer = None if body is None else json.dumps(body).encode(), None, None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers),
                                        timeout=timeout) as response:
                answer = response.read()
                break
        except urllib.error.HTTPError as e:
            try:
                said = e.read()[:300].decode(errors="replace")
            except (OSError, http.client.HTTPException):
                said = ""
            error = f"HTTP {e.code}: {said}"
            if e.code < 500 and e.code not in RETRIED_HTTP:
                raise RewardError(f"{what} {url} refused the request ({error})") from None
        except (OSError, http.client.HTTPException) as e:   # refused, timed out, reset, cut short
            error = f"{type(e).__name__}: {e}"
        except ValueError as e:                              # a malformed URL: no use retrying
            raise RewardError(f"{what} {url}: {e}") from None
    if answer is None:
        raise RewardError(f"{what} {url} failed {retries + 1} times ({error})")
    try:
        return json.loads(answer)
    except ValueError:
        raise RewardError(f"{what} {url} answered something that is not JSON: {answer[:120]!r}") from None


def openai_headers():
    """The bearer token of an OpenAI-compatible server started with --api-key, from OPENAI_API_KEY as OpenAI's
    clients read it; sent to the unifiedreward server only."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def served_model(base, timeout=30.0, retries=3, backoff=2.0):
    """The one model an OpenAI-compatible server lists at /models (vLLM, SGLang and `transformers serve` with a model
    named at launch serve one)."""
    answer = post_json(f"{base}/models", None, "unifiedreward server", timeout, retries, backoff, openai_headers())
    listed = [m["id"] for m in answer.get("data", [])] if isinstance(answer, dict) else []
    if len(listed) != 1:
        raise RewardError(f"unifiedreward: {base}/models lists {len(listed)} models ({', '.join(listed[:5])}); name "
                          "one with ?model=ID")
    return listed[0]


def unifiedreward_request(image, prompt, model, kind, max_tokens):
    """One chat completion request: the PIL image resized to 512 x 512 as a PNG data URL, then the instruction."""
    import base64

    buf = io.BytesIO()
    image.resize((UNIFIEDREWARD_SIDE, UNIFIEDREWARD_SIDE)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
    content = [{"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": unifiedreward_instruction(prompt, kind)}]
    return {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens}


def map_failing_fast(fn, items, concurrency):
    """[fn(*item) for item in items], `concurrency` calls at a time. The first call to raise fails the whole map at
    once, and no call is started after it."""
    import threading
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    failed = threading.Event()

    def call(item):
        if failed.is_set():
            return None
        try:
            return fn(*item)
        except BaseException:
            # set by the failing worker itself: its thread takes the next queued item at once, before the pool can
            # be cancelled
            failed.set()
            raise

    pool = ThreadPoolExecutor(max(1, min(concurrency, len(items))))
    futures = [pool.submit(call, item) for item in items]
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    pool.shutdown(wait=False, cancel_futures=True)
    errors = [f.exception() for f in done if f.exception() is not None]
    if errors:
        raise errors[0]
    return [f.result() for f in futures]


def unifiedreward_reward(base, model=None, instruction=None, max_tokens=512, concurrency=16, timeout=300.0, retries=3,
                         backoff=2.0):
    """UnifiedReward on an OpenAI-compatible server at `base` (..../v1): one chat request per image, `concurrency`
    at a time, greedy (temperature 0); reward = the answer's Final Score / 5, or 0 where it has none, as the peers
    score it. instruction: the judges' wording, qwen or llava (default: qwen when the model id names it). The first
    request that fails for good fails the batch at once (the queued ones are cancelled). fn.last_counts["unparsed"]
    is the share of the last batch's answers without a score (logged as reward_unifiedreward_unparsed, and by the
    evaluation, which reads the names in fn.counts); the first such answer is printed once."""
    import sys

    model = model or served_model(base, retries=retries, backoff=backoff)
    kind = instruction or ("qwen" if "qwen" in model.lower() else "llava")
    if kind not in UNIFIEDREWARD_ASK:
        raise RewardError(f"unifiedreward: instruction={kind!r} is none of {', '.join(UNIFIEDREWARD_ASK)}")
    print(f"vgrpo: unifiedreward: {model} at {base}, the {kind} judges' instruction", file=sys.stderr, flush=True)
    warned = []

    def ask(image, prompt):
        body = unifiedreward_request(image, prompt, model, kind, max_tokens)
        answer = post_json(f"{base}/chat/completions", body, "unifiedreward server", timeout, retries, backoff,
                           openai_headers())
        try:
            return answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise RewardError(f"unifiedreward at {base} answered no chat completion: {str(answer)[:200]}") from None

    def fn(images, prompts):
        answers = map_failing_fast(ask, list(zip(to_uint8_images(images), prompts)), concurrency)
        scores = [unifiedreward_score(a) for a in answers]
        missing = [a for a, s in zip(answers, scores) if s is None]
        if missing and not warned:
            warned.append(True)
            print(f"vgrpo: unifiedreward ({model}): an answer without 'Final Score: 1-5', scored 0 (the share is "
                  f"logged as reward_unifiedreward_unparsed): {str(missing[0])[:120]!r}", file=sys.stderr, flush=True)
        fn.last_counts = {"unparsed": len(missing) / max(1, len(answers))}
        return torch.tensor([0.0 if s is None else s for s in scores], dtype=torch.float32)

    fn.last_counts, fn.counts = {}, ("unparsed",)   # named before any call: alike on every rank, called or not
    return fn


def python_reward(path, name):
    """`--reward my_rewards.py:fn`: fn(images, prompts) -> (B,) from a file of your own, no registry edit.
    Declare `fn(images, prompts, metadata=None)` to also receive the prompt file's per-prompt dicts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"user_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise RewardError(f"{path} has no function '{name}'")
    return getattr(module, name)


# --------------------------------------------------------------------------- registry and weighted sums

# name -> loader(device, dtype=None) -> fn(images, prompts[, metadata]); dtype is the model-based rewards' dtype
REWARDS = {"jpeg": load_jpeg, "pickscore": load_pickscore, "clipscore": load_clipscore, "hpsv2": load_hpsv2,
           "aesthetic": load_aesthetic, "imagereward": load_imagereward, "ocr": load_ocr, "digit": load_digit,
           "digit_correct": load_digit_correct, "digit_knn": load_digit_knn, "geneval": load_geneval,
           "geneval_partial": load_geneval_partial, "geneval_partial_jpeg": load_geneval_partial_jpeg}


def _split_weight(item):
    """'name:w' -> ('name', 'w'). URLs keep their port: a trailing ':w' is a weight only after a path."""
    if item.startswith(("http://", "https://", "unifiedreward@")):
        head, _, tail = item.rpartition(":")
        after_scheme = head.split("://", 1)[-1]
        return (head, tail) if "://" in head and "/" in after_scheme and not tail.startswith("//") else (item, "")
    if ".py:" in item:
        path, _, rest = item.partition(".py:")
        fn, _, weight = rest.partition(":")
        return f"{path}.py:{fn}", weight
    name, _, weight = item.partition(":")
    return name, weight


def check_reward_url(url):
    """ValueError for a reward server's URL that cannot be right: no host, or a port that is no number (a weight
    written after the port, http://host:8000:0.5, where a path must come first: http://host:8000/score:0.5)."""
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018 - reading it checks it
    except ValueError:
        raise ValueError(f"{url}: the port is not a number (a weight goes after the path: .../score:0.5)") from None
    if not parts.hostname:
        raise ValueError(f"{url}: no host (expected http(s)://host:port/path)")


def parse_reward_spec(spec):
    """'pickscore:1,clipscore:0.5' -> [('pickscore', 1.0), ('clipscore', 0.5)]; ValueError if malformed.
    Besides registry names: unifiedreward@http(s)://host:port/v1[?model=ID][:w] (UnifiedReward on an OpenAI-compatible
    server), http(s)://host:port/path[:w] (a reward server of this JSON protocol) and file.py:function[:w]."""
    parts = []
    for item in spec.split(","):
        name, weight = _split_weight(item.strip())
        if ".py:" in name:
            if not os.path.isfile(name.partition(".py:")[0] + ".py"):
                raise ValueError(f"reward file not found: {name.partition('.py:')[0]}.py")
        elif name.startswith("unifiedreward@"):
            parse_unifiedreward_spec(name)
        elif name.startswith(("http://", "https://")):
            check_reward_url(name)
        elif name not in REWARDS:
            raise ValueError(f"unknown reward '{name}' in --reward {spec!r}; valid names: {', '.join(REWARDS)}, "
                             "unifiedreward@http(s)://host:port/v1, http(s)://host:port/path or file.py:function")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"reward weight '{weight}' for '{name}' is not a number") from None
        if not math.isfinite(w):
            raise ValueError(f"reward weight for '{name}' must be finite")
        parts.append((name, w))
    if all(w == 0 for _, w in parts):
        raise ValueError(f"every weight in {spec!r} is 0: the reward would be 0 for every image (a weight of 0 "
                         "logs a reward without training on it, beside another that trains)")
    return parts


def metric_name(reward_name):
    """A reward's name as a metric / CSV column: 'pickscore', 'my_rewards.py:colour' -> 'colour',
    'http://host:8000/geneval' -> 'geneval' (the host when there is no path), 'unifiedreward@...' -> 'unifiedreward'."""
    if reward_name.startswith("unifiedreward@"):
        reward_name = "unifiedreward"
    elif ".py:" in reward_name:
        reward_name = reward_name.rpartition(":")[2]
    elif "://" in reward_name:
        rest = reward_name.split("://", 1)[1]
        reward_name = rest.rstrip("/").rpartition("/")[2] if "/" in rest.rstrip("/") else rest.split(":")[0]
    return re.sub(r"\W+", "_", reward_name).strip("_")


def accepts_metadata(fn):
    """True when fn can be called as fn(images, prompts, metadata=...): a `metadata` parameter or **kwargs."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return False
    return any(p.name == "metadata" or p.kind is p.VAR_KEYWORD for p in params)


def as_rewards(value, name, n):
    """A reward's answer -> a float32 CPU tensor of shape (n,): one number per image, as a tensor, a numpy array
    or a list / tuple of numbers; anything else is a RewardError naming the reward."""
    import numpy as np

    if isinstance(value, (list, tuple, np.ndarray)):
        try:
            value = torch.as_tensor(np.asarray(value, dtype=np.float64))
        except (TypeError, ValueError):
            raise RewardError(f"reward '{name}' returned a {type(value).__name__} that is not {n} numbers") from None
    if not isinstance(value, torch.Tensor) or value.shape != (n,) or value.dtype == torch.bool or value.is_complex():
        raise RewardError(f"reward '{name}' returned {type(value).__name__} {tuple(getattr(value, 'shape', ()))}, "
                          f"expected one number per image: a tensor, array or list of shape ({n},)")
    return value.detach().float().cpu()


class WeightedReward:
    """Sum of weighted rewards, checked at the boundary: each part must return B numbers (as_rewards), else
    RewardError names it. `last_parts` keeps each component of the last call for logging, `last_counts` what
    the parts counted (UnifiedReward's share of answers without a score, as 'unifiedreward_unparsed'), under the
    names in `counts`, known before any call;
    `nonfinite` names the parts whose last values were NaN or Inf (the trainer then skips the update).
    `metadata`, a list of B dicts or None, reaches only the parts whose signature accepts it."""

    def __init__(self, parts):
        self.parts = parts  # list of (name, weight, fn)
        self.takes_metadata = {name: accepts_metadata(fn) for name, _, fn in parts}
        self.last_parts, self.last_counts, self.nonfinite = {}, {}, []
        self.counts = [f"{metric_name(name)}_{k}" for name, _, fn in parts for k in getattr(fn, "counts", ())]

    def __call__(self, images, prompts, metadata=None):
        if metadata is not None and len(metadata) != len(images):
            raise RewardError(f"metadata has {len(metadata)} entries for {len(images)} images")
        total = torch.zeros(len(images), dtype=torch.float32)
        self.nonfinite = []
        for name, weight, fn in self.parts:
            r = as_rewards(fn(images, prompts, metadata=metadata) if self.takes_metadata[name] else
                           fn(images, prompts), name, len(images))
            if not torch.isfinite(r).all():
                self.nonfinite.append(name)
            self.last_parts[name] = r
            self.last_counts.update({f"{metric_name(name)}_{k}": v for k, v in getattr(fn, "last_counts", {}).items()})
            total += weight * r
        return total


def _load_one(name, device, dtype):
    if name.startswith("unifiedreward@"):
        base, options = parse_unifiedreward_spec(name)
        return unifiedreward_reward(base, **options)
    if name.startswith(("http://", "https://")):
        return http_reward(name)
    if ".py:" in name:
        path, _, fn = name.partition(".py:")
        return python_reward(path + ".py", fn)
    return REWARDS[name](device, dtype)


def load_reward(spec, device="cpu", dtype=None):
    """Build the reward function for a spec such as 'jpeg' or 'pickscore:1,clipscore:0.5'. The model-based
    rewards run on `device`, the CLIP-family ones in `dtype` (None: float32, as vgrpo runs them; bf16 halves their
    memory but rounds the scores, which the advantages scale up)."""
    return WeightedReward([(name, w, _load_one(name, device, dtype)) for name, w in parse_reward_spec(spec)])
