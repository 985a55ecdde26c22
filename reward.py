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
import os

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


# --------------------------------------------------------------------------- remote and user rewards


def http_reward(url, timeout=120.0, retries=3, backoff=2.0):
    """A reward served over HTTP (GenEval, UnifiedReward, anything you serve). Protocol, JSON only:
    POST {"prompts": [...], "metadata": [...], "images": ["<base64 PNG>", ...]} -> {"rewards": [float, ...]}.
    A request that fails or times out is retried `retries` times, waiting backoff, 2 backoff, 4 backoff
    seconds; then RewardError names the server. Nothing is ever unpickled from the network.
    """
    import base64
    import json
    import time
    import urllib.error
    import urllib.request

    def fn(images, prompts, metadata=None):
        encoded = []
        for im in to_uint8_images(images):
            buf = io.BytesIO()
            im.save(buf, format="PNG")
            encoded.append(base64.b64encode(buf.getvalue()).decode("ascii"))
        body = json.dumps({"prompts": list(prompts), "metadata": metadata or [{} for _ in prompts],
                           "images": encoded}).encode()
        error = None
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(backoff * 2 ** (attempt - 1))
            try:
                request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    answer = response.read()
            except (OSError, urllib.error.URLError) as e:  # refused, timed out, HTTP 5xx, ...
                error = f"{type(e).__name__}: {e}"
                continue
            try:
                rewards = json.loads(answer)["rewards"]
                return torch.tensor([float(x) for x in rewards], dtype=torch.float32)
            except (ValueError, KeyError, TypeError):
                raise RewardError(f"reward server {url} answered something that is not "
                                  f'{{"rewards": [float, ...]}}: {answer[:120]!r}') from None
        raise RewardError(f"reward server {url} failed {retries + 1} times ({error})")

    return fn


def python_reward(path, name):
    """`--reward my_rewards.py:fn`: fn(images, prompts) -> (B,) from a file of your own, no registry edit."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"user_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise RewardError(f"{path} has no function '{name}'")
    return getattr(module, name)


# --------------------------------------------------------------------------- registry and weighted sums

REWARDS = {"jpeg": load_jpeg, "pickscore": load_pickscore, "clipscore": load_clipscore}


def _split_weight(item):
    """'name:w' -> ('name', 'w'). URLs keep their port: a trailing ':w' is a weight only after a path."""
    if item.startswith(("http://", "https://")):
        head, _, tail = item.rpartition(":")
        after_scheme = head.split("://", 1)[1]
        return (head, tail) if "/" in after_scheme and not tail.startswith("//") else (item, "")
    if ".py:" in item:
        path, _, rest = item.partition(".py:")
        fn, _, weight = rest.partition(":")
        return f"{path}.py:{fn}", weight
    name, _, weight = item.partition(":")
    return name, weight


def parse_reward_spec(spec):
    """'pickscore:1,clipscore:0.5' -> [('pickscore', 1.0), ('clipscore', 0.5)]; ValueError if malformed.
    Besides registry names: http(s)://host:port/path[:w] (a reward server) and file.py:function[:w]."""
    parts = []
    for item in spec.split(","):
        name, weight = _split_weight(item.strip())
        if ".py:" in name:
            if not os.path.isfile(name.partition(".py:")[0] + ".py"):
                raise ValueError(f"reward file not found: {name.partition('.py:')[0]}.py")
        elif not name.startswith(("http://", "https://")) and name not in REWARDS:
            raise ValueError(f"unknown reward '{name}' in --reward {spec!r}; valid names: {', '.join(REWARDS)}, "
                             "http(s)://host:port/path or file.py:function")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"reward weight '{weight}' for '{name}' is not a number") from None
        if not math.isfinite(w):
            raise ValueError(f"reward weight for '{name}' must be finite")
        parts.append((name, w))
    return parts


class WeightedReward:
    """Sum of weighted rewards, checked at the boundary: each part must return a float tensor of shape
    (B,), else RewardError names it. `last_parts` keeps each component of the last call for logging;
    `nonfinite` names the parts whose last values were NaN or Inf (the trainer then skips the update)."""

    def __init__(self, parts):
        self.parts = parts  # list of (name, weight, fn)
        self.last_parts, self.nonfinite = {}, []

    def __call__(self, images, prompts):
        total = torch.zeros(len(images), dtype=torch.float32)
        self.nonfinite = []
        for name, weight, fn in self.parts:
            r = fn(images, prompts)
            if not isinstance(r, torch.Tensor) or r.shape != (len(images),) or not r.is_floating_point():
                raise RewardError(f"reward '{name}' returned {type(r).__name__} "
                                  f"{tuple(getattr(r, 'shape', ()))}, expected a float tensor of shape ({len(images)},)")
            r = r.detach().float().cpu()
            if not torch.isfinite(r).all():
                self.nonfinite.append(name)
            self.last_parts[name] = r
            total += weight * r
        return total


def _load_one(name, device):
    if name.startswith(("http://", "https://")):
        return http_reward(name)
    if ".py:" in name:
        path, _, fn = name.partition(".py:")
        return python_reward(path + ".py", fn)
    return REWARDS[name](device)


def load_reward(spec, device="cpu"):
    """Build the reward function for a spec such as 'jpeg' or 'pickscore:1,clipscore:0.5'."""
    return WeightedReward([(name, w, _load_one(name, device)) for name, w in parse_reward_spec(spec)])
