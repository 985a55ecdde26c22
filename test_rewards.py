"""Tests of the rewards in reward.py beyond the CLIP-similarity ones in test_vgrpo.py.

Each value is checked against the formula written again here, on tiny random models built in code (no
download). Optional packages, skipped when absent (CI installs them):
    pip install --no-deps open_clip_torch && pip install ftfy        # reference for the HPSv2 conversion
    pip install --no-deps rapidocr-onnxruntime && pip install onnxruntime opencv-python-headless pyclipper shapely pyyaml six tqdm
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import functools
import importlib
import importlib.util
import random
import sys
import types

import numpy as np
import pytest
import torch

import reward


def _images(n=4, side=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, side, side, generator=g)


# --------------------------------------------------------------------------- OCR: pure parts


def _levenshtein(a, b):
    # the recursive definition, memoised: independent of the table-filling loop in reward.edit_distance
    @functools.lru_cache(maxsize=None)
    def d(i, j):
        if i == 0 or j == 0:
            return i + j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))
    return d(len(a), len(b))


@pytest.mark.parametrize("a,b,want", [("kitten", "sitting", 3), ("flaw", "lawn", 2), ("", "abc", 3), ("abc", "", 3),
                                      ("same", "same", 0), ("abc", "cba", 2), ("", "", 0)])
def test_edit_distance_known_values(a, b, want):
    assert reward.edit_distance(a, b) == want == _levenshtein(a, b)


def test_edit_distance_matches_recursive_definition():
    rng = random.Random(0)
    for _ in range(200):
        a, b = ("".join(rng.choice("abc ") for _ in range(rng.randint(0, 9))) for _ in range(2))
        assert reward.edit_distance(a, b) == _levenshtein(a, b), (a, b)


@pytest.mark.parametrize("prompt,want", [
    ('a neon sign that says "Open 24 Hours" at night', "Open 24 Hours"),
    ("a mug printed with 'coffee first' and 'tea'", "coffee first"),
    ("the baker's sign reads 'don't panic'", "don't panic"),       # apostrophes inside words do not quote
    ('a cake with “Happy Birthday” on it', "Happy Birthday"),
    ("'single' then \"double\"", "double"),                          # double quotes win
    ("a cat on a sofa", None),
])
def test_quoted_text(prompt, want):
    assert reward.quoted_text(prompt) == want


def test_ocr_score_is_one_minus_normalised_distance():
    assert reward.ocr_score("Open 24 hours", "open24 HOURS") == 1.0     # case and spaces are ignored
    assert reward.ocr_score("opem24hours", "Open 24 Hours") == pytest.approx(1 - 1 / 11)
    assert reward.ocr_score("", "abcd") == 0.0
    assert reward.ocr_score("a much longer wrong text", "abc") == 0.0   # clipped at 0
    assert reward.ocr_score("", "") == 1.0 and reward.ocr_score("x", "") == 0.0


def test_ocr_reward_targets_and_metadata():
    seen = []
    fn = reward.ocr_reward(lambda image: seen.append(image.size) or "Hello Wrld")
    prompts = ['a sign "hello world"', "no quotes here", 'a sign "abc"']
    got = fn(_images(3), prompts)
    np.testing.assert_allclose(got.numpy(), [1 - 1 / 10, 0.0, 0.0], rtol=1e-6)
    got = fn(_images(3), prompts, metadata=[{}, {"text": "hello world"}, {"text": "Hello Wrld"}])
    np.testing.assert_allclose(got.numpy(), [1 - 1 / 10, 1 - 1 / 10, 1.0], rtol=1e-6)
    assert seen[0] == (32, 32) and got.dtype == torch.float32


# --------------------------------------------------------------------------- OCR with RapidOCR on rendered text


def _render(text, size=(176, 160)):
    # RapidOCR scales the short side up to 736 px before detection: a squarish image keeps that cheap
    from PIL import Image, ImageDraw, ImageFont
    im = Image.new("RGB", size, "white")
    ImageDraw.Draw(im).text((8, 60), text, fill="black", font=ImageFont.load_default(size=26))
    return torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).float() / 255


def test_ocr_reward_reads_rendered_text():
    pytest.importorskip("rapidocr_onnxruntime")
    fn = reward.load_reward("ocr")
    hello, flow = _render("Hello World"), _render("Flow Match")
    prompts = ['a sign that says "Hello World"', "a poster",                    # target from the prompt, metadata
               'a sign that says "Goodbye Moon"', "a poster with the text 'Reward Model'"]   # wrong targets
    got = fn(torch.stack([hello, flow, hello, flow]), prompts, metadata=[{}, {"text": "FLOW MATCH"}, {}, {}])
    assert got.shape == (4,) and got.dtype == torch.float32
    assert (got[:2] >= 0.9).all() and (got[2:] <= 0.5).all(), got
    assert fn(torch.stack([hello, flow]), ["a sign", "a poster"]).tolist() == [0.0, 0.0]   # nothing to read: 0


# --------------------------------------------------------------------------- metadata plumbing


def test_metadata_reaches_rewards_that_accept_it(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text("import torch\n"
                    "def with_meta(images, prompts, metadata=None):\n"
                    "    return torch.tensor([float(m['n']) for m in metadata])\n"
                    "def with_kwargs(images, prompts, **kw):\n"
                    "    return torch.tensor([float(len(m['tag'])) for m in kw['metadata']])\n"
                    "def plain(images, prompts):\n"
                    "    return torch.ones(len(images))\n")
    fn = reward.load_reward(f"{path}:with_meta:2,{path}:with_kwargs:-1,{path}:plain:0.5")
    metadata = [{"n": 1, "tag": "a"}, {"n": 5, "tag": "bcd"}, {"n": -2, "tag": ""}]
    got = fn(_images(3), ["x", "y", "z"], metadata)
    np.testing.assert_allclose(got.numpy(), [2 * 1 - 1 + 0.5, 2 * 5 - 3 + 0.5, 2 * -2 - 0 + 0.5])
    assert fn.last_parts[f"{path}:with_meta"].tolist() == [1.0, 5.0, -2.0]
    assert fn.last_parts[f"{path}:plain"].tolist() == [1.0, 1.0, 1.0]
    assert reward.load_reward(f"{path}:plain")(_images(3), ["x", "y", "z"]).tolist() == [1.0] * 3  # no metadata
    with pytest.raises(reward.RewardError, match="metadata has 2 entries for 3 images"):
        fn(_images(3), ["x", "y", "z"], metadata[:2])


# --------------------------------------------------------------------------- aesthetic


def test_aesthetic_matches_formula():
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel
    torch.manual_seed(0)
    config = CLIPConfig(text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, max_position_embeddings=16),
                        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=32, patch_size=8), projection_dim=24)
    model = CLIPModel(config).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    mlp = reward.AestheticMLP(dim=24)
    for p in mlp.parameters():   # weights of a readable size (the default init shrinks the output to ~1e-3)
        torch.nn.init.normal_(p, std=0.3)
    images = _images(4, seed=1)
    got = reward.aesthetic_reward(model, processor, mlp, "cpu")(images, [""] * 4)

    pixels = processor(images=reward.to_uint8_images(images), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        pooled = model.vision_model(pixel_values=pixels).pooler_output        # CLS token after post-LayerNorm
        e = model.visual_projection(pooled)
        x = e / e.norm(dim=-1, keepdim=True)
        for layer in [m for m in mlp.layers if isinstance(m, torch.nn.Linear)]:  # dropout is off in eval
            x = x @ layer.weight.T + layer.bias
    assert got.shape == (4,) and got.dtype == torch.float32
    torch.testing.assert_close(got, x[:, 0], rtol=1e-5, atol=1e-5)
    assert [k for k in mlp.state_dict()][::2] == [f"layers.{i}.weight" for i in (0, 2, 4, 6, 7)]  # the .pth's names


# --------------------------------------------------------------------------- HPSv2: OpenCLIP weights in a CLIPModel


def _import_open_clip_model():
    """open_clip.model and open_clip.tokenizer without running open_clip/__init__.py, which imports torchvision
    (not installed here) for its image transforms; the model code needs one torchvision class, stubbed."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None:
        pytest.skip("open_clip_torch is not installed (pip install --no-deps open_clip_torch && pip install ftfy)")
    pytest.importorskip("ftfy")
    import transformers  # noqa: F401  (first: transformers probes for torchvision and must not see the stub)
    stubs = {}
    if importlib.util.find_spec("torchvision") is None:
        misc = types.ModuleType("torchvision.ops.misc")
        misc.FrozenBatchNorm2d = type("FrozenBatchNorm2d", (torch.nn.Module,), {})
        stubs = {"torchvision": types.ModuleType("torchvision"), "torchvision.ops": types.ModuleType("torchvision.ops"),
                 "torchvision.ops.misc": misc}
    if "open_clip" not in sys.modules:
        package = types.ModuleType("open_clip")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["open_clip"] = package
    sys.modules.update(stubs)
    try:
        return importlib.import_module("open_clip.model"), importlib.import_module("open_clip.tokenizer")
    finally:
        for name in stubs:
            sys.modules.pop(name, None)


def test_hpsv2_conversion_matches_openclip():
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer
    oc_model, oc_tokenizer = _import_open_clip_model()
    torch.manual_seed(0)
    ctx = 16
    oc = oc_model.CLIP(embed_dim=16,
                       vision_cfg=oc_model.CLIPVisionCfg(layers=2, width=32, head_width=8, patch_size=8, image_size=32),
                       text_cfg=oc_model.CLIPTextCfg(context_length=ctx, vocab_size=49408, width=32, heads=4, layers=2)).eval()
    with torch.no_grad():  # OpenCLIP zero-initialises some biases; random ones test that they are mapped
        for name, p in oc.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)

    # the same BPE as a transformers tokenizer, built from OpenCLIP's own vocabulary and merges
    bpe = oc_tokenizer.SimpleTokenizer(context_length=ctx)
    sot, eot = bpe.decoder[bpe.sot_token_id], bpe.decoder[bpe.eot_token_id]
    tokenizer = CLIPTokenizer(vocab=bpe.encoder, merges=sorted(bpe.bpe_ranks, key=bpe.bpe_ranks.get),
                              bos_token=sot, eos_token=eot, pad_token=eot, unk_token=eot, model_max_length=ctx)
    processor = CLIPProcessor(CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
                              tokenizer)
    config = CLIPConfig(
        text_config=dict(vocab_size=49408, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=ctx, hidden_act="gelu",
                         bos_token_id=49406, eos_token_id=49407, pad_token_id=49407),
        vision_config=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8, hidden_act="gelu"), projection_dim=16)
    hf = CLIPModel(config)
    hf.load_state_dict(reward.openclip_to_transformers(oc.state_dict()))   # strict: every weight mapped once

    images, prompts = _images(4, seed=2), ["a red cat", "two dogs playing chess", "A house!", "photo of the sea"]
    got = reward.clip_similarity_reward(hf, processor, "cpu", use_logit_scale=False)(images, prompts)
    pixels = processor(images=reward.to_uint8_images(images), return_tensors="pt")["pixel_values"]
    with torch.no_grad():   # HPSv2's score: normalised OpenCLIP features, image @ text.T, the diagonal
        img = oc.encode_image(pixels, normalize=True)
        tokens = bpe(prompts)                                               # padded with 0 to ctx
        txt = oc.encode_text(tokens, normalize=True)
    want = (img * txt).sum(-1)
    assert tokenizer(prompts)["input_ids"] == [[t for t in row if t] for row in tokens.tolist()]  # same tokens
    assert got.shape == (4,) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- errors name what is missing


@pytest.mark.parametrize("name,package", [("ocr", "rapidocr-onnxruntime"), ("imagereward", "image-reward")])
def test_missing_optional_package_is_one_line(monkeypatch, name, package):
    monkeypatch.setitem(sys.modules, {"ocr": "rapidocr_onnxruntime", "imagereward": "ImageReward"}[name], None)
    with pytest.raises(reward.RewardError, match=f"pip install {package}") as e:
        reward.load_reward(name)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name,repo", [("hpsv2", reward.HPS_REPO), ("aesthetic", reward.AESTHETIC_CLIP)])
def test_weights_not_downloaded_is_one_line(name, repo):
    with pytest.raises(reward.RewardError, match=f"reward '{name}' needs .*{repo}") as e:
        reward.load_reward(name)
    assert "\n" not in str(e.value)


def test_every_registered_reward_states_its_scale():
    for name, loader in reward.REWARDS.items():
        assert "Scale:" in (loader.__doc__ or ""), f"load_{name} does not say what values to expect"
