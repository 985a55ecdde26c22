"""The CPU demo's model and task: the digit rewards against formulas written here, the committed pipeline and
prompt files against the script that makes them, and the loading fixes the miniature needed (an SD3 folder
without T5, prompt lengths that follow the model, user rewards returning lists or arrays)."""

import json
import os
import re
import subprocess
import sys

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import reward
import vgrpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
DIGITS = os.path.join(ROOT, "digits")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def digit_images(n=12, seed=0, side=16):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, side, side, generator=g)


def held_out_digits():
    """The UCI digits the pretraining held out (as pretrain.py splits them): images (N, 3, 16, 16), labels."""
    pytest.importorskip("sklearn")   # pretrain.py reads scikit-learn's copy of the digits
    sys.path.insert(0, DIGITS)
    import pretrain

    return pretrain.load_split(0, 0.2)[2:]


# --------------------------------------------------------------------------- the judges and the rewards


def test_digit_ink_is_the_mean_ink_of_each_cell_of_a_16x16_grid():
    images = digit_images(2, side=32)
    gray = np.round(images.numpy() * 255) / 255                     # the uint8 picture every reward sees
    ink = 1 - gray.mean(1)                                           # (2, 32, 32)
    want = ink.reshape(2, 16, 2, 16, 2).mean((2, 4))                 # 2x2 blocks of pixels per cell
    np.testing.assert_allclose(reward.digit_ink(images).numpy()[:, 0], want, atol=1e-6)
    np.testing.assert_allclose(reward.digit_ink(images[..., :16, :16]).numpy()[:, 0], ink[:, :16, :16], atol=1e-6)
    outside = digit_images(2) * 3 - 1                               # a decoder's values beyond [0, 1], clipped
    np.testing.assert_allclose(reward.digit_ink(outside).numpy()[:, 0],
                               1 - (np.round(np.clip(outside.numpy(), 0, 1) * 255) / 255).mean(1), atol=1e-6)


def test_the_judges_match_their_formulas_on_the_committed_weights():
    t = load_file(os.path.join(DIGITS, "classifiers.safetensors"))
    judge = reward.DigitJudge.load()
    images = digit_images(16, seed=1)
    cnn = torch.nn.Sequential(                                       # the layout, as torch modules
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
        torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(1024, 11))
    cnn.load_state_dict({k.removeprefix("cnn."): v for k, v in t.items() if k.startswith("cnn.")})
    x = torch.tensor(1 - (np.round(images.numpy() * 255) / 255).mean(1, keepdims=True), dtype=torch.float32)
    with torch.no_grad():
        want = torch.softmax(cnn(x).double(), 1)
    np.testing.assert_allclose(judge.probabilities(images).numpy(), want.numpy(), atol=1e-5)
    # k-NN by brute force: the k closest reference images, majority vote, ties to the digit seen nearest, and
    # "no digit" (10) when the nearest is beyond the gate
    ref, labels, k = t["knn.ink"].double().numpy(), t["knn.labels"].numpy(), int(t["knn.k"])
    # the training digits themselves (pictures of their ink, every 25th), within the gate: the vote decides
    references = (1 - t["knn.ink"][::25].float()).view(-1, 1, 16, 16).repeat(1, 3, 1, 1)
    voted = set()
    for pictures in (images, 1 - 0.9 * (digit_images(16, seed=3) > 0.7).float(), references):
        expected = []
        rows = 1 - (np.round(pictures.numpy() * 255) / 255).mean(1).reshape(len(pictures), -1)
        for row in rows:
            distance = np.sqrt(((ref - row) ** 2).sum(1))
            order = np.argsort(distance, kind="stable")[:k]
            votes = np.bincount(labels[order], minlength=10)
            tied = [d for d in range(10) if votes[d] == votes.max()]
            vote = next(labels[i] for i in order if labels[i] in tied)
            expected.append(10 if distance[order[0]] > float(t["knn.max_distance"]) else vote)
        assert judge.knn_predict(pictures).tolist() == expected
        voted |= set(expected) - {10}
    assert voted == set(range(10))                                   # every digit, by vote


def test_knn_breaks_a_tie_towards_the_digit_whose_image_is_nearest_and_refuses_far_images():
    ink = torch.zeros(4, 256)
    ink[:, 0] = torch.tensor([0.1, 0.2, 0.3, 0.4])                   # distances 0.1 .. 0.4 from the origin
    tensors = {"knn.ink": ink, "knn.labels": torch.tensor([3, 5, 5, 3]), "knn.k": torch.tensor(4),
               "knn.max_distance": torch.tensor(0.15)}
    judge = reward.DigitJudge(tensors)
    white = torch.ones(1, 3, 16, 16)                                 # no ink: at the origin
    assert judge.knn_predict(white).tolist() == [3]                  # 2 votes each; the nearest image is a 3
    judge.labels = torch.tensor([5, 3, 3, 5])
    assert judge.knn_predict(white).tolist() == [5]
    judge.labels = torch.tensor([3, 5, 5, 7])
    assert judge.knn_predict(white).tolist() == [5]                  # the majority, though the nearest is a 3
    judge.max_distance = 0.05                                        # the nearest image is 0.1 away: no digit
    assert judge.knn_predict(white).tolist() == [reward.NO_DIGIT]


def test_the_cnn_calls_made_up_non_digits_no_digit():
    """Bars and blobs, the shortcuts RL took against a classifier of ten digits, score low as any digit."""
    bars = torch.ones(4, 3, 16, 16)
    bars[0, :, 12:16, :] = 0                                         # a thick bottom bar (what "two" became)
    bars[1, :, 5:11, 3:13] = 0                                       # a central blob ("four")
    bars[2, :, 0:3, :] = bars[2, :, 13:16, :] = 0                    # two bars ("five")
    bars[3] = 0                                                      # all ink
    judge = reward.DigitJudge.load()
    assert (judge.predict(bars) == reward.NO_DIGIT).all()
    assert (judge.knn_predict(bars) == reward.NO_DIGIT).all()
    assert judge.probabilities(bars)[:, :10].max() < 0.2


def test_the_judges_read_the_held_out_uci_digits():
    """The committed classifiers on the digits the pretraining held out (as pretrain.py splits them)."""
    images, labels = held_out_digits()
    judge = reward.DigitJudge.load()
    assert (judge.predict(images) == labels).float().mean() > 0.96      # 97.2% when made
    assert (judge.knn_predict(images) == labels).float().mean() > 0.98  # 98.9%


@pytest.mark.parametrize("prompt,metadata,digit", [
    ("a handwritten digit seven", None, 7), ("the number 3", None, 3), ("Nine, written by hand", None, 9),
    ("a drawing of a zero", None, 0), ("anything", {"digit": 4}, 4), ("the digit one", {"tag": "one"}, 1),
    ("a seven", {"digit": 0}, 0), ("a seven", {"digit": 9}, 9)])
def test_the_prompted_digit_comes_from_the_metadata_or_the_prompt(prompt, metadata, digit):
    assert reward.prompted_digit(prompt, metadata) == digit


@pytest.mark.parametrize("prompt,names", [("a cat", "no digit"), ("seven or eight", "several digits"),
                                          ("the numbers 1 and 2", "several digits"), ("someone", "no digit")])
def test_a_prompt_naming_no_single_digit_is_one_line(prompt, names):
    with pytest.raises(reward.RewardError, match=f"prompt '{prompt}' names {names}; " + re.escape(
            'name one ("seven" or "7") or give it as {"digit": 7} in a .jsonl prompt file')):
        reward.prompted_digit(prompt)


@pytest.mark.parametrize("digit", [10, -1, "7", 7.0, True])
def test_a_metadata_digit_outside_0_to_9_is_one_line(digit):
    with pytest.raises(reward.RewardError, match=re.escape(f'prompt \'a seven\' gives "digit": {digit!r}, not 0-9')):
        reward.prompted_digit("a seven", {"digit": digit})


def test_the_three_digit_rewards():
    """digit: the CNN's probability of the prompted digit; digit_correct: 1 where the CNN's most probable class is that
    digit; digit_knn: 1 where the k-NN's vote is. On 24 held-out UCI digits: the 12 on which the CNN and the k-NN
    disagree (judged in one batch of all of them; at least 10 still do in this batch of 24) and 12 on which they
    agree. A prompt file's metadata names the digit over the prompt's words: there the next digit, which neither judge
    reads in these, so the probabilities are small and both accuracies 0."""
    images, labels = held_out_digits()
    judge = reward.DigitJudge.load()
    disagree = judge.predict(images) != judge.knn_predict(images)
    pick = torch.cat([disagree.nonzero().flatten(), (~disagree).nonzero().flatten()[:12]])
    images, labels = images[pick], labels[pick]
    p, cnn, knn = judge.probabilities(images), judge.predict(images), judge.knn_predict(images)
    assert (cnn != knn).sum() >= 10
    rows = torch.arange(len(pick))
    prompts = [f"the number {reward.DIGIT_WORDS[d]}" for d in labels.tolist()]
    fn = reward.load_reward("digit:1,digit_correct:1,digit_knn:1")
    for wanted, metadata in ((labels, None), ((labels + 1) % 10, [{"digit": d} for d in ((labels + 1) % 10).tolist()])):
        fn(images, prompts, metadata)
        torch.testing.assert_close(fn.last_parts["digit"], p[rows, wanted])
        assert torch.equal(fn.last_parts["digit_correct"], (cnn == wanted).float())
        assert torch.equal(fn.last_parts["digit_knn"], (knn == wanted).float())
        if metadata is None:   # the prompts' digits: each judge right on some, and the two told apart
            assert 0 < fn.last_parts["digit_correct"].sum() < fn.last_parts["digit_knn"].sum()
    assert fn.last_parts["digit"].max() < 0.5 < p[rows, labels].mean()   # the metadata's digits are the wrong ones


def test_the_digit_reward_ranks_a_real_digit_of_the_prompted_class_first():
    """A UCI digit drawn as the model draws (16 px, dark on white) scores its own class far above the others."""
    images, labels = held_out_digits()
    seven = images[labels == 7][:4]
    assert len(seven) == 4
    fn = reward.load_reward("digit")
    right, wrong = fn(seven, ["a seven"] * 4), fn(seven, ["a one"] * 4)
    assert (right > 0.8).all() and (wrong < 0.1).all()


# --------------------------------------------------------------------------- the committed model and prompt files


def test_the_prompt_files_are_what_the_script_writes_and_evaluation_phrasings_are_held_out(tmp_path):
    sys.path.insert(0, DIGITS)
    import pretrain

    pretrain.write_prompts(str(tmp_path))
    for name in ("digits_train.jsonl", "digits_eval.jsonl"):
        with open(tmp_path / name) as a, open(os.path.join(ROOT, "prompts", name)) as b:
            assert a.read() == b.read(), name
    train, train_meta = vgrpo.load_prompts(os.path.join(ROOT, "prompts", "digits_train.jsonl"))
    held_out, eval_meta = vgrpo.load_prompts(os.path.join(ROOT, "prompts", "digits_eval.jsonl"))
    assert len(train) == 100 and len(held_out) == 20 and not set(train) & set(held_out)
    for prompts, meta in ((train, train_meta), (held_out, eval_meta)):
        assert [m["digit"] for m in meta] == [reward.prompted_digit(p) for p in prompts]
        assert sorted({m["tag"] for m in meta}) == sorted(reward.DIGIT_WORDS)
    # the training prompts are the pretraining captions; no evaluation phrasing was one
    captions = {c.format(w) for c in pretrain.TRAIN_PHRASINGS for w in reward.DIGIT_WORDS}
    assert not captions & set(held_out) and set(train) == captions


def test_the_digits_pipeline_is_an_sd3_without_t5_that_loads_and_encodes_clip_tokens_only():
    family = vgrpo.load_family(vgrpo.Args(), torch.device("cpu"))   # the default model: digits
    pipe = family.pipe
    assert type(pipe).__name__ == "StableDiffusion3Pipeline" and pipe.text_encoder_3 is None
    assert family.latent_shape == (4, 8, 8) and family.max_sequence_length == 0
    assert sum(p.numel() for p in pipe.transformer.parameters()) == 2_277_124
    emb, pooled = family.encode(["the number seven"])
    assert emb.shape == (1, pipe.tokenizer.model_max_length, 64)     # the CLIP tokens; no zero T5 tokens after them
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(os.path.join(DIGITS, "pipeline"))
                for f in files)
    assert total < 12e6                                               # small enough to commit


def test_an_explicit_max_sequence_length_pads_with_zero_t5_tokens_as_the_pipeline_does():
    args = vgrpo.Args(max_sequence_length=5)
    family = vgrpo.load_family(args, torch.device("cpu"))
    emb, _ = family.encode(["the number seven"])
    want, _, _, _ = family.pipe.encode_prompt("the number seven", None, None, do_classifier_free_guidance=False,
                                              max_sequence_length=5)
    assert emb.shape == (1, family.pipe.tokenizer.model_max_length + 5, 64) and torch.equal(emb, want)
    assert torch.equal(emb[0, -5:], torch.zeros(5, 64))


def test_a_folder_without_t5_loads_and_missing_folders_say_what_is_missing(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    index = json.load(open(os.path.join(DIGITS, "pipeline", "model_index.json")))
    assert index["text_encoder_3"] == [None, None]                   # saved without T5, as diffusers writes it
    with pytest.raises(ValueError):                                   # the defect: diffusers alone refuses it
        StableDiffusion3Pipeline.from_pretrained(os.path.join(DIGITS, "pipeline"))
    pipe = vgrpo.load_pipeline(os.path.join(DIGITS, "pipeline"), "sd3", torch.float32)
    assert pipe.text_encoder_3 is None and pipe.tokenizer_3 is None
    with pytest.raises(vgrpo.UsageError, match="no such folder"):
        vgrpo.validate(vgrpo.Args(model=str(tmp_path / "nowhere"), output_dir=str(tmp_path / "out")), 1)
    with pytest.raises(vgrpo.UsageError, match="has no model_index.json"):
        vgrpo.load_pipeline(str(tmp_path), "sd3", torch.float32)
    broken = tmp_path / "broken"
    import shutil
    shutil.copytree(os.path.join(DIGITS, "pipeline"), broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(vgrpo.UsageError, match="pipeline folder is incomplete") as e:
        vgrpo.load_pipeline(str(broken), "sd3", torch.float32)
    assert "download" not in str(e.value)
    shutil.copytree(os.path.join(DIGITS, "pipeline", "vae"), broken / "vae")
    os.remove(broken / "tokenizer_2" / "tokenizer.json")   # what is left loads as an empty tokenizer, silently
    with pytest.raises(vgrpo.UsageError, match=r"the folder has no vocabulary for tokenizer_2 \(.*\); save the "
                                               "pipeline there again$"):
        vgrpo.load_pipeline(str(broken), "sd3", torch.float32)


@pytest.mark.parametrize("value", [[0.5, 1, 2.0, 3], (1, 2, 3, 4), np.arange(4), np.arange(4, dtype=np.float32),
                                   torch.arange(4), torch.arange(4.0, dtype=torch.float64)])
def test_user_rewards_may_return_a_list_an_array_or_a_tensor(value):
    fn = reward.WeightedReward([("mine", 2.0, lambda images, prompts: value)])
    got = fn(torch.zeros(4, 3, 8, 8), ["a"] * 4)
    assert got.dtype == torch.float32 and torch.equal(got, 2 * torch.tensor(np.asarray(value, dtype=np.float32)))


@pytest.mark.parametrize("value,message", [([1.0, 2.0], r"returned list \(2,\)|not 4 numbers|shape \(4,\)"),
                                           (["a", "b", "c", "d"], "not 4 numbers"), (None, "NoneType"),
                                           (torch.ones(4, 1), r"\(4, 1\)"),
                                           (torch.ones(4, dtype=torch.bool), "bool|Tensor")])
def test_a_reward_that_returns_something_else_is_named(value, message):
    fn = reward.WeightedReward([("mine", 1.0, lambda images, prompts: value)])
    with pytest.raises(reward.RewardError, match=f"reward 'mine'.*({message})"):
        fn(torch.zeros(4, 3, 8, 8), ["a"] * 4)


@pytest.mark.slow
def test_pretraining_runs_end_to_end_in_quick_mode_and_its_pipeline_loads(tmp_path):
    """digits/pretrain.py at toy lengths (the committed model took the full ones): every output is written and
    the pipeline loads into vgrpo as --model FOLDER."""
    pytest.importorskip("sklearn")
    p = subprocess.run([sys.executable, os.path.join(DIGITS, "pretrain.py"), "--quick", "--out", str(tmp_path)],
                       env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.load(open(tmp_path / "pretrain.json"))["results"]
    # 30 classifier steps in quick mode: 0.77 held-out accuracy (chance 1/11); 0.99 for the k-NN, which needs no
    # training
    assert results["classifier_held_out_accuracy"] > 0.5 and results["knn_held_out_accuracy"] > 0.9
    assert 0 <= results["accuracy"] <= 1
    family = vgrpo.load_family(vgrpo.Args(model=str(tmp_path / "pipeline"), resolution=16), torch.device("cpu"))
    assert family.pipe.text_encoder_3 is None and family.latent_shape == (4, 8, 8)
    assert reward.DigitJudge.load(str(tmp_path / "classifiers.safetensors")).k == 5
