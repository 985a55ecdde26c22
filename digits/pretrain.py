"""Pretrain the CPU demo's model: a tiny Stable Diffusion 3 that draws the handwritten digit its prompt names.

    python digits/pretrain.py             # writes digits/pipeline/, digits/classifiers.safetensors, the prompt files
    python digits/pretrain.py --quick --out /tmp/d   # the same code at toy lengths, in seconds (what the tests run)

The outputs are committed, so users and CI never run this; it exists so that the model is made by the project in
the open and can be made again (deterministic for a seed on one machine; about 4 minutes on 2 CPU cores).

Data: scikit-learn's copy of the test set of the UCI "Optical Recognition of Handwritten Digits" data (E. Alpaydin
and C. Kaynak, 1998; licence CC BY 4.0 on the UCI Machine Learning Repository): 1,797 8x8 images of ink counts
0-16 from 13 writers, shipped inside the scikit-learn package (sklearn/datasets/data/digits.csv.gz), so nothing
is downloaded. A seeded, per-digit split keeps 20% of the images out of every training below.

What is made, in order:
 1. The two judges (digits/classifiers.safetensors, reward.DigitJudge), both on reward.digit_ink (an image as
    16 x 16 ink): a small CNN over the ten digits and "no digit" (made-up non-digits: bars, blobs, overlaid
    digits, speckle), whose probability of the prompted digit is the `digit` reward, and a 5-nearest-neighbour
    vote over the training images that counts only images near some real digit, an independent second opinion
    (`digit_knn`) that shows when RL has found images the CNN likes but no handwriting resembles. (A logistic
    regression on 8x8 ink, tried first, was fooled within 20 RL iterations: a thick bottom bar scored as a 2.)
 2. A VAE that downsamples 2x into 4 channels (vgrpo.tiny_vae), trained as an autoencoder with a small KL term on
    the digits drawn 16 px, dark ink on white; its scaling and shift factors are then set from the latents, as
    SD3's are.
 3. An SD3 transformer (4 MMDiT layers of 4 heads x 32, 2.3M weights, 64 latent tokens) trained by rectified
    flow with logit-normal noise levels, together with two byte-level CLIP text encoders (vgrpo.tiny_clip_text):
    frozen random encoders encode a prompt's phrasing, not its digit, and the model then stays at chance. Half of
    the captions are dropped (the empty prompt), an EMA of the weights is what is saved. The pipeline has no T5
    and its prompts are the CLIP tokens alone, as vgrpo encodes a T5-less SD3.
 4. The base model's accuracy on the held-out phrasings, measured as vgrpo's evaluation measures it (the same
    sampler, grid and classifier). The pretraining length is chosen so that it is right a third to a half of the
    time: far from perfect, clearly above chance (10%), as a base model is on GenEval.

Prompts: ten phrasings per digit are the captions here and RL's training prompts (prompts/digits_train.jsonl); two
more are held out for evaluation (prompts/digits_eval.jsonl); each line carries its digit and a tag for per-digit
metrics.
"""

import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import reward  # noqa: E402
import vgrpo  # noqa: E402

# Captions: ten phrasings per digit, the pretraining captions and RL's training prompts (prompts/digits_train.jsonl);
# two more, which neither ever sees, are RL's held-out evaluation (prompts/digits_eval.jsonl): new combinations of
# words the model has seen. (With four training phrasings instead of ten, held-out accuracy after the demo's 80
# iterations was 0.68 instead of 0.76 on seed 0.)
TRAIN_PHRASINGS = ("a handwritten digit {}", "the number {}", "a drawing of a {}", "{}, written by hand",
                   "a {} in black ink", "the numeral {}", "a scanned {}", "an image of a {}", "{} on white paper",
                   "digit: {}")
EVAL_PHRASINGS = ("the digit {}", "a handwritten {}")

SETTINGS = dict(
    seed=0, held_out=0.2,
    classifier_steps=1500, classifier_batch=96, classifier_lr=2e-3, knn=5, knn_margin=1.25,
    vae_steps=1500, vae_batch=64, vae_lr=1e-3, vae_kl=1e-4,
    steps=500, batch=64, lr=1e-3, warmup=50, caption_dropout=0.3, ema=0.995, shift=1.0,
    eval_images=16, eval_steps=12,
)
QUICK = dict(classifier_steps=30, vae_steps=20, steps=10, eval_images=2, eval_steps=4, warmup=2)


def load_split(seed, held_out):
    """-> (train images, train labels, held-out images, held-out labels): images (N, 3, 16, 16) in [0, 1], dark ink
    on white, drawn from the 8x8 ink counts by bilinear upsampling; held_out of every digit's images kept apart."""
    from sklearn.datasets import load_digits

    data = load_digits()
    ink = torch.tensor(data.images, dtype=torch.float32) / 16                 # (1797, 8, 8), 1 = full ink
    labels = torch.tensor(data.target)
    up = F.interpolate(ink[:, None], scale_factor=2, mode="bilinear", align_corners=False).clamp(0, 1)
    images = (1 - up).expand(-1, 3, -1, -1).contiguous()
    g = torch.Generator().manual_seed(seed)
    train, test = [], []
    for d in range(10):
        idx = (labels == d).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        cut = round(len(idx) * held_out)
        test.append(idx[:cut])
        train.append(idx[cut:])
    train, test = torch.cat(train), torch.cat(test)
    return images[train], labels[train], images[test], labels[test]


def made_up_non_digits(n, digit_ink, digit_labels, g):
    """n images (n, 1, 16, 16) of ink that show no digit, for the CNN's "no digit" class, a quarter of each kind:
    one to three filled bars or rectangles; thresholded blobs of smooth noise; two different digits overlaid;
    random speckle. They are the cheap shortcuts RL finds against a classifier that knows only digits."""
    out = torch.zeros(n, 1, 16, 16)
    for i in range(n):
        kind = i % 4
        if kind == 0:
            for _ in range(int(torch.randint(1, 4, (), generator=g))):
                top, left = torch.randint(0, 14, (2,), generator=g).tolist()
                height, width = torch.randint(2, 9, (2,), generator=g).tolist()
                out[i, 0, top:top + height, left:left + width] = 0.5 + 0.5 * torch.rand((), generator=g)
        elif kind == 1:
            smooth = F.interpolate(torch.randn(1, 1, 4, 4, generator=g), size=16, mode="bilinear", align_corners=False)
            out[i] = (smooth[0].sigmoid() > 0.4 + 0.4 * torch.rand((), generator=g)).float()
        elif kind == 2:
            a, b = torch.randint(len(digit_ink), (2,), generator=g).tolist()
            while digit_labels[a] == digit_labels[b]:
                b = int(torch.randint(len(digit_ink), (), generator=g))
            out[i] = torch.maximum(digit_ink[a], digit_ink[b])
        else:
            out[i] = (torch.rand(1, 16, 16, generator=g) < 0.5 * torch.rand((), generator=g)).float()
    return out


def train_classifiers(images, labels, held_out_images, settings):
    """The judges' tensors (classifiers.safetensors): the CNN over ten digits and "no digit", trained with AdamW on
    the digits (shifted by up to a pixel) and fresh made-up non-digits every step, and the k-NN's reference ink with
    its distance gate: knn_margin times the largest distance of a held-out digit to its nearest training digit
    (generated digits are smoother than scanned ones, hence the margin; bars and blobs lie far beyond it)."""
    torch.manual_seed(settings["seed"])
    g = torch.Generator().manual_seed(settings["seed"] + 10)
    ink = reward.digit_ink(images)
    cnn = torch.nn.Sequential(                       # the layout reward.DigitJudge.logits computes
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
        torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(64 * 4 * 4, 11))
    opt = torch.optim.AdamW(cnn.parameters(), lr=settings["classifier_lr"], weight_decay=1e-4)
    for step in range(settings["classifier_steps"]):
        idx = torch.randint(len(ink), (settings["classifier_batch"],), generator=g)
        shift = torch.randint(-1, 2, (2,), generator=g).tolist()
        x = torch.cat([torch.roll(ink[idx], shift, (2, 3)),
                       made_up_non_digits(settings["classifier_batch"] // 3, ink, labels, g)])
        y = torch.cat([labels[idx], torch.full((settings["classifier_batch"] // 3,), reward.NO_DIGIT)])
        loss = F.cross_entropy(cnn(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    reference = ink.flatten(1)
    nearest = torch.cdist(reward.digit_ink(held_out_images).flatten(1), reference).min(1).values
    return {**{f"cnn.{k}": v.detach().contiguous() for k, v in cnn.state_dict().items()},
            "knn.ink": reference.half().contiguous(), "knn.labels": labels.to(torch.int64).contiguous(),
            "knn.k": torch.tensor(settings["knn"]), "knn.max_distance": settings["knn_margin"] * nearest.max()}


def caption(digit, phrasings, g):
    return phrasings[torch.randint(len(phrasings), (), generator=g)].format(reward.DIGIT_WORDS[digit])


def train_vae(images, settings):
    torch.manual_seed(settings["seed"])
    vae = vgrpo.tiny_vae(1.0, 0.0).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=settings["vae_lr"], weight_decay=0.0)
    g = torch.Generator().manual_seed(settings["seed"] + 1)
    for step in range(settings["vae_steps"]):
        x = images[torch.randint(len(images), (settings["vae_batch"],), generator=g)] * 2 - 1
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=g)
        recon = vae.decode(z).sample
        loss = F.mse_loss(recon, x) + settings["vae_kl"] * posterior.kl().mean() / z[0].numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 250 == 0 or step == settings["vae_steps"] - 1:
            print(f"vae step {step + 1}/{settings['vae_steps']}: loss {loss.item():.5f}", flush=True)
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        z = torch.cat([vae.encode(images[i:i + 256] * 2 - 1).latent_dist.mean for i in range(0, len(images), 256)])
        recon = torch.cat([vae.decode(z[i:i + 256]).sample for i in range(0, len(z), 256)])
    shift, scale = z.mean().item(), 1 / z.std().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    mse = F.mse_loss((recon / 2 + 0.5).clamp(0, 1), images).item()
    print(f"vae: reconstruction mse {mse:.5f} (the data's variance {images.var().item():.5f}); latents shift "
          f"{shift:.4f}, scaling {scale:.4f}", flush=True)
    return vae, {"vae_reconstruction_mse": mse, "data_variance": images.var().item()}


def build_pipeline(vae, settings):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(settings["seed"] + 2)
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=1, in_channels=4, num_layers=4, attention_head_dim=32, num_attention_heads=4,
        joint_attention_dim=64, caption_projection_dim=128, pooled_projection_dim=64, out_channels=4,
        pos_embed_max_size=8)
    tokenizer, text_encoder = vgrpo.tiny_clip_text(True, settings["seed"] + 3)
    tokenizer_2, text_encoder_2 = vgrpo.tiny_clip_text(True, settings["seed"] + 4)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=settings["shift"]), vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=None, tokenizer_3=None)


def train_generator(pipe, images, labels, settings, evaluate_at=(), judge=None, test=None):
    """Rectified flow on the VAE's latents, the transformer and both text encoders trained together; the EMA
    weights are copied into the pipeline at the end."""
    family = vgrpo.SD3Family(pipe, 16, 0, torch.device("cpu"))
    vae = pipe.vae
    with torch.no_grad():
        mean = torch.cat([vae.encode(images[i:i + 256] * 2 - 1).latent_dist.mean for i in range(0, len(images), 256)])
        latents = (mean - vae.config.shift_factor) * vae.config.scaling_factor
    modules = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]
    params = [p for m in modules for p in m.parameters()]
    for m in modules:
        m.train().requires_grad_(True)
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=settings["lr"], weight_decay=0.0)
    g = torch.Generator().manual_seed(settings["seed"] + 5)
    history = []
    start = time.time()
    for step in range(settings["steps"]):
        for group in opt.param_groups:
            group["lr"] = settings["lr"] * min(1.0, (step + 1) / settings["warmup"])
        idx = torch.randint(len(latents), (settings["batch"],), generator=g)
        o = latents[idx]
        prompts = [caption(int(d), TRAIN_PHRASINGS, g) for d in labels[idx]]
        drop = torch.rand(len(prompts), generator=g) < settings["caption_dropout"]
        prompts = ["" if dropped else p for p, dropped in zip(prompts, drop.tolist())]
        sigma = torch.sigmoid(torch.randn(len(o), generator=g))               # logit-normal noise levels
        eps = torch.randn(o.shape, generator=g)
        x = (1 - sigma.view(-1, 1, 1, 1)) * o + sigma.view(-1, 1, 1, 1) * eps
        v = family.velocity(pipe.transformer, x, sigma, family.encode_texts(prompts))
        loss = F.mse_loss(v, eps - o)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(settings["ema"], (1 + step) / (10 + step))
        with torch.no_grad():
            for e, p in zip(ema, params):
                e.lerp_(p, 1 - decay)
        if (step + 1) % 50 == 0 or step + 1 == settings["steps"]:
            print(f"step {step + 1}/{settings['steps']}: loss {loss.item():.4f} ({time.time() - start:.0f} s)",
                  flush=True)
        if step + 1 in evaluate_at:
            with swapped(params, ema):
                history.append({"step": step + 1, **base_accuracy(pipe, judge, settings)})
            print(f"  step {step + 1}: {history[-1]}", flush=True)
    with torch.no_grad():
        for e, p in zip(ema, params):
            p.copy_(e)
    for m in modules:
        m.eval().requires_grad_(False)
    return history


@contextlib.contextmanager
def swapped(params, ema):
    """Evaluate with the EMA weights, then put the trained ones back."""
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)


@torch.no_grad()
def base_accuracy(pipe, judge, settings):
    """Accuracy of the pipeline on the held-out phrasings, as vgrpo's evaluation measures it: DPM-Solver++ on the
    pipeline's grid, no guidance, the fixed noises keyed by prompt and image, both judges."""
    family = vgrpo.SD3Family(pipe, 16, 0, torch.device("cpu"))
    modes = [m.training for m in (pipe.transformer, pipe.text_encoder, pipe.text_encoder_2)]
    for m in (pipe.transformer, pipe.text_encoder, pipe.text_encoder_2):
        m.eval()
    sigmas = family.sigma_grid(settings["eval_steps"])
    prompts, digits = [], []
    for phrasing in EVAL_PHRASINGS:
        for d in range(10):
            prompts += [phrasing.format(reward.DIGIT_WORDS[d])] * settings["eval_images"]
            digits += [d] * settings["eval_images"]
    keys = [("eval", i // settings["eval_images"], i % settings["eval_images"]) for i in range(len(prompts))]
    noise = torch.stack([torch.randn(family.latent_shape, generator=vgrpo.keyed_generator(*k)) for k in keys])
    images = []
    for start in range(0, len(prompts), 64):
        cond = family.encode_texts(prompts[start:start + 64])
        o = vgrpo.sample_ode(lambda x, s: family.velocity(pipe.transformer, x, s, cond), noise[start:start + 64],
                             sigmas)
        images.append(family.decode(o))
    images = torch.cat(images)
    for m, mode in zip((pipe.transformer, pipe.text_encoder, pipe.text_encoder_2), modes):
        m.train(mode)
    digits = torch.tensor(digits)
    logistic, knn = judge.predict(images), judge.knn_predict(images)
    per_digit = [(logistic[digits == d] == d).float().mean().item() for d in range(10)]
    return {"accuracy": (logistic == digits).float().mean().item(),
            "knn_accuracy": (knn == digits).float().mean().item(),
            "per_digit": [round(a, 3) for a in per_digit]}


def write_prompts(directory):
    for name, phrasings in (("digits_train.jsonl", TRAIN_PHRASINGS), ("digits_eval.jsonl", EVAL_PHRASINGS)):
        with open(os.path.join(directory, name), "w") as f:
            for phrasing in phrasings:
                for d in range(10):
                    word = reward.DIGIT_WORDS[d]
                    f.write(json.dumps({"prompt": phrasing.format(word), "digit": d, "tag": word}) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=HERE, help="folder for pipeline/ and classifiers.safetensors (default: digits/)")
    p.add_argument("--quick", action="store_true", help="toy lengths, for the tests")
    p.add_argument("--steps", type=int, help="transformer training steps (default %d)" % SETTINGS["steps"])
    p.add_argument("--lr", type=float)
    p.add_argument("--caption-dropout", type=float)
    p.add_argument("--evaluate-at", default="", help="comma-separated steps at which to report the accuracy")
    a = p.parse_args(argv)
    settings = dict(SETTINGS, **(QUICK if a.quick else {}))
    for name in ("steps", "lr", "caption_dropout"):
        if getattr(a, name) is not None:
            settings[name] = getattr(a, name)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    os.makedirs(a.out, exist_ok=True)
    started = time.time()
    train_x, train_y, test_x, test_y = load_split(settings["seed"], settings["held_out"])
    print(f"data: {len(train_x)} training and {len(test_x)} held-out digits", flush=True)

    from safetensors.torch import save_file

    tensors = train_classifiers(train_x, train_y, test_x, settings)
    path = os.path.join(a.out, "classifiers.safetensors")
    save_file(tensors, path)
    judge = reward.DigitJudge.load(path)
    g = torch.Generator().manual_seed(settings["seed"] + 11)
    fakes = made_up_non_digits(400, reward.digit_ink(train_x), train_y, g).expand(-1, 3, -1, -1)
    results = {"classifier_held_out_accuracy": (judge.predict(test_x) == test_y).float().mean().item(),
               "knn_held_out_accuracy": (judge.knn_predict(test_x) == test_y).float().mean().item(),
               "classifier_rejects_non_digits": (judge.predict(1 - fakes) == reward.NO_DIGIT).float().mean().item(),
               "knn_rejects_non_digits": (judge.knn_predict(1 - fakes) == reward.NO_DIGIT).float().mean().item()}
    print(f"judges on held-out digits: CNN {results['classifier_held_out_accuracy']:.3f}, {settings['knn']}-NN "
          f"{results['knn_held_out_accuracy']:.3f}; on new made-up non-digits, 'no digit' from the CNN "
          f"{results['classifier_rejects_non_digits']:.3f}, the k-NN {results['knn_rejects_non_digits']:.3f}",
          flush=True)

    vae, vae_results = train_vae(train_x, settings)
    results.update(vae_results)
    pipe = build_pipeline(vae, settings)
    evaluate_at = {int(s) for s in a.evaluate_at.split(",") if s}
    results["history"] = train_generator(pipe, train_x, train_y, settings, evaluate_at, judge)
    results.update(base_accuracy(pipe, judge, settings))
    print(f"base model on the held-out phrasings: accuracy {results['accuracy']:.3f} (5-NN "
          f"{results['knn_accuracy']:.3f}); per digit {results['per_digit']}", flush=True)
    pipe.save_pretrained(os.path.join(a.out, "pipeline"))
    if not a.quick:
        write_prompts(os.path.join(ROOT, "prompts"))
    results["seconds"] = time.time() - started
    with open(os.path.join(a.out, "pretrain.json"), "w") as f:
        json.dump({"settings": settings, "results": results}, f, indent=1)
    print(f"done in {results['seconds']:.0f} s: {a.out}", flush=True)


if __name__ == "__main__":
    main()
