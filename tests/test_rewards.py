"""Tests of the rewards in reward.py on their own (the training runs that use them: test_vgrpo.py).

Each value is checked against the formula written again here, on tiny random models built in code (no
download). Optional packages, skipped when absent (CI installs them):
    pip install --no-deps open_clip_torch && pip install ftfy        # reference for the HPSv2 conversion
    pip install --no-deps rapidocr-onnxruntime && pip install onnxruntime opencv-python-headless pyclipper shapely pyyaml six tqdm
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import functools
import glob
import importlib
import importlib.util
import json
import random
import re
import shutil
import sys
import types

import numpy as np
import pytest
import torch

import reward
import vgrpo


def _images(n=4, side=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, side, side, generator=g)


# --------------------------------------------------------------------------- JPEG, CLIP similarity, reward specs


def _smooth_or_noise_images(n=4, side=32, seed=0):
    """Even members smooth (bilinear from 4x4), odd members uniform noise; not the uniform-noise _images above."""
    g = torch.Generator().manual_seed(seed)
    smooth = torch.nn.functional.interpolate(torch.rand(n, 3, 4, 4, generator=g), size=side, mode="bilinear")
    return torch.where(torch.arange(n).view(n, 1, 1, 1) % 2 == 0, smooth, torch.rand(n, 3, side, side, generator=g))


def test_jpeg_reward_is_minus_kilobytes_over_500():
    import io
    from PIL import Image
    images = _smooth_or_noise_images()
    want = []
    for im in images:
        buf = io.BytesIO()
        Image.fromarray((im.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)).save(buf, "JPEG", quality=95)
        want.append(-len(buf.getvalue()) / 1000 / 500)
    got = reward.load_reward("jpeg")(images, [""] * 4)
    assert got.dtype == torch.float32 and got.shape == (4,)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    assert got[0] > got[1]                                   # smooth compresses better than noise
    np.testing.assert_allclose(reward.load_reward("jpeg:100,jpeg:-0.5")(images, [""] * 4).numpy(),
                               99.5 * np.array(want), rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer
    d = tmp_path_factory.mktemp("clip_tok")
    vgrpo.write_byte_tokenizer(str(d))
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(vocab_size=514, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64, bos_token_id=512, eos_token_id=513,
                         pad_token_id=513),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8), projection_dim=16)
    model = CLIPModel(config).eval()
    processor = CLIPProcessor(CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
                              CLIPTokenizer.from_pretrained(str(d), model_max_length=64))
    return model, processor


@pytest.mark.parametrize("use_logit_scale,divide_by", [(True, 26.0), (False, 1.0)])
def test_clip_rewards_match_formula(tiny_clip, use_logit_scale, divide_by):
    model, processor = tiny_clip
    images, prompts = _smooth_or_noise_images(seed=1), ["a red cat", "a dog", "two blue birds", "a house"]
    fn = reward.clip_similarity_reward(model, processor, "cpu", use_logit_scale, divide_by)
    got = fn(images, prompts)
    pil = [reward.to_uint8_images(images[i:i + 1])[0] for i in range(4)]
    inputs = processor(text=prompts, images=pil, return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**inputs).logits_per_image.diagonal()   # logit_scale.exp() * cos
    want = logits / (1 if use_logit_scale else model.logit_scale.exp()) / divide_by
    assert got.shape == (4,) and got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)
    with torch.no_grad():   # the image embeddings are kept for the evaluation's diversity
        torch.testing.assert_close(fn.last_image_features, reward._features(
            model.get_image_features(pixel_values=inputs["pixel_values"])), rtol=1e-4, atol=1e-5)


def test_the_clip_rewards_freeze_their_models_in_the_dtypes_they_promise(tiny_clip):
    """A reward model takes no gradient (a reward called where autograd records would keep its activations) and runs
    in the dtype asked, float32 by default whatever dtype it came in; the aesthetic MLP head stays float32 always."""
    import copy

    model, processor = tiny_clip
    for dtype, want in ((None, torch.float32), (torch.bfloat16, torch.bfloat16)):
        clip = copy.deepcopy(model).to(torch.float16).requires_grad_(True)
        reward.clip_similarity_reward(clip, processor, "cpu", True, 26.0, dtype=dtype)
        assert {p.dtype for p in clip.parameters()} == {want} and not any(p.requires_grad for p in clip.parameters())
        clip = copy.deepcopy(model).to(torch.float16).requires_grad_(True)
        mlp = reward.AestheticMLP(dim=16).to(torch.bfloat16)
        reward.aesthetic_reward(clip, processor, mlp, "cpu", dtype=dtype)
        assert {p.dtype for p in clip.parameters()} == {want} and {p.dtype for p in mlp.parameters()} == {torch.float32}
        assert not any(p.requires_grad for p in [*clip.parameters(), *mlp.parameters()])


def test_a_clip_reward_truncates_long_prompts_to_the_text_models_positions(tiny_clip):
    """A tokenizer saved without a length limit (model_max_length 1e30) would let a long prompt past the text
    model's 64 positions: the reward truncates to the smaller of the two, as with a tokenizer that knows its limit."""
    import copy

    model, processor = tiny_clip
    unlimited = copy.deepcopy(processor)
    unlimited.tokenizer.model_max_length = int(1e30)
    images, prompts = _smooth_or_noise_images(seed=2)[:2], ["a red cat " * 40, "a dog"]
    assert len(processor.tokenizer(prompts[0])["input_ids"]) > 64
    want = reward.clip_similarity_reward(model, processor, "cpu", True)(images, prompts)
    torch.testing.assert_close(reward.clip_similarity_reward(model, unlimited, "cpu", True)(images, prompts), want)


@pytest.mark.parametrize("name", ["geneval", "geneval_partial", "geneval_partial_jpeg", "digit", "digit_correct",
                                  "digit_knn", "ocr", "pickscore"])
def test_every_reward_that_reads_the_prompts_checks_the_prompt_file(name):
    """Each GenEval and digit reward refuses the first prompt it cannot score (counted from 1), the ocr reward a file
    with no text to render; a reward that reads no metadata takes any prompt."""
    prompts = ["the number seven", "a sign reading \"OPEN\"", "a cat"]
    metadata = [{"tag": "single_object", "include": [{"class": "dog", "count": 1}]}, {}, {}]
    problem = reward.prompt_file_problem([name, "jpeg"], prompts, metadata)
    if name.startswith("geneval"):
        assert problem.startswith("prompt 2 ('a sign reading \"OPEN\"') has no usable GenEval metadata: "), problem
    elif name.startswith("digit"):
        assert problem.startswith("prompt 2: digit rewards: prompt 'a sign reading \"OPEN\"' names no digit;"), problem
    else:
        assert problem is None
    # no text to render, the digits in the metadata: only the ocr reward (and GenEval, lacking its own) refuses
    no_text = reward.prompt_file_problem([name], ["a cat", "a dog"], [{"digit": 1}, {"digit": 2}])
    if name == "ocr":
        assert no_text == ('no prompt quotes a text to render (nor gives it as {"text": ...}): the ocr reward would '
                           "be 0 for every image")
        assert reward.prompt_file_problem([name], ["a sign", "a shop"], [{}, {"text": "OPEN"}]) is None
    else:
        assert no_text.startswith("prompt 1 ('a cat') has no usable GenEval") if name.startswith("geneval") else \
            no_text is None


def test_images_become_uint8_pictures_clamped_to_0_255():
    """A VAE decode overshoots [0, 1] a little: below 0 is black, above 1 white, and 0.5 rounds to 128."""
    images = torch.tensor([-0.5, 0.0, 0.5, 1.0, 1.5, 0.2]).view(1, 1, 2, 3).expand(1, 3, 2, 3)
    picture = np.asarray(reward.to_uint8_images(images)[0])
    assert picture.dtype == np.uint8 and picture.shape == (2, 3, 3)
    assert picture[..., 0].tolist() == [[0, 0, 128], [255, 255, 51]] and (picture == picture[..., :1]).all()


def test_a_rewards_answer_is_one_float_per_image_or_a_named_error():
    """as_rewards takes a tensor, a numpy array or a list of numbers (as float32 on the CPU); booleans, complex
    numbers, strings and the wrong count are refused with the reward's name."""
    for value in ([1, 2.5], (1, 2.5), np.array([1.0, 2.5], dtype=np.float64), torch.tensor([1.0, 2.5]),
                  torch.tensor([1.0, 2.5], dtype=torch.float64)):
        got = reward.as_rewards(value, "r", 2)
        assert got.dtype == torch.float32 and got.device.type == "cpu" and got.tolist() == [1.0, 2.5]
    assert reward.as_rewards([True, False], "r", 2).tolist() == [1.0, 0.0]     # Python's bools are numbers
    for value, message in (([1, "x"], "returned a list that is not 2 numbers"),
                           (torch.tensor([True, False]), "returned Tensor (2,)"),
                           (torch.tensor([1 + 1j, 2]), "returned Tensor (2,)"),
                           (torch.zeros(3), "returned Tensor (3,), expected one number per image"),
                           (0.5, "returned float ()")):
        with pytest.raises(reward.RewardError, match=re.escape(f"reward 'r' {message}")):
            reward.as_rewards(value, "r", 2)


def test_a_rewards_metric_name_is_the_last_name_in_its_spec():
    """metrics.jsonl's and rewards.csv's column of a reward: the function of a file, the last path segment of a URL
    (the host without one), a served judge by its kind; characters outside [A-Za-z0-9_] become one underscore."""
    names = {"pickscore": "pickscore", "my_rewards.py:colour": "colour", "a/b:c/r.py:score_2": "score_2",
             "http://host:8000/geneval": "geneval", "https://host:8000/api/v2/ocr-score/": "ocr_score",
             "http://reward-host:8000": "reward_host", "http://reward-host:8000/": "reward_host",
             "http://10.0.0.1:5000/a:b": "a_b", "unifiedreward@http://10.0.0.1:8080/v1": "unifiedreward",
             "geneval_partial_jpeg": "geneval_partial_jpeg", "http://h:1/-score-": "score"}
    assert {spec: reward.metric_name(spec) for spec in names} == names


def test_reward_spec_errors():
    with pytest.raises(ValueError, match="unknown reward 'foo'.*jpeg, pickscore, clipscore"):
        reward.parse_reward_spec("jpeg,foo")
    with pytest.raises(ValueError, match="not a number"):
        reward.parse_reward_spec("jpeg:x")
    for weight in ("nan", "inf", "-inf"):   # float() reads them: a NaN weight would turn every total into NaN
        with pytest.raises(ValueError, match="reward weight for 'jpeg' must be finite"):
            reward.parse_reward_spec(f"jpeg:{weight}")
    with pytest.raises(ValueError, match=r"^reward file not found: /no/such/rewards\.py$"):
        reward.parse_reward_spec("/no/such/rewards.py:mean")
    assert reward.parse_reward_spec("pickscore:1,clipscore:0.5") == [("pickscore", 1.0), ("clipscore", 0.5)]
    assert reward.parse_reward_spec("jpeg:-0.5") == [("jpeg", -0.5)]   # a negative weight penalises: allowed
    for url, problem in (("http://h:8000:0.5", "the port is not a number"), ("http://:8000/score", "no host")):
        with pytest.raises(ValueError, match=f"^{re.escape(url)}: {problem}"):
            reward.parse_reward_spec(url)
    assert reward.parse_reward_spec("http://h:8000/score:0.5,http://h:8000") == [("http://h:8000/score", 0.5),
                                                                                ("http://h:8000", 1.0)]
    # https too; a URL in the query is no weight; a served judge keeps its own URL's port
    assert reward.parse_reward_spec("https://h:8443/score:2,http://h:8000/s?next=http://o/x,"
                                    "unifiedreward@http://j:8080/v1:0.5,unifiedreward@http://j:8080/v1") == [
        ("https://h:8443/score", 2.0), ("http://h:8000/s?next=http://o/x", 1.0),
        ("unifiedreward@http://j:8080/v1", 0.5), ("unifiedreward@http://j:8080/v1", 1.0)]
    for spec, problem in (("https://h:8443:2", "^https://h:8443:2: the port is not a number"),
                          ("unifiedreward@ftp://j/v1", "unifiedreward@ftp://j/v1"),
                          ("jpeg:0,pickscore:0", "^every weight in 'jpeg:0,pickscore:0' is 0: the reward would be 0 "
                                                 "for every image")):
        with pytest.raises(ValueError, match=problem):
            reward.parse_reward_spec(spec)
    bad = reward.WeightedReward([("broken", 1.0, lambda images, prompts: torch.zeros(len(images) + 1))])
    with pytest.raises(reward.RewardError, match="'broken'"):
        bad(torch.zeros(2, 3, 8, 8), ["", ""])


def test_a_python_reward_is_the_files_function_and_a_missing_one_is_named(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text("threshold = 0.5\n\n"
                    "def bright(images, prompts):\n    return (images.mean((1, 2, 3)) > threshold).float()\n")
    fn = reward.python_reward(str(path), "bright")
    images = torch.stack([torch.full((3, 4, 4), v) for v in (0.2, 0.9)])
    assert fn(images, ["", ""]).tolist() == [0.0, 1.0]
    for name in ("dark", "threshold"):   # absent, and present but not a function
        with pytest.raises(reward.RewardError, match=f"my_rewards.py has no function '{name}'"):
            reward.python_reward(str(path), name)


# --------------------------------------------------------------------------- the HTTP reward


def _serve(mode, seen):
    """A reward server on localhost: ok (mean brightness), slow (never answers in time), garbage."""
    import base64
    import http.server
    import io
    import threading
    import time
    from PIL import Image

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            if mode == "slow":
                time.sleep(1.0)
            images = [np.asarray(Image.open(io.BytesIO(base64.b64decode(b)))) / 255 for b in body["images"]]
            answer = b"<html>oops</html>" if mode == "garbage" else \
                json.dumps({"rewards": [float(im.mean()) for im in images]}).encode()
            try:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(answer)
            except OSError:
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/score"


def test_http_reward_against_a_local_server():
    seen = []
    server, url = _serve("ok", seen)
    try:
        images = _smooth_or_noise_images()
        metadata = [{"tag": "colors", "value": i} for i in range(4)]
        got = reward.load_reward(url)(images, ["a", "b", "c", "d"], metadata)
        want = [np.asarray(im).mean() / 255 for im in reward.to_uint8_images(images)]
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
        assert seen[0]["prompts"] == ["a", "b", "c", "d"] and seen[0]["metadata"] == metadata
        reward.load_reward(url)(images, ["a", "b", "c", "d"])           # a .txt prompt file: no metadata
        assert seen[1]["metadata"] == [{}, {}, {}, {}]
        assert reward.parse_reward_spec(f"{url}:0.5,jpeg") == [(url, 0.5), ("jpeg", 1.0)]
    finally:
        server.shutdown()


@pytest.mark.parametrize("mode", ["slow", "garbage", "down"])
def test_http_reward_failures_name_the_server(mode):
    import time
    seen = []
    if mode == "down":
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}/score"   # nothing listens there once closed
        server = None
    else:
        server, url = _serve(mode, seen)
    try:
        fn = reward.http_reward(url, timeout=0.3, retries=2, backoff=0.1)
        t0 = time.time()
        with pytest.raises(reward.RewardError, match=re.escape(url)) as e:
            fn(_smooth_or_noise_images(), ["a"] * 4)
        if mode == "garbage":
            assert "answered something" in str(e.value) and len(seen) == 1
        else:
            assert "failed 3 times" in str(e.value)
            assert time.time() - t0 >= 0.1 + 0.2                 # backoff 0.1 s, then 0.2 s
        if mode == "slow":
            assert len(seen) == 3
    finally:
        if server:
            server.shutdown()


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
    # the target whole inside what was read scores 1 (Flow-GRPO's rule); other text around it costs nothing
    assert reward.ocr_score("Welcome! Open 24 hours daily", "open 24 hours") == 1.0
    assert reward.ocr_score("xopen24hourx", "open 24 hours") == pytest.approx(1 - 2 / 11)   # not whole: 2 edits
    assert reward.ocr_score("", "") == 0.0 and reward.ocr_score("x", " ") == 0.0    # nothing to read: no signal


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
    # a second call finds the package stub of the first in sys.modules, where find_spec would raise
    spec = None if "open_clip" in sys.modules else importlib.util.find_spec("open_clip")
    if spec is None and "open_clip" not in sys.modules:
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


def test_an_openclip_checkpoint_with_keys_of_another_architecture_is_refused_naming_the_key():
    """A checkpoint of another OpenCLIP architecture (an attention-pooling head, a gated MLP) would otherwise load
    with those weights silently dropped."""
    kept = reward.openclip_to_transformers({"ln_final.weight": torch.ones(2), "visual.proj": torch.ones(2, 3)})
    assert set(kept) == {"text_model.final_layer_norm.weight", "visual_projection.weight"}
    assert kept["visual_projection.weight"].shape == (3, 2)   # x @ proj in OpenCLIP, a Linear's (out, in) here
    for key in ("visual.attn_pool.query", "transformer.resblocks.0.mlp.c_gate.weight"):
        with pytest.raises(reward.RewardError, match=f"unexpected key in an OpenCLIP checkpoint: {key}$"):
            reward.openclip_to_transformers({"ln_final.weight": torch.ones(2), key: torch.ones(2)})


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


@pytest.mark.parametrize("name,package", [("ocr", "rapidocr-onnxruntime")])
def test_missing_optional_package_is_one_line(monkeypatch, name, package):
    monkeypatch.setitem(sys.modules, {"ocr": "rapidocr_onnxruntime"}[name], None)
    with pytest.raises(reward.RewardError, match=f"pip install {package}") as e:
        reward.load_reward(name)
    assert "\n" not in str(e.value)


def test_geneval_without_scipy_says_to_install_it(use_hub_cache):
    """transformers' Mask2Former imports scipy (requirements.txt lists it; an environment made by hand may lack it):
    in a fresh process, where that module is not imported yet, with scipy unimportable, GenEval says so in one line."""
    import subprocess

    code = ("import sys; sys.modules['scipy'] = None\nimport reward\ntry:\n    reward.load_reward('geneval')\n"
            "except reward.RewardError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.abspath(reward.__file__)),
                         capture_output=True, text=True, timeout=120)
    assert out.stdout == "reward 'geneval' needs scipy (transformers' Mask2Former imports it): pip install scipy\n", \
        out.stdout + out.stderr[-2000:]


@pytest.mark.parametrize("name,repo", [("hpsv2", reward.HPS_REPO), ("aesthetic", reward.AESTHETIC_CLIP)])
def test_weights_not_downloaded_is_one_line(name, repo):
    with pytest.raises(reward.RewardError, match=f"reward '{name}' needs .*{repo}") as e:
        reward.load_reward(name)
    assert "\n" not in str(e.value)


def test_every_registered_reward_states_its_scale():
    for name, loader in reward.REWARDS.items():
        assert "Scale:" in (loader.__doc__ or ""), f"load_{name} does not say what values to expect"


# --------------------------------------------------------------------------- CLIP preprocessing as tensor ops


def _smooth_images(n, h, w, seed):
    # generated images are smooth at the pixel scale; uniform noise is the worst case for resampling
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n, 3, h // 16 + 1, w // 16 + 1, generator=g)
    return torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)


def _processor_pixels(image_processor, images):
    return image_processor(images=reward.to_uint8_images(images), return_tensors="pt")["pixel_values"]


@pytest.mark.parametrize("h,w", [(512, 512), (720, 720), (100, 60), (300, 200), (97, 513), (224, 300)])
@pytest.mark.parametrize("resample,max_share", [(3, 0.02), (2, 0.06)])   # PIL's BICUBIC (every CLIP reward), BILINEAR
def test_clip_pixel_values_match_the_processor(h, w, resample, max_share):
    """clip_pixel_values against CLIPImageProcessor run on the uint8 pictures (PIL), at the real rewards' 224 px
    with OpenAI's mean and std: shrinking (512 and 720, the trained resolutions), enlarging, non-square both ways,
    crop only. Measured: never more than 2 uint8 levels apart, on at most 0.8% of the values for bicubic and
    3.9% for bilinear (rounding ties: PIL computes in fixed point, torch in float). One bicubic pass instead of
    PIL's two (each rounded and clipped to uint8) is up to 24 levels off where enlarged noise overshoots [0, 255];
    no antialias, up to 171."""
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor(resample=resample)
    std = torch.tensor(processor.image_std).view(3, 1, 1)
    for images in (torch.rand(2, 3, h, w, generator=torch.Generator().manual_seed(h * w)), _smooth_images(2, h, w, 1)):
        want = _processor_pixels(processor, images)
        got = reward.clip_pixel_values(images, processor)
        assert got.shape == want.shape == (2, 3, 224, 224) and got.dtype == torch.float32
        levels = (got - want).abs() * std * 255                       # the difference in uint8 levels
        assert levels.max() <= 2 + 1e-3, levels.max()
        assert (levels > 1e-2).float().mean() < max_share
        if min(h, w) == 224:                                            # nothing resized: only the float formula
            assert levels.max() < 1e-3


def test_clip_pixel_values_clip_to_the_saved_pictures_range_before_and_after_each_resize():
    """What a saved picture shows: a decoder's values beyond [0, 1] are its 0 and 255, and a resize that overshoots
    at a hard edge (bicubic's negative lobes) is clipped to [0, 255] after each pass, as PIL does: black stays
    exactly black, nothing is whiter than white. Half black, half white, enlarged to 224."""
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor()
    half = torch.zeros(1, 3, 100, 100)
    half[..., 50:] = 1.0
    got = reward.clip_pixel_values(half, processor)
    assert torch.equal(reward.clip_pixel_values(half * 3 - 1, processor), got)
    mean, std = (torch.tensor(v).view(3, 1) for v in (processor.image_mean, processor.image_std))
    black, white = (0 - mean) / std, (1 - mean) / std
    assert torch.allclose(got[0, :, :, :50].flatten(1).min(1).values[:, None], black, atol=1e-6)   # the black half
    assert (got[0].flatten(1) >= black - 1e-6).all() and (got[0].flatten(1) <= white + 1e-6).all()
    assert torch.allclose(got[0].flatten(1).max(1).values[:, None], white)
    unclipped = torch.nn.functional.interpolate(half * 255, size=(100, 224), mode="bicubic", antialias=True)
    assert unclipped.min() < -10 and unclipped.max() > 265                   # the overshoot this test is about


def test_clip_pixel_values_resize_to_a_fixed_size_and_refuse_a_crop_larger_than_the_picture():
    """A processor whose size is a height and a width (no shortest edge) resizes to exactly that, as it does; a
    centre crop larger than the resized picture in either dimension is one line."""
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor(size={"height": 120, "width": 90}, do_center_crop=False)
    images = _smooth_images(2, 200, 160, 3)
    got, want = reward.clip_pixel_values(images, processor), _processor_pixels(processor, images)
    assert got.shape == want.shape == (2, 3, 120, 90)
    assert ((got - want).abs() * torch.tensor(processor.image_std).view(3, 1, 1) * 255).max() <= 2 + 1e-3
    wide_crop = CLIPImageProcessor(crop_size={"height": 224, "width": 300})
    with pytest.raises(reward.RewardError, match=r"^crop 224x300 is larger than the resized image 224x224$"):
        reward.clip_pixel_values(_images(1, side=64), wide_crop)


def test_clip_pixel_values_stay_on_the_device():
    """Meta tensors have no data: any step through PIL, numpy, .cpu() or .item() raises, so passing here means
    the images never leave their device (a GPU in training)."""
    from transformers import CLIPImageProcessor

    got = reward.clip_pixel_values(torch.rand(3, 3, 512, 384, device="meta"), CLIPImageProcessor())
    assert got.device.type == "meta" and got.shape == (3, 3, 224, 224)


def test_clip_pixel_values_refuse_filters_torch_lacks():
    from transformers import CLIPImageProcessor

    with pytest.raises(reward.RewardError, match="only bilinear and bicubic") as e:
        reward.clip_pixel_values(_images(1, side=64), CLIPImageProcessor(resample=1))   # PIL's LANCZOS
    assert "\n" not in str(e.value)


def _tiny_clip_224(tmp_path, logit_scale=None):
    """A random CLIP reading the real rewards' 224 px (patch 32: 49 patches), byte-level tokenizer, seed 0."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    import vgrpo
    tmp_path.mkdir(parents=True, exist_ok=True)
    vgrpo.write_byte_tokenizer(str(tmp_path))
    torch.manual_seed(0)
    config = CLIPConfig(text_config=dict(vocab_size=514, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=64, bos_token_id=512,
                                         eos_token_id=513, pad_token_id=513),
                        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=224, patch_size=32), projection_dim=16)
    model = CLIPModel(config).eval()
    if logit_scale is not None:
        model.logit_scale.data.fill_(logit_scale)
    return model, CLIPProcessor(CLIPImageProcessor(), CLIPTokenizer.from_pretrained(str(tmp_path), model_max_length=64))


@pytest.mark.parametrize("h,w", [(512, 512), (720, 720), (100, 60), (97, 513)])
def test_clip_reward_on_tensors_matches_the_processor_path(tmp_path, h, w):
    """The reward fed by clip_pixel_values against the same model fed by the processor, PickScore's formula
    (logit_scale.exp() * cos / 26). Measured: at most 6.5e-5 apart, 0.09% of the range of the batch's rewards
    (this random model's rewards span about 0.1); the bound is 0.5% of that range."""
    model, processor = _tiny_clip_224(tmp_path)
    prompts = ["a red cat", "a dog", "two blue birds", "a house"]
    for images in (torch.rand(4, 3, h, w, generator=torch.Generator().manual_seed(h * w)), _smooth_images(4, h, w, 2)):
        got = reward.clip_similarity_reward(model, processor, "cpu", True, 26.0)(images, prompts)
        inputs = processor(text=prompts, images=reward.to_uint8_images(images), return_tensors="pt", padding=True)
        with torch.no_grad():
            img = model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
            txt = model.get_text_features(input_ids=inputs["input_ids"],
                                          attention_mask=inputs["attention_mask"]).pooler_output
        cos = (img * txt).sum(-1) / (img.norm(dim=-1) * txt.norm(dim=-1))
        want = model.logit_scale.exp() * cos / 26
        assert got.shape == (4,) and got.dtype == torch.float32
        assert (got - want).abs().max() < 5e-3 * (want.max() - want.min()), (got - want).abs().max()


def test_aesthetic_on_tensors_matches_the_processor_path(tmp_path):
    """aesthetic_reward at 512 px against the MLP fed by the processor's pixels. Measured: 4.2e-3 apart on rewards
    spanning 4.3 (0.1%); the bound, as above, is 0.5% of the batch's range."""
    model, processor = _tiny_clip_224(tmp_path)
    mlp = reward.AestheticMLP(dim=16)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.3)
    images = _smooth_images(4, 512, 512, 3)
    got = reward.aesthetic_reward(model, processor.image_processor, mlp, "cpu")(images, [""] * 4)
    with torch.no_grad():
        e = model.get_image_features(pixel_values=_processor_pixels(processor.image_processor, images)).pooler_output
        want = mlp(e / e.norm(dim=-1, keepdim=True))[:, 0]
    assert got.shape == (4,) and got.dtype == torch.float32
    assert (got - want).abs().max() < 5e-3 * (want.max() - want.min()), (got - want).abs().max()


def test_clip_reward_in_bf16(tmp_path):
    """dtype=bf16 runs the model in bf16 but keeps logit_scale.exp() in float32: with logit_scale = log(100), as in
    real CLIP models, the scaled reward must be exactly 100 x the cosine (a bf16 logit_scale gives 98.9 x).
    The bf16 cosine itself is within 2e-2 of float32's (measured 3.5e-3 on this random model)."""
    images, prompts = _smooth_images(4, 512, 512, 4), ["a red cat", "a dog", "two blue birds", "a house"]
    model, processor = _tiny_clip_224(tmp_path / "a", logit_scale=float(np.log(100)))
    scaled = reward.clip_similarity_reward(model, processor, "cpu", True, dtype=torch.bfloat16)(images, prompts)
    assert model.dtype == torch.bfloat16 and scaled.dtype == torch.float32
    model, processor = _tiny_clip_224(tmp_path / "b")
    cos16 = reward.clip_similarity_reward(model, processor, "cpu", False, dtype=torch.bfloat16)(images, prompts)
    model, processor = _tiny_clip_224(tmp_path / "c")
    cos32 = reward.clip_similarity_reward(model, processor, "cpu", False)(images, prompts)
    torch.testing.assert_close(scaled, 100 * cos16, rtol=1e-5, atol=1e-6)
    assert (cos16 - cos32).abs().max() < 2e-2 and not torch.equal(cos16, cos32)


def test_load_reward_passes_device_and_dtype(monkeypatch):
    seen = []
    monkeypatch.setitem(reward.REWARDS, "pickscore", lambda device, dtype=None: seen.append((device, dtype)) or
                        (lambda images, prompts: torch.zeros(len(images))))
    reward.load_reward("pickscore:2", "cpu", torch.bfloat16)(_images(2), ["a", "b"])
    reward.load_reward("pickscore")
    assert seen == [("cpu", torch.bfloat16), ("cpu", None)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_clip_reward_on_cuda_matches_cpu(tmp_path, monkeypatch):
    """Images decoded on the GPU are scored there: the reward equals the CPU one (float32, TF32 off) within 1e-4."""
    # cuBLAS's flag is set and put back by hand: monkeypatch's undo deletes it (it is no plain attribute), failing the
    # teardown and leaving TF32 off for the tests after this one
    matmul_tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)   # the patch embedding is a convolution
    try:
        images, prompts = _smooth_images(4, 512, 512, 5), ["a red cat", "a dog", "two blue birds", "a house"]
        model, processor = _tiny_clip_224(tmp_path / "cpu")
        want = reward.clip_similarity_reward(model, processor, "cpu", True, 26.0)(images, prompts)
        model, processor = _tiny_clip_224(tmp_path / "gpu")
        got = reward.clip_similarity_reward(model, processor, "cuda", True, 26.0)(images.cuda(), prompts)
        assert got.device.type == "cpu" and got.dtype == torch.float32
        assert (got - want).abs().max() < 1e-4
        assert reward.clip_pixel_values(images.cuda(), processor.image_processor).device.type == "cuda"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32


# --------------------------------------------------------------------------- hub_standins.py: the hub models offline
# conftest's hub_cache holds tiny random models under the real ids, in the Hugging Face cache layout. These tests load
# them by name, offline, exactly as vgrpo and reward.py do on a cluster, and check the features those loaders rely on.


SD3_ID, FLUX_ID = "stabilityai/stable-diffusion-3.5-medium", "black-forest-labs/FLUX.1-dev"
_PROMPTS = ["a red cat", "two dogs playing chess", "A house!", "photo of the sea"]


def test_standins_resolve_from_the_cache_and_nowhere_else(use_hub_cache, monkeypatch, tmp_path):
    from diffusers import StableDiffusion3Pipeline
    from huggingface_hub import constants, snapshot_download

    path = snapshot_download(SD3_ID)
    assert os.path.realpath(path).startswith(os.path.realpath(use_hub_cache) + os.sep), path
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))       # an empty cache: every load must fail
    with pytest.raises(OSError):
        StableDiffusion3Pipeline.from_pretrained(SD3_ID)
    for name in ("pickscore", "clipscore", "hpsv2", "aesthetic"):
        with pytest.raises(reward.RewardError, match=f"reward '{name}' needs"):
            reward.load_reward(name)


@pytest.mark.parametrize("name,missing", [
    ("pickscore", reward.PICKSCORE_MODEL), ("pickscore", reward.PICKSCORE_PROCESSOR),
    ("hpsv2", reward.HPS_REPO), ("hpsv2", reward.HPS_BACKBONE),
    ("aesthetic", reward.AESTHETIC_CLIP), ("aesthetic", reward.AESTHETIC_REPO),
    ("imagereward", reward.IMAGEREWARD_REPO), ("imagereward", reward.IMAGEREWARD_TOKENIZER),
    ("geneval", reward.GENEVAL_DETECTOR), ("geneval", reward.GENEVAL_CLIP),
])
def test_a_cache_lacking_one_of_a_rewards_repositories_names_that_one_and_how_to_fetch_it(
        use_hub_cache, monkeypatch, tmp_path, name, missing):
    """A partial download (every repository of the reward but one in the cache) fails in one line that names the
    missing repository and the `hf download` command for it, not the reward's other repositories."""
    folder = "models--" + missing.replace("/", "--")
    assert os.path.isdir(os.path.join(use_hub_cache, folder))
    for entry in os.listdir(use_hub_cache):
        if entry != folder:
            os.symlink(os.path.join(use_hub_cache, entry), tmp_path / entry)
    _point_hub_cache(monkeypatch, str(tmp_path))
    monkeypatch.setattr(reward, "_GENEVAL", {})            # no judge kept from an earlier test
    with pytest.raises(reward.RewardError) as e:
        reward.load_reward(name)
    message = str(e.value)
    assert message.startswith(f"reward '{name}' needs ") and "\n" not in message, message
    assert f"`hf download {missing}" in message and message.count("hf download") == 1, message
    others = {reward.PICKSCORE_MODEL, reward.PICKSCORE_PROCESSOR, reward.HPS_REPO, reward.AESTHETIC_CLIP,
              reward.AESTHETIC_REPO, reward.IMAGEREWARD_REPO, reward.IMAGEREWARD_TOKENIZER, reward.GENEVAL_DETECTOR}
    assert not [repo for repo in others - {missing} if repo in message], message


def test_a_file_named_like_a_checkpoint_in_the_working_directory_is_not_taken_for_it(use_hub_cache, monkeypatch,
                                                                                      tmp_path):
    """ImageReward.pt, med_config.json or HPSv2's or the aesthetic head's checkpoint lying in the working directory
    is not the hub's (only VGRPO_AESTHETIC_FILE may name a local file)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VGRPO_AESTHETIC_FILE", raising=False)
    for name in (reward.IMAGEREWARD_FILE, reward.IMAGEREWARD_CONFIG, reward.HPS_FILE, reward.AESTHETIC_FILE):
        (tmp_path / name).write_text("not a checkpoint")
    images = torch.rand(2, 3, 32, 32)
    for name in ("imagereward", "hpsv2", "aesthetic"):
        assert reward.load_reward(name)(images, ["a cat", "a dog"]).shape == (2,)


def test_the_aesthetic_head_may_be_a_local_file(use_hub_cache, monkeypatch, tmp_path):
    """VGRPO_AESTHETIC_FILE may name a local .pth (read when reward.py is imported, so patched here as its value)."""
    from huggingface_hub import hf_hub_download

    head = torch.load(hf_hub_download(reward.AESTHETIC_REPO, reward.AESTHETIC_FILE), weights_only=True)
    images = torch.rand(2, 3, 32, 32)
    want = reward.load_reward("aesthetic")(images, ["a", "b"])
    head = {k: 2 * v if k == "layers.7.bias" else v for k, v in head.items()}   # the last layer's bias doubled
    torch.save(head, tmp_path / "mine.pth")
    monkeypatch.setenv("VGRPO_AESTHETIC_FILE", str(tmp_path / "mine.pth"))
    monkeypatch.setattr(reward, "AESTHETIC_FILE", str(tmp_path / "mine.pth"))
    got = reward.load_reward("aesthetic")(images, ["a", "b"])
    torch.testing.assert_close(got - want, head["layers.7.bias"].expand(2) / 2)


@pytest.mark.parametrize("name,repo,filename", [("hpsv2", reward.HPS_REPO, reward.HPS_FILE),
                                                ("aesthetic", reward.AESTHETIC_REPO, reward.AESTHETIC_FILE),
                                                ("imagereward", reward.IMAGEREWARD_REPO, reward.IMAGEREWARD_FILE)])
def test_a_truncated_checkpoint_in_the_cache_is_named_in_one_line(use_hub_cache, monkeypatch, tmp_path, name, repo,
                                                                    filename):
    """A download cut short leaves a checkpoint torch.load cannot read: the error names the reward and the file."""
    from huggingface_hub import hf_hub_download

    _point_hub_cache(monkeypatch, _cache_copy_without(use_hub_cache, tmp_path, repo, []))
    path = os.path.realpath(hf_hub_download(repo, filename))
    assert path.startswith(str(tmp_path / "cache"))
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(reward.RewardError, match=f"^reward '{name}': .*{re.escape(filename)} could not be read "
                                                 r"\(\w+: .+\); if its download was cut short, delete it and "
                                                 "download it again$"):
        reward.load_reward(name)


def _point_hub_cache(monkeypatch, cache):
    """Loads in this process resolve from `cache` (huggingface_hub's constant, and the variable transformers reads)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_CACHE", cache)


def _cache_copy_without(cache, tmp_path, repo, files):
    """A copy of the hub cache whose snapshot of `repo` lacks the files `files` (globs): an incomplete download."""
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    removed = [path for pattern in files
               for path in glob.glob(str(copy / ("models--" + repo.replace("/", "--")) / "snapshots" / "*" / pattern))]
    assert removed or not files, files
    for path in removed:
        os.remove(path)
    return str(copy)


@pytest.mark.parametrize("model,tokenizer", [("sd3", "tokenizer_3"), ("flux", "tokenizer_2"), ("flux", "tokenizer"),
                                             ("qwen-image", "tokenizer"), ("flux2-klein", "tokenizer")])
def test_a_pipeline_whose_tokenizer_files_are_missing_is_refused_in_one_line(use_hub_cache, monkeypatch, tmp_path,
                                                                              model, tokenizer):
    """transformers loads a tokenizer whose vocabulary files are absent as an empty one, silently (every prompt then
    reads as unknown tokens or as nothing, and training goes on with one prompt); vgrpo refuses such a pipeline."""
    repo = vgrpo.MODEL_IDS[model]
    cache = _cache_copy_without(use_hub_cache, tmp_path, repo, [f"{tokenizer}/*"])
    _point_hub_cache(monkeypatch, cache)
    with pytest.raises(vgrpo.UsageError) as e:
        vgrpo.load_pipeline(repo, model, torch.float32)
    assert str(e.value) == (f"--model {repo}: the Hugging Face cache's copy has no vocabulary for {tokenizer} (an "
                            "incomplete copy: every prompt would read as unknown tokens); download it again with "
                            f"`hf download {repo}`")


@pytest.mark.parametrize("weights", ["transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors",
                                     "vae/diffusion_pytorch_model.safetensors"])
def test_a_pipeline_with_a_weights_file_cut_short_is_refused_in_one_line(use_hub_cache, monkeypatch, tmp_path,
                                                                          weights):
    """A download that stopped mid-file: diffusers and transformers raise three kinds of error (a truncated text
    encoder's is safetensors' own); each is the one-line 'no complete copy'."""
    repo = vgrpo.MODEL_IDS["sd3"]
    cache = _cache_copy_without(use_hub_cache, tmp_path, repo, [])
    path = glob.glob(os.path.join(cache, "models--" + repo.replace("/", "--"), "snapshots", "*", weights))[0]
    os.truncate(path, os.path.getsize(path) // 2)
    _point_hub_cache(monkeypatch, cache)
    with pytest.raises(vgrpo.UsageError, match=f"^could not load '{repo}' \\(\\w+\\): .* has no complete copy"):
        vgrpo.load_pipeline(repo, "sd3", torch.float32)
    clip = glob.glob(os.path.join(cache, "models--openai--clip-vit-large-patch14", "snapshots", "*", "model.safetensors"))
    os.truncate(clip[0], os.path.getsize(clip[0]) // 2)                 # and a reward's
    with pytest.raises(reward.RewardError, match="^reward 'clipscore' needs openai/clip-vit-large-patch14, which "
                                                 r"could not be loaded \(\w+\); download it first"):
        reward.load_reward("clipscore")


@pytest.mark.parametrize("name,repo", [("pickscore", reward.PICKSCORE_PROCESSOR), ("hpsv2", reward.HPS_BACKBONE),
                                       ("clipscore", reward.CLIPSCORE_MODEL), ("imagereward", reward.IMAGEREWARD_TOKENIZER)])
def test_a_reward_whose_tokenizer_files_are_missing_is_refused_in_one_line(use_hub_cache, monkeypatch, tmp_path, name,
                                                                            repo):
    """The same for a reward's tokenizer (a CLIP processor's, BERT's): the reward would ignore the prompt."""
    cache = _cache_copy_without(use_hub_cache, tmp_path, repo, ["tokenizer.json", "vocab.*", "merges.txt"])
    _point_hub_cache(monkeypatch, cache)
    with pytest.raises(reward.RewardError, match=f"^reward '{name}' needs {re.escape(repo)}, whose tokenizer has no "
                                                 r"vocabulary in the cache \(a partial download"):
        reward.load_reward(name)


def test_sd3_standin_has_the_real_pipelines_features(use_hub_cache):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(SD3_ID)
    clip_l, clip_g, t5 = pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3
    assert [type(e).__name__ for e in (clip_l, clip_g, t5)] == ["CLIPTextModelWithProjection"] * 2 + ["T5EncoderModel"]
    assert pipe.tokenizer.model_max_length == pipe.tokenizer_2.model_max_length == 77
    assert clip_l.config.max_position_embeddings == clip_g.config.max_position_embeddings == 77
    t, vae = pipe.transformer.config, pipe.vae.config
    assert (t.in_channels, t.out_channels, t.patch_size, t.qk_norm, tuple(t.dual_attention_layers)) == \
        (16, 16, 2, "rms_norm", (0,))
    assert (vae.latent_channels, pipe.vae_scale_factor, vae.scaling_factor, vae.shift_factor) == (16, 8, 1.5305, 0.0609)
    # SD3 concatenates the two CLIP hidden states and zero-pads them to T5's width, the joint attention width
    assert t.joint_attention_dim == t5.config.d_model > clip_l.config.hidden_size + clip_g.config.hidden_size
    assert t.pooled_projection_dim == clip_l.config.projection_dim + clip_g.config.projection_dim
    assert pipe.scheduler.config.shift == 3.0 and not pipe.scheduler.config.use_dynamic_shifting

    # vgrpo's SD3Family.encode_one: 77 CLIP tokens then 256 T5 tokens; the T5 part is T5's output, not zeros
    emb, _, pooled, _ = pipe.encode_prompt("a red cat", None, None, do_classifier_free_guidance=False,
                                           max_sequence_length=256)
    assert emb.shape == (1, 77 + 256, t.joint_attention_dim) and pooled.shape == (1, t.pooled_projection_dim)
    ids = pipe.tokenizer_3("a red cat", padding="max_length", max_length=256, return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(emb[:, 77:], t5(ids)[0])
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a red cat", height=64, width=48, num_inference_steps=2, output_type="pt",
                 generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 3, 64, 48) and torch.isfinite(image).all()


def test_flux_standin_has_the_real_pipelines_features(use_hub_cache):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(FLUX_ID)
    clip, t5 = pipe.text_encoder, pipe.text_encoder_2
    assert [type(e).__name__ for e in (clip, t5)] == ["CLIPTextModel", "T5EncoderModel"]
    assert pipe.tokenizer.model_max_length == clip.config.max_position_embeddings == 77
    t, vae, s = pipe.transformer.config, pipe.vae.config, pipe.scheduler.config
    assert t.guidance_embeds and t.in_channels == 4 * vae.latent_channels == 64        # 2x2-packed latents
    assert sum(t.axes_dims_rope) == t.attention_head_dim                            # rotary axes fill a head
    assert t.joint_attention_dim == t5.config.d_model and t.pooled_projection_dim == clip.config.hidden_size
    assert (pipe.vae_scale_factor, vae.scaling_factor, vae.shift_factor) == (8, 0.3611, 0.1159)
    assert (s.use_dynamic_shifting, s.base_shift, s.max_shift, s.base_image_seq_len, s.max_image_seq_len, s.shift) == \
        (True, 0.5, 1.15, 256, 4096, 3.0)

    emb, pooled, _ = pipe.encode_prompt("a red cat", None, max_sequence_length=512)   # FluxFamily's 512 T5 tokens
    assert emb.shape == (1, 512, t.joint_attention_dim) and pooled.shape == (1, t.pooled_projection_dim)
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a red cat", height=64, width=48, num_inference_steps=2, output_type="pt", max_sequence_length=512,
                 generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 3, 64, 48) and torch.isfinite(image).all()


def _projected_clip_features(model, processor, images, prompts):
    """CLIP embeddings taken by hand: each tower's pooled token through its projection; text padded to the full 77
    tokens (the reward pads to the longest prompt: the causal mask makes the two agree)."""
    pixels = processor(images=reward.to_uint8_images(images), return_tensors="pt")["pixel_values"]
    text = processor.tokenizer(prompts, padding="max_length", max_length=77, return_tensors="pt")
    with torch.no_grad():
        img = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
        txt = model.text_projection(model.text_model(input_ids=text.input_ids).pooler_output)
    return pixels, img, txt


@pytest.mark.parametrize("name,model_id,processor_id", [
    ("pickscore", reward.PICKSCORE_MODEL, reward.PICKSCORE_PROCESSOR),
    ("clipscore", reward.CLIPSCORE_MODEL, reward.CLIPSCORE_MODEL)])
def test_clip_rewards_from_the_standins_match_formula(use_hub_cache, name, model_id, processor_id):
    """PickScore = logit_scale.exp() * cos / 26, CLIPScore = cos. Images at the processors' 224 px: nothing is
    resized, so the reward's tensor preprocessing and the processor's PIL path give the same pixels."""
    from transformers import CLIPModel, CLIPProcessor

    model, processor = CLIPModel.from_pretrained(model_id).eval(), CLIPProcessor.from_pretrained(processor_id)
    images = _images(4, side=224, seed=5)
    pixels, img, txt = _projected_clip_features(model, processor, images, _PROMPTS)
    assert pixels.shape == (4, 3, 224, 224) and model.config.vision_config.image_size == 224
    np.testing.assert_allclose(processor.image_processor.image_std, [0.26862954, 0.26130258, 0.27577711])
    cos = (img * txt).sum(-1) / (img.norm(dim=-1) * txt.norm(dim=-1))
    want = 100 * cos / 26 if name == "pickscore" else cos           # the stand-ins' logit scale is ln 100, as trained
    assert model.logit_scale.exp().item() == pytest.approx(100, rel=1e-5)
    got = reward.load_reward(name)(images, _PROMPTS)
    assert got.shape == (4,) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (want.max() - want.min()) > 1e-3                              # a batch whose rewards differ


def test_aesthetic_from_the_standins_matches_formula(use_hub_cache):
    """MLP(normalised CLIP-L image embedding), the MLP applied as its five affine maps read from the .pth."""
    from huggingface_hub import hf_hub_download
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(reward.AESTHETIC_CLIP).eval()
    processor = CLIPProcessor.from_pretrained(reward.AESTHETIC_CLIP)
    weights = torch.load(hf_hub_download(reward.AESTHETIC_REPO, reward.AESTHETIC_FILE), weights_only=True)
    images = _images(4, side=224, seed=6)
    _, x, _ = _projected_clip_features(model, processor, images, [""] * 4)
    x = x / x.norm(dim=-1, keepdim=True)
    for i in (0, 2, 4, 6, 7):
        x = x @ weights[f"layers.{i}.weight"].T + weights[f"layers.{i}.bias"]
    got = reward.load_reward("aesthetic")(images, _PROMPTS)
    assert got.shape == (4,) and got.dtype == torch.float32
    torch.testing.assert_close(got, x[:, 0], rtol=1e-4, atol=1e-4)
    assert 2 < got.mean() < 9 and got.std() > 1e-3        # near the real head's ~5.5, and the images' scores differ


def test_hpsv2_from_the_standins_matches_openclip(use_hub_cache):
    """The stand-in HPS_v2.1 checkpoint is OpenCLIP's format: OpenCLIP itself loads it (strictly) into a CLIP of the
    laion config's shape, and its normalised image . text features are what load_hpsv2 computes."""
    from huggingface_hub import hf_hub_download
    from transformers import CLIPConfig, CLIPProcessor

    oc_model, _ = _import_open_clip_model()
    config = CLIPConfig.from_pretrained(reward.HPS_BACKBONE)
    t, v = config.text_config, config.vision_config
    oc = oc_model.CLIP(
        embed_dim=config.projection_dim,
        vision_cfg=oc_model.CLIPVisionCfg(layers=v.num_hidden_layers, width=v.hidden_size, patch_size=v.patch_size,
                                          head_width=v.hidden_size // v.num_attention_heads, image_size=v.image_size,
                                          mlp_ratio=v.intermediate_size / v.hidden_size),
        text_cfg=oc_model.CLIPTextCfg(context_length=t.max_position_embeddings, vocab_size=t.vocab_size,
                                      width=t.hidden_size, heads=t.num_attention_heads, layers=t.num_hidden_layers,
                                      mlp_ratio=t.intermediate_size / t.hidden_size)).eval()
    checkpoint = torch.load(hf_hub_download(reward.HPS_REPO, reward.HPS_FILE), weights_only=True)
    oc.load_state_dict({k: w.float() for k, w in checkpoint["state_dict"].items()})
    processor = CLIPProcessor.from_pretrained(reward.HPS_BACKBONE)
    images = _images(4, side=224, seed=7)
    pixels = processor(images=reward.to_uint8_images(images), return_tensors="pt")["pixel_values"]
    # OpenCLIP pools the text at the highest token id, the byte vocabulary's end-of-text (513): the same token
    tokens = processor.tokenizer(_PROMPTS, padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        want = (oc.encode_image(pixels, normalize=True) * oc.encode_text(tokens, normalize=True)).sum(-1)
    got = reward.load_reward("hpsv2")(images, _PROMPTS)
    assert got.shape == (4,) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _tensors(cache, repo, filename):
    from safetensors.torch import load_file

    snapshots = os.path.join(cache, "models--" + repo.replace("/", "--"), "snapshots")
    (revision,) = os.listdir(snapshots)
    return load_file(os.path.join(snapshots, revision, filename))


def test_standin_weights_are_a_function_of_the_seed(hub_cache, hub_cache_other_seed):
    """Every randomly drawn weight (matrices, convolutions, embeddings) differs between seeds 0 and 1; norms
    (initialised to 1) and SD3's sin-cos position table are the same by construction."""
    for repo, filename in [(SD3_ID, "transformer/diffusion_pytorch_model.safetensors"),
                           (SD3_ID, "text_encoder_3/model.safetensors"),
                           (FLUX_ID, "vae/diffusion_pytorch_model.safetensors"),
                           (reward.PICKSCORE_MODEL, "model.safetensors")]:
        a, b = _tensors(hub_cache, repo, filename), _tensors(hub_cache_other_seed, repo, filename)
        assert a.keys() == b.keys()
        drawn = [k for k in a if k.endswith("weight") and a[k].dim() >= 2]
        assert len(drawn) > 3 and not [k for k in drawn if torch.equal(a[k], b[k])], (repo, filename)


def test_standin_cli_is_deterministic_and_idempotent(hub_cache, tmp_path, capsys):
    """`python hub_standins.py DIR` with seed 0 writes the same bytes as the session's cache; a second call
    rewrites nothing; a directory that holds a real download of one of the ids is refused."""
    import hashlib

    from tests import hub_standins

    def files(root):
        out = {}
        for d, _, names in os.walk(root):
            for n in names:
                with open(os.path.join(d, n), "rb") as f:
                    out[os.path.relpath(os.path.join(d, n), root)] = (hashlib.sha1(f.read()).hexdigest(),
                                                                      os.stat(os.path.join(d, n)).st_mtime_ns)
        return out

    hub_standins.main([str(tmp_path / "hub")])
    assert f"HF_HUB_CACHE={tmp_path / 'hub'} HF_HUB_OFFLINE=1" in capsys.readouterr().out
    first, session = files(tmp_path / "hub"), files(hub_cache)
    assert {k: h for k, (h, _) in first.items()} == {k: h for k, (h, _) in session.items()}
    assert len(first) > 40 and any(k.endswith("refs/main") for k in first)
    hub_standins.main([str(tmp_path / "hub")])
    assert files(tmp_path / "hub") == first                                 # same hashes and modification times

    real = tmp_path / "real" / ("models--" + SD3_ID.replace("/", "--")) / "blobs"
    real.mkdir(parents=True)
    with pytest.raises(FileExistsError, match="real download of stabilityai"):
        hub_standins.build_hub_cache(str(tmp_path / "real"))
