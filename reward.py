"""Reward models for vgrpo, behind one small contract.

    fn = load_reward("pickscore:1,clipscore:0.5", device)
    r = fn(images, prompts)     # images: float (B, 3, H, W) in [0, 1]; prompts: list of B str
                                # r: torch.float32 tensor of shape (B,), on the CPU

A spec is a comma-separated list of `name[:weight]`; the reward is the weighted sum. Each name maps to
a loader in REWARDS that does its own (heavy) imports, so importing this module is cheap and a reward
you do not use never needs its packages. Model-based rewards can also be built from a model and a
processor you already hold (`clip_similarity_reward`), which is how the tests run them on tiny random
CLIP models without downloading anything.
"""

import io
import math

import torch

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
CLIPSCORE_MODEL = "openai/clip-vit-large-patch14"


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
    epsilon: weight it up for small images (the CPU demo uses `jpeg:100`).
    """
    sizes = []
    for im in to_uint8_images(images):
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=95)
        sizes.append(buf.tell() / 1000.0)
    return -torch.tensor(sizes, dtype=torch.float32) / 500.0


def load_jpeg(device):
    return jpeg_reward


# --------------------------------------------------------------------------- CLIP-similarity rewards


def _features(out):
    # transformers >= 5 returns a model output whose pooler_output holds the projected features
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def clip_similarity_reward(model, processor, device, use_logit_scale, divide_by=1.0):
    """Reward = [logit_scale.exp() *] cos(text embedding, image embedding) / divide_by, for any CLIPModel.

    Images go through the processor as uint8 pictures, exactly as the reward models were trained.
    """
    model = model.to(device).eval().requires_grad_(False)
    max_length = min(processor.tokenizer.model_max_length, model.config.text_config.max_position_embeddings)

    @torch.no_grad()
    def fn(images, prompts):
        pixels = processor(images=to_uint8_images(images), return_tensors="pt")["pixel_values"].to(device)
        text = processor(text=list(prompts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        img = _features(model.get_image_features(pixel_values=pixels))
        txt = _features(model.get_text_features(input_ids=text["input_ids"].to(device),
                                                attention_mask=text["attention_mask"].to(device)))
        cos = torch.nn.functional.cosine_similarity(img.float(), txt.float(), dim=-1)
        scale = model.logit_scale.exp().float() if use_logit_scale else 1.0
        return (scale * cos / divide_by).float().cpu()

    return fn


def _load_clip(model_id, processor_id, reward_name, device):
    from transformers import CLIPModel, CLIPProcessor

    try:
        model = CLIPModel.from_pretrained(model_id)
        processor = CLIPProcessor.from_pretrained(processor_id)
    except (OSError, ValueError) as e:
        raise RewardError(
            f"reward '{reward_name}' needs {model_id} (and {processor_id}), which could not be loaded "
            f"({type(e).__name__}); download them into the Hugging Face cache first "
            f"(`hf download {model_id}`) or run with network access"
        ) from None
    return model, processor


def load_pickscore(device):
    """PickScore (Kirstain et al. 2023): logit_scale.exp() * cos / 26.

    The division by 26 puts values near 0.20-0.25 for SD3.5 / FLUX images, the scale the V-GRPO,
    DiffusionNFT and Flow-GRPO tables report (raw PickScore logits sit near 21-23).
    """
    model, processor = _load_clip(PICKSCORE_MODEL, PICKSCORE_PROCESSOR, "pickscore", device)
    return clip_similarity_reward(model, processor, device, use_logit_scale=True, divide_by=26.0)


def load_clipscore(device):
    """CLIPScore with openai/clip-vit-large-patch14: the plain cosine (= logits / 100), about 0.25-0.35."""
    model, processor = _load_clip(CLIPSCORE_MODEL, CLIPSCORE_MODEL, "clipscore", device)
    return clip_similarity_reward(model, processor, device, use_logit_scale=False)


# --------------------------------------------------------------------------- registry and weighted sums

REWARDS = {"jpeg": load_jpeg, "pickscore": load_pickscore, "clipscore": load_clipscore}


def parse_reward_spec(spec):
    """'pickscore:1,clipscore:0.5' -> [('pickscore', 1.0), ('clipscore', 0.5)]; ValueError if malformed."""
    parts = []
    for item in spec.split(","):
        name, _, weight = item.strip().partition(":")
        if name not in REWARDS:
            raise ValueError(f"unknown reward '{name}' in --reward {spec!r}; valid names: {', '.join(REWARDS)}")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"reward weight '{weight}' for '{name}' is not a number") from None
        if not math.isfinite(w):
            raise ValueError(f"reward weight for '{name}' must be finite")
        parts.append((name, w))
    return parts


class WeightedReward:
    """Sum of weighted rewards; `last_parts` keeps each component of the last call for logging."""

    def __init__(self, parts):
        self.parts = parts  # list of (name, weight, fn)
        self.last_parts = {}

    def __call__(self, images, prompts):
        total = torch.zeros(len(images), dtype=torch.float32)
        for name, weight, fn in self.parts:
            r = fn(images, prompts)
            if not isinstance(r, torch.Tensor) or r.shape != (len(images),) or not r.is_floating_point():
                raise RewardError(f"reward '{name}' returned {type(r).__name__} "
                                  f"{tuple(getattr(r, 'shape', ()))}, expected a float tensor of shape ({len(images)},)")
            r = r.detach().float().cpu()
            self.last_parts[name] = r
            total += weight * r
        return total


def load_reward(spec, device="cpu"):
    """Build the reward function for a spec such as 'jpeg' or 'pickscore:1,clipscore:0.5'."""
    return WeightedReward([(name, w, REWARDS[name](device)) for name, w in parse_reward_spec(spec)])
