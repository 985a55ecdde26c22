"""ImageReward in-process (reward.py, on transformers' BLIP) against ImageReward's own code.

tests/fixtures/imagereward was written by ImageReward 1.5's own modules at a tiny random size (make_fixture.py,
run in an environment of its own): the checkpoint in ImageReward.pt's layout, its med_config.json and vocabulary,
images of four sizes with prompts, and what ImageReward computed for them. The port must give the same tokens,
features and scores through the same key renaming and checks the real checkpoint goes through; the fixture's
weights are drawn so that the usual porting mistakes (a LayerNorm eps, swapped projections) move the scores far
beyond the tolerance, which is asserted too. The hub stand-in (hub_standins.py) covers `load_reward` offline.
"""

import functools
import gzip
import io
import json
import math
import os
import re

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

import reward

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "imagereward")
TOLERANCE = 1e-5


def _load_gzip(name):
    with gzip.open(os.path.join(FIXTURE, name), "rb") as f:
        return torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)


@functools.lru_cache(maxsize=None)
def _fixture():
    from transformers import BertTokenizer

    with open(os.path.join(FIXTURE, "med_config.json")) as f:
        med_config = json.load(f)
    cases = _load_gzip("cases.pt.gz")
    tokenizer = reward.imagereward_tokenizer(BertTokenizer.from_pretrained(FIXTURE))   # its vocab.txt
    return _load_gzip("ImageReward.pt.gz"), med_config, cases, tokenizer


def _images(case):
    """The group's PNGs -> (B, 3, H, W) floats in [0, 1], which the reward rounds back to the same uint8."""
    import numpy as np
    from PIL import Image

    arrays = [np.array(Image.open(io.BytesIO(png.numpy().tobytes())).convert("RGB")) for png in case["png"]]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255


def _scores(state_dict=None, med_config=None, vision_heads=None):
    """The port's scores for every fixture image (one forward per size group), from the given checkpoint parts."""
    fixture_state, fixture_config, cases, tokenizer = _fixture()
    model = reward.imagereward_model(state_dict or fixture_state, med_config or fixture_config,
                                     vision_heads=vision_heads or cases["vision_heads"])
    fn = reward.imagereward_reward(model, tokenizer, "cpu")
    return torch.cat([fn(_images(case), case["prompts"]) for case in cases["cases"]]).double()


def _want():
    return torch.cat([case["scores"] for case in _fixture()[2]["cases"]])


# --------------------------------------------------------------------------- the port gives ImageReward's numbers


def test_the_reward_runs_the_vit_and_bert_in_the_dtype_asked_and_the_head_in_float32():
    """The head is one small MLP and stays float32 (as the standardisation after it) whatever dtype it came in; the
    model takes no gradient, however it was loaded."""
    state_dict, med_config, cases, tokenizer = _fixture()
    for dtype, want in ((None, torch.float32), (torch.bfloat16, torch.bfloat16)):
        model = reward.imagereward_model(state_dict, med_config, vision_heads=cases["vision_heads"])
        model.to(torch.float16).requires_grad_(True)
        reward.imagereward_reward(model, tokenizer, "cpu", dtype=dtype)
        assert {p.dtype for part in (model.vision, model.text) for p in part.parameters()} == {want}
        assert {p.dtype for p in model.head.parameters()} == {torch.float32}
        assert not any(p.requires_grad for p in model.parameters())


def test_tokens_features_and_scores_are_imagerewards():
    state_dict, med_config, cases, tokenizer = _fixture()
    model = reward.imagereward_model(state_dict, med_config, vision_heads=cases["vision_heads"])
    fn = reward.imagereward_reward(model, tokenizer, "cpu")
    assert len(tokenizer) == med_config["vocab_size"]                       # + [DEC] + [ENC], as 30522 + 2
    for case in cases["cases"]:
        images, prompts = _images(case), case["prompts"]
        tokens = tokenizer(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
        assert torch.equal(tokens["input_ids"], case["input_ids"]), prompts
        assert torch.equal(tokens["attention_mask"], case["attention_mask"]), prompts
        with torch.no_grad():
            pixels = reward.imagereward_pixel_values(images, model.image_size)
            image_tokens = model.vision(pixel_values=pixels).last_hidden_state
            text = model.text(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                              encoder_hidden_states=image_tokens, is_decoder=False).last_hidden_state[:, 0]
        torch.testing.assert_close(image_tokens[:, 0], case["image_features"], rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(text, case["text_features"], rtol=0, atol=TOLERANCE)
        got = fn(images, prompts)
        assert got.shape == (len(prompts),) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), case["scores"], rtol=0, atol=TOLERANCE)
    # what the cases exercise: a prompt cut at 35 tokens, shorter ones padded; scores that spread
    masks = torch.cat([case["attention_mask"] for case in cases["cases"]])
    assert masks.shape[1] == 35 and masks.all(dim=1).sum() == 1 and (masks.sum(dim=1) < 12).sum() >= 2
    assert _want().max() - _want().min() > 0.5


def test_the_checkpoint_holds_the_unused_keys_the_loader_allows():
    # the fixture's file is ImageReward's whole state dict, so the test above went through the leftover check
    state_dict = _fixture()[0]
    assert {"blip.vision_proj.weight", "blip.text_proj.bias", "blip.text_encoder.embeddings.position_ids"} <= \
        state_dict.keys()
    assert all(k.startswith(("blip.visual_encoder.", "blip.text_encoder.", "mlp.")) or
               k.startswith(reward.IMAGEREWARD_UNUSED) for k in state_dict)


def _swap(state_dict, a, b):
    out = dict(state_dict)
    out[a], out[b] = state_dict[b], state_dict[a]
    return out


def _swap_vision_query_key(state_dict, layer=0):
    out = dict(state_dict)
    for kind in ("weight", "bias"):
        name = f"blip.visual_encoder.blocks.{layer}.attn.qkv.{kind}"
        q, k, v = state_dict[name].chunk(3)
        out[name] = torch.cat([k, q, v])
    return out


TEXT = "blip.text_encoder.encoder.layer"
MISTAKES = ["vision eps 1e-5 (BlipVisionConfig's default)", "vision eps 1e-12", "text eps 1e-6",
            "text self-attention query <-> key", "cross-attention key <-> value", "vision query <-> key in the qkv",
            "centre crop offset floored (CLIPImageProcessor's rule, not torchvision's round)"]


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_porting_mistake_moves_the_scores_far_beyond_the_tolerance(mistake, monkeypatch):
    state_dict, med_config = _fixture()[:2]
    if mistake.startswith("vision eps"):
        monkeypatch.setattr(reward, "BLIP_VIT_EPS", float(mistake.split()[2]))
    elif mistake == "text eps 1e-6":
        med_config = dict(med_config, layer_norm_eps=1e-6)
    elif mistake.startswith("text self-attention"):
        state_dict = _swap(state_dict, f"{TEXT}.0.attention.self.query.weight", f"{TEXT}.0.attention.self.key.weight")
    elif mistake.startswith("centre crop"):       # reward.py's round() -> floor: 63.5 becomes 63, not 64
        monkeypatch.setattr(reward, "round", math.floor, raising=False)
    elif mistake.startswith("cross-attention"):
        state_dict = _swap(state_dict, f"{TEXT}.1.crossattention.self.key.weight",
                           f"{TEXT}.1.crossattention.self.value.weight")
    else:
        state_dict = _swap_vision_query_key(state_dict)
    assert (_scores(state_dict, med_config) - _want()).abs().max() > 5000 * TOLERANCE


def test_the_vision_head_count_matters():
    # the checkpoint cannot say how many heads the ViT has (reward.BLIP_VIT_HEAD_DIM): the fixture's 2 heads of 24
    assert (_scores(vision_heads=1) - _want()).abs().max() > 5000 * TOLERANCE


# --------------------------------------------------------------------------- the checkpoint is checked key by key


@pytest.mark.parametrize("change,named", [
    (lambda sd: dict(sd, **{"blip.itm_head.weight": torch.zeros(2, 32)}), "blip.itm_head.weight"),
    (lambda sd: dict(sd, **{"blip.visual_encoder.blocks.0.attn.relative_position_bias_table": torch.zeros(3)}),
     "blip.visual_encoder.blocks.0.attn.relative_position_bias_table"),
    (lambda sd: {k: v for k, v in sd.items() if k != f"{TEXT}.1.crossattention.self.key.weight"},
     f"{TEXT}.1.crossattention.self.key.weight"),
    (lambda sd: {k: v for k, v in sd.items() if k != "blip.visual_encoder.blocks.1.mlp.fc2.bias"},
     "blip.visual_encoder.blocks.1.mlp.fc2.bias"),
    (lambda sd: {k.replace("blip.", "module.blip.", 1) if "text_encoder" in k else k: v for k, v in sd.items()},
     "module.blip.text_encoder"),
])
def test_a_key_missing_or_unexpected_is_one_line(change, named):
    state_dict, med_config, cases, _ = _fixture()
    with pytest.raises(reward.RewardError, match=r"reward 'imagereward': .* not ImageReward's checkpoint") as e:
        reward.imagereward_model(change(state_dict), med_config, vision_heads=cases["vision_heads"])
    assert named in str(e.value) and "\n" not in str(e.value)


def test_a_config_that_disagrees_with_the_weights_is_one_line():
    state_dict, med_config, cases, _ = _fixture()
    with pytest.raises(reward.RewardError, match="size mismatch") as e:
        reward.imagereward_model(state_dict, dict(med_config, intermediate_size=48), vision_heads=2)
    assert "\n" not in str(e.value)
    with pytest.raises(reward.RewardError, match="lacks") as e:
        reward.imagereward_model(state_dict, {k: v for k, v in med_config.items() if k != "layer_norm_eps"},
                                 vision_heads=2)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- load_reward offline, from the stand-ins


def _layout(keys):
    """Key names with layer indices folded: the structure of a checkpoint whatever its depth."""
    return {re.sub(r"\.\d+\.", ".N.", k) for k in keys if not k.startswith("mlp.")}


def test_load_reward_runs_offline_from_the_standins(use_hub_cache):
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(reward.IMAGEREWARD_REPO, reward.IMAGEREWARD_FILE)
    standin = torch.load(path, map_location="cpu", weights_only=True)
    assert _layout(standin) == _layout(_fixture()[0])          # the layout ImageReward's own code saved

    fn = reward.load_reward("imagereward")
    g = torch.Generator().manual_seed(0)
    images = torch.rand(3, 3, 64, 48, generator=g)
    images[1] = images[0]
    prompts = ["a red cat", "the blue sea and a city", "a red cat"]
    got = fn(images, prompts)
    assert got.shape == (3,) and got.dtype == torch.float32 and torch.isfinite(got).all()
    assert abs(got[0] - got[1]) > 1e-3 and abs(got[0] - got[2]) > 1e-3    # the prompt and the image both count
    one_by_one = torch.cat([fn(images[i:i + 1], prompts[i:i + 1]) for i in range(3)])
    torch.testing.assert_close(got, one_by_one, rtol=0, atol=TOLERANCE)  # padding in a batch changes nothing

    bf16 = reward.load_imagereward("cpu", torch.bfloat16)(images, prompts)
    assert bf16.dtype == torch.float32 and not torch.equal(bf16, got)     # it did run in bf16
    torch.testing.assert_close(bf16, got, rtol=0, atol=0.1)


def test_weights_not_downloaded_is_one_line(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(reward.RewardError, match=f"reward 'imagereward' needs ImageReward.pt from "
                                                 f"{reward.IMAGEREWARD_REPO}") as e:
        reward.load_reward("imagereward")
    assert "\n" not in str(e.value)
