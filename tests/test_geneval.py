"""GenEval in-process (reward.py): its rules on hand-made detections for every tag and boundary, with the expected
verdicts written here; the detector's post-processing against a hand computation; the colour classifier's text
embeddings; the rewards loaded under their real ids from the stand-in cache."""

import copy
import io
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch

import reward

EMPTY = torch.zeros(4, 4, dtype=torch.bool)


def det(name, score, box=(0, 0, 10, 10)):
    return (name, score, box, EMPTY)


def objects(*dets, tag="two_object"):
    return reward.geneval_objects(list(dets), tag)


def no_colours(name, found):
    raise AssertionError("no colour was asked for")


def verdict(meta, objs, colours=no_colours):
    return reward.geneval_rules(meta, objs, colours)


# --------------------------------------------------------------------------- which detections count


def test_detections_above_0_3_count_and_above_0_9_for_counting():
    dets = [det("cat", 0.31), det("cat", 0.30), det("dog", 0.95), det("dog", 0.85), det("cow", 0.1)]
    assert {k: len(v) for k, v in objects(*dets).items()} == {"cat": 1, "dog": 2}   # 0.30 is not above 0.3
    assert {k: len(v) for k, v in objects(*dets, tag="counting").items()} == {"dog": 1}


def test_scores_are_compared_with_the_thresholds_in_float32_as_geneval_does():
    """GenEval compares the detector's float32 scores with 0.3 (0.9) in float32: a score of exactly float32(0.3) is
    not above it, though as a double (0.30000001...) it is above the double 0.3; the next float32 up is above. At
    0.9, whose float32 lies below 0.9, both comparisons agree; the boundary is checked all the same."""
    at, above = float(np.float32(0.3)), float(np.nextafter(np.float32(0.3), np.float32(1)))
    assert at > 0.3                                                  # the comparison a double would make
    assert {k: len(v) for k, v in objects(det("cat", at), det("dog", above)).items()} == {"dog": 1}
    at, above = float(np.float32(0.9)), float(np.nextafter(np.float32(0.9), np.float32(1)))   # float32(0.9) < 0.9
    assert {k: len(v) for k, v in objects(det("cat", at), det("dog", above), tag="counting").items()} == {"dog": 1}


def test_at_most_16_per_class_best_first_and_no_suppression():
    # 20 identical boxes (an NMS would keep one), scores 0.40 .. 0.59 in a shuffled order
    scores = [0.40 + 0.01 * ((7 * i) % 20) for i in range(20)]
    found = objects(*[det("cup", s, (i, 0, i + 5, 5)) for i, s in enumerate(scores)])["cup"]
    assert len(found) == 16
    kept = [box[0] for box, _ in found]
    best = sorted(range(20), key=lambda i: -scores[i])[:16]
    assert kept == best                                              # the 16 best, in order of score


# --------------------------------------------------------------------------- include, count, exclude


def test_an_include_clause_needs_its_count_and_takes_the_best_ones():
    meta = {"tag": "two_object", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}]}
    assert verdict(meta, objects(det("cat", 0.8), det("dog", 0.5)))[0] is True
    assert verdict(meta, objects(det("cat", 0.8)))[0] is False       # no dog
    assert verdict(meta, objects(det("cat", 0.8), det("cat", 0.7), det("dog", 0.5)))[0] is True   # extra cats: fine
    meta = {"tag": "counting", "include": [{"class": "cat", "count": 3}], "exclude": [{"class": "cat", "count": 4}]}
    three = [det("cat", 0.95, (10 * i, 0, 10 * i + 5, 5)) for i in range(3)]
    assert verdict(meta, objects(*three, tag="counting"))[0] is True
    assert verdict(meta, objects(*three[:2], tag="counting"))[0] is False                # two of three
    assert verdict(meta, objects(*three, det("cat", 0.99), tag="counting"))[0] is False  # exclude at 4: fails
    assert verdict(meta, objects(*three, det("cat", 0.85), tag="counting"))[0] is True   # a fourth below 0.9


def test_exclude_fails_at_its_count_not_below():
    meta = {"tag": "single_object", "include": [{"class": "bus", "count": 1}],
            "exclude": [{"class": "cow", "count": 2}]}
    assert verdict(meta, objects(det("bus", 0.5), det("cow", 0.5)))[0] is True
    assert verdict(meta, objects(det("bus", 0.5), det("cow", 0.5), det("cow", 0.4)))[0] is False


# --------------------------------------------------------------------------- colours


def test_colour_clauses_ask_the_colour_of_each_found_object():
    meta = {"tag": "color_attr", "include": [{"class": "car", "count": 1, "color": "red"},
                                             {"class": "bench", "count": 1, "color": "blue"}]}
    objs = objects(det("car", 0.9), det("car", 0.4), det("bench", 0.6))
    asked = []

    def colours(name, found):
        asked.append((name, len(found)))
        return {"car": ["red"], "bench": ["green"]}[name]

    assert reward.geneval_correct(meta, objs, colours) is False     # the bench is green
    assert asked == [("car", 1), ("bench", 1)]                       # only the best `count` of each class
    # partial credit (Flow-GRPO's terms): car 1 - |1 - 2| / 1 = 0 and, its count not exact, a 0 for the colour;
    # bench 1, then 1 - |1 - 0 blue| / 1 = 0 -> mean of (0, 0, 1, 0); all detections are asked this time
    asked.clear()
    assert reward.geneval_partial_score(meta, objs, colours) == 0.25 and asked == [("bench", 1)]
    assert verdict(meta, objs, lambda name, found: {"car": ["red"], "bench": ["blue"]}[name]) == (True, 0.5)
    meta = {"tag": "colors", "include": [{"class": "car", "count": 2, "color": "red"}]}
    assert verdict(meta, objs, lambda name, found: ["red", "blue"])[0] is False   # both must be red
    assert verdict(meta, objs, lambda name, found: ["red", "red"]) == (True, 1.0)
    # one of two red: correct fails; partial (count 1 - 0, colour 1 - |2 - 1| / 2) = 0.75
    assert verdict(meta, objs, lambda name, found: ["red", "blue"]) == (False, 0.75)


# --------------------------------------------------------------------------- positions


@pytest.mark.parametrize("a,b,relations", [
    ((0, 0, 10, 10), (20, 0, 30, 10), {"left of"}),                 # offset -20, shrunk by 0.1 x 20: dx = -0.9
    ((20, 0, 30, 10), (0, 0, 10, 10), {"right of"}),
    ((0, 0, 10, 10), (0, 30, 10, 40), {"above"}),                   # y grows downwards
    ((0, 30, 10, 40), (0, 0, 10, 10), {"below"}),
    ((0, 0, 10, 10), (4, 0, 14, 10), set()),                        # offset 4, shrunk to 2: dx = -0.5, not < -0.5
    ((0, 0, 10, 10), (4.02, 0, 14.02, 10), {"left of"}),            # (4.02 - 2) / 4.02 = 0.502
    ((0, 0, 10, 10), (1, 0, 11, 10), set()),                        # offset 1 < the shrink 2: clamped to 0
    ((0, 0, 10, 10), (20, 20, 30, 30), {"left of", "above"}),       # diagonal: both 18 / 28.3 = 0.64
    ((0, 0, 10, 10), (20, 8, 30, 18), {"left of"}),                 # dy shrunk to 6 / 21.5 = 0.28: no vertical
    ((4, 0, 14, 10), (0, 0, 10, 10), set()),                        # each threshold is strict: dx = 0.5 ...
    ((0, 0, 10, 10), (0, 4, 10, 14), set()),                        # ... dy = -0.5
    ((0, 4, 10, 14), (0, 0, 10, 10), set()),                        # ... dy = 0.5
    # boxes off the origin, each of its own width and height: offset (70, 90), sizes summed (60 + 60, 180 + 20),
    # shrunk by (12, 20) to (58, 70), over the length 114.0: dx = 0.509, dy = 0.614
    ((120, 330, 180, 510), (50, 320, 110, 340), {"right of", "below"}),
    # offset (15, 70), sizes (250 + 140, 150 + 270): x shrunk to 0, y to 70 - 42 = 28, dy = 28 / 71.6 = 0.39
    ((140, 140, 390, 290), (180, 10, 320, 280), set()),
    ((0, 0, 0.1, 0.1), (0.9, 0, 1.0, 0.1), {"left of"}),            # small boxes: shrunk -0.88, dx = -0.98
    ((0.001, 0, 0.001, 0), (0, 0, 0, 0), {"right of"}),              # points 1e-3 apart: not "nearly coincide"
])
def test_relative_position(a, b, relations):
    assert reward.relative_position(a, b) == relations


def test_a_position_clause_compares_with_every_object_of_its_target_clause():
    meta = {"tag": "position", "include": [{"class": "dog", "count": 1},
                                           {"class": "cat", "count": 1, "position": ["left of", 0]}]}
    left, right = (0, 0, 10, 10), (40, 0, 50, 10)
    assert verdict(meta, objects(det("dog", 0.9, right), det("cat", 0.9, left))) == (True, 1.0)
    # wrong side: partial terms dog 1, cat 1, then the server's 0 and 1 for the failed relation -> 3 / 4
    assert verdict(meta, objects(det("dog", 0.9, left), det("cat", 0.9, right))) == (False, 0.75)
    # clause 0 did not match (no dog): the cat has nothing to be left of, and fails too; partial (0, 1, 0)
    assert verdict(meta, objects(det("cat", 0.9, left))) == (False, pytest.approx(1 / 3))
    meta["include"][0]["count"] = 2    # two dogs, the cat must be left of both
    two = [det("dog", 0.9, right), det("dog", 0.8, (20, 0, 30, 10))]
    assert verdict(meta, objects(*two, det("cat", 0.9, left)))[0] is True
    two[1] = det("dog", 0.8, (-30, 0, -20, 10))
    assert verdict(meta, objects(*two, det("cat", 0.9, left)))[0] is False


def test_partial_credit_of_counts_colours_positions_and_chains_term_by_term():
    """The reward server's terms where a count is above one, a position clause's count is off, a position refers to
    a colour clause, and a position refers to a clause that itself failed its position."""
    left, right, top = (0, 0, 10, 10), (40, 0, 50, 10), (0, -40, 10, -30)
    three = [det("cat", 0.9 - 0.1 * i, (20 * i, 0, 20 * i + 10, 10)) for i in range(3)]
    # count 2, three found: 1 - |2 - 3| / 2 = 0.5 (the best two satisfy GenEval)
    assert verdict({"tag": "counting", "include": [{"class": "cat", "count": 2}]}, objects(*three)) == (True, 0.5)
    # a position clause with two cats for one: dog 1, cat 1 - |1 - 2| = 0, and a 0 for its position -> 1 / 3
    meta = {"tag": "position", "include": [{"class": "dog", "count": 1},
                                           {"class": "cat", "count": 1, "position": ["left of", 0]}]}
    assert verdict(meta, objects(det("dog", 0.9, right), *three[:1], det("cat", 0.5, (60, 0, 70, 10)))) == \
        (True, pytest.approx(1 / 3))
    # a red car (count and colour exact: it holds), then a dog right of it: car 1, red 1, dog 1, position 1
    meta = {"tag": "color_attr", "include": [{"class": "car", "count": 1, "color": "red"},
                                             {"class": "dog", "count": 1, "position": ["right of", 0]}]}
    assert verdict(meta, objects(det("car", 0.9, left), det("dog", 0.9, right)), lambda name, found: ["red"]) == \
        (True, 1.0)
    # no dog; a cat left of it, a bird above the cat: dog 0; cat 1 and 0 (no target); bird 1 and 0 (its target, the
    # cat, did not hold) -> 2 / 5
    meta = {"tag": "position", "include": [{"class": "dog", "count": 1},
                                           {"class": "cat", "count": 1, "position": ["left of", 0]},
                                           {"class": "bird", "count": 1, "position": ["above", 1]}]}
    assert verdict(meta, objects(det("cat", 0.9, left), det("bird", 0.9, top))) == (False, pytest.approx(2 / 5))
    assert reward.geneval_partial_score({"include": []}, {}, no_colours) == 0.0


# --------------------------------------------------------------------------- classes


def test_the_80_classes_in_coco_order_with_genevals_three_renames():
    assert len(reward.GENEVAL_CLASSES) == 80 and len(set(reward.GENEVAL_CLASSES)) == 80
    assert reward.GENEVAL_CLASSES[:3] == ("person", "bicycle", "car") and reward.GENEVAL_CLASSES[-1] == "toothbrush"
    assert reward.GENEVAL_CLASSES[64:67] == ("computer mouse", "tv remote", "computer keyboard")
    assert reward.GENEVAL_CLASSES.index("tv") == 62 and reward.GENEVAL_CLASSES.index("cell phone") == 67
    assert reward.GENEVAL_COLORS == ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black",
                                     "white")


# --------------------------------------------------------------------------- the detector's input and post-processing


def test_detector_input_fits_1333_by_800_without_antialiasing_and_pads_to_32():
    images = torch.rand(1, 3, 100, 60)
    x, size = reward.detector_input(images)
    factor = min(1333 / 100, 800 / 60)                                # the long side limit binds: 13.33
    assert size == (int(100 * factor + 0.5), int(60 * factor + 0.5)) == (1333, 800)
    assert x.shape == (1, 3, 1344, 800)                               # 1333 padded to 1344
    assert (x[..., 1333:, :] == 0).all()
    u8 = (images * 255).round()
    by_hand = torch.nn.functional.interpolate(u8, size=size, mode="bilinear", align_corners=False).round()
    mean, std = torch.tensor([123.675, 116.28, 103.53]), torch.tensor([58.395, 57.12, 57.375])
    assert torch.allclose(x[0, :, :1333], (by_hand[0] - mean[:, None, None]) / std[:, None, None], atol=1e-4)
    assert reward.detector_input(torch.rand(1, 3, 512, 512))[1] == (800, 800)
    wide = torch.rand(1, 3, 100, 400, generator=torch.Generator().manual_seed(0)) * 3 - 1   # beyond [0, 1] too
    x, size = reward.detector_input(wide)
    factor = min(1333 / 400, 800 / 100)                               # the long side binds: 3.3325
    assert size == (int(100 * factor + 0.5), int(400 * factor + 0.5)) == (333, 1333)
    assert x.shape == (1, 3, 352, 1344) and (x[..., 333:, :] == 0).all() and (x[..., 1333:] == 0).all()
    assert torch.equal(x, reward.detector_input(wide.clamp(0, 1))[0])   # a decoder's values, clipped
    black, white = (0 - mean) / std, (255 - mean) / std               # clipped ones stay black and white
    assert torch.allclose(x[0, :, :333, :1333].amin((1, 2)), black) and torch.allclose(x[0, :, :333, :1333].amax(
        (1, 2)), white)


def test_mask2former_post_processing_by_hand():
    # 2 queries, 3 classes + no-object; masks of 2 x 2 at a quarter of an 8 x 8 padded input; the resized image is
    # the top-left 6 x 8 of it, the original image 3 x 4
    class_logits = torch.tensor([[2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 3.0, 1.0]])
    mask_logits = torch.tensor([[[4.0, -4.0], [-4.0, -4.0]], [[-4.0, -4.0], [-4.0, 4.0]]])
    dets = reward.mask2former_detections(class_logits, mask_logits, (6, 8), (3, 4), top_k=2)
    # top 2 (query, class) pairs by probability: query 1 class 2, query 0 class 0
    p = torch.softmax(class_logits, -1)
    assert [d[0] for d in dets] == [2, 0]
    for (label, score, box, mask), q in zip(dets, (1, 0)):
        up = torch.nn.functional.interpolate(mask_logits[q][None, None], size=(8, 8), mode="bilinear",
                                             align_corners=False)[:, :, :6, :8]
        logits = torch.nn.functional.interpolate(up, size=(3, 4), mode="bilinear", align_corners=False)[0, 0]
        binary = logits > 0
        assert torch.equal(mask, binary)
        mean_prob = logits.sigmoid()[binary].mean() if binary.any() else torch.tensor(0.0)
        assert score == pytest.approx((p[q, label] * mean_prob).item(), rel=1e-5)
        rows, cols = binary.any(1).nonzero().flatten(), binary.any(0).nonzero().flatten()
        assert box == (cols.min().item(), rows.min().item(), cols.max().item() + 1, rows.max().item() + 1)
    assert dets[1][2][:2] == (0, 0) and dets[0][2][2:] == (4, 3)     # top-left and bottom-right corners


def test_first_and_last_true_of_each_row():
    flags = torch.tensor([[False, True, False, True], [False, False, False, False], [True, False, False, False]])
    first, last = reward._first_and_last(flags)
    assert first.tolist() == [1, 4, 0] and last.tolist() == [3, -1, 0]      # none: N and -1


def test_an_empty_mask_has_a_zero_box_and_score():
    dets = reward.mask2former_detections(torch.tensor([[5.0, 0.0]]), torch.full((1, 2, 2), -5.0), (8, 8), (8, 8))
    assert dets[0][1] == 0.0 and dets[0][2] == (0, 0, 0, 0)


def test_mask2former_post_processing_of_non_square_masks_beside_empty_ones():
    """3 queries, masks of 2 x 4 (a wide padded input, 8 x 16; the resized image its top-left 6 x 14, the image 3 x
    7): a mask, one of logits exactly 0 (empty: the threshold is strict) and one all negative (empty), each box
    from its own mask; and the top 100 of more (query, class) pairs."""
    class_logits = torch.tensor([[3.0, 0.0, 0.0], [0.0, 2.0, 0.0], [1.0, 0.0, 0.0]])
    mask_logits = torch.stack([torch.tensor([[-4.0, 4.0, 4.0, -4.0], [-4.0, -4.0, 4.0, -4.0]]),
                               torch.zeros(2, 4), torch.full((2, 4), -4.0)])
    dets = reward.mask2former_detections(class_logits, mask_logits, (6, 14), (3, 7), top_k=3)
    assert [d[0] for d in dets] == [0, 1, 0]                          # the labels of queries 0, 1, 2, in order
    up = torch.nn.functional.interpolate(mask_logits[:1, None], size=(8, 16), mode="bilinear",
                                         align_corners=False)[:, :, :6, :14]
    binary = torch.nn.functional.interpolate(up, size=(3, 7), mode="bilinear", align_corners=False)[0, 0] > 0
    assert torch.equal(dets[0][3], binary) and binary.any() and not binary.all()
    rows, cols = binary.any(1).nonzero().flatten(), binary.any(0).nonzero().flatten()
    assert dets[0][2] == (cols.min().item(), rows.min().item(), cols.max().item() + 1, rows.max().item() + 1)
    for label, score, box, mask in dets[1:]:
        assert not mask.any() and box == (0, 0, 0, 0) and score == 0.0
    g = torch.Generator().manual_seed(0)
    class_logits = torch.randn(30, 5, generator=g)                    # 30 queries x 4 classes: the top 100 kept
    many = reward.mask2former_detections(class_logits, torch.randn(30, 2, 2, generator=g), (8, 8), (8, 8))
    top = class_logits.softmax(-1)[:, :-1].flatten().topk(100).indices
    assert [d[0] for d in many] == (top % 4).tolist()


# --------------------------------------------------------------------------- the judge from the stand-in cache


@pytest.fixture
def judge(use_hub_cache):
    """The stand-ins' judge, loaded afresh (load_reward shares one per device) and dropped after the test."""
    reward._GENEVAL.clear()
    yield reward.load_geneval_judge("cpu")
    reward._GENEVAL.clear()


def test_the_colour_classifier_averages_three_normalised_templates_per_colour(judge):
    clip, tokenizer = judge.clip, judge.processor.tokenizer
    expected = []
    for colour in ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"):
        texts = [f"a photo of a {colour} fire hydrant", f"a photo of a {colour}-colored fire hydrant",
                 f"a photo of a {colour} object"]
        with torch.no_grad():   # one text at a time: no padding in the way
            emb = torch.cat([reward._features(clip.get_text_features(**tokenizer([t], return_tensors="pt")))
                             for t in texts])
        mean = (emb / emb.norm(dim=-1, keepdim=True)).mean(0)
        expected.append(mean / mean.norm())
    assert torch.allclose(judge.colour_classifier("fire hydrant"), torch.stack(expected), atol=1e-5)


def test_an_objects_colour_is_clip_on_its_mask_over_grey_cropped_to_its_box(judge):
    picture = torch.rand(3, 20, 30)
    mask = torch.zeros(20, 30, dtype=torch.bool)
    mask[4:12, 5:25] = True
    mask[6, 7] = False                                                # a hole: grey shows through
    box = (5, 4, 25, 12)
    crop = torch.full_like(picture, 0.6)                              # #999999
    crop[:, mask] = picture[:, mask]
    crop = crop[:, 4:12, 5:25]
    pixels = reward.clip_pixel_values(crop[None], judge.processor.image_processor, round_crop_offset=True)
    with torch.no_grad():
        emb = reward._features(judge.clip.get_image_features(pixel_values=pixels))
    similarity = (emb / emb.norm(dim=-1, keepdim=True)) @ judge.colour_classifier("cat").T
    assert judge.colours(picture, "cat", [(box, mask)]) == [reward.GENEVAL_COLORS[similarity.argmax().item()]]


def test_the_colour_crops_centre_offset_rounds_to_nearest_as_torchvisions_center_crop(judge):
    """open_clip's preprocessing (GenEval's colour classifier) crops with torchvision's CenterCrop, whose offset is
    int(round((size - crop) / 2)), half to even; transformers' processors round down. A 32 x 33 box resizes to
    224 x 231: torchvision's offset is round(3.5) = 4 columns, rounding down would give 3."""
    picture = torch.rand(3, 40, 50)
    mask = torch.ones(40, 50, dtype=torch.bool)
    box = (5, 4, 38, 36)                                              # 33 wide, 32 high
    processor = judge.processor.image_processor
    uncropped = copy.deepcopy(processor)
    uncropped.do_center_crop = False
    resized = reward.clip_pixel_values(picture[None, :, 4:36, 5:38], uncropped)
    assert resized.shape[-2:] == (224, 231)
    left = int(round((231 - 224) / 2.0))                              # torchvision's rule
    assert left == 4
    expected = resized[..., :, left:left + 224]
    assert torch.equal(judge.colour_pixels(picture, [(box, mask)]), expected)
    assert torch.equal(reward.clip_pixel_values(picture[None, :, 4:36, 5:38], processor), resized[..., :, 3:227])
    for width in range(224, 240):                                     # the rule at every parity, half to even
        x = torch.rand(1, 3, 224, width)
        left = int(round((width - 224) / 2.0))
        assert torch.equal(reward.clip_pixel_values(x, processor, round_crop_offset=True),
                           reward.clip_pixel_values(x[..., left:left + 224], uncropped))
        top = left                                                    # and from the top of a tall box
        assert torch.equal(reward.clip_pixel_values(x.transpose(-1, -2), processor, round_crop_offset=True),
                           reward.clip_pixel_values(x.transpose(-1, -2)[..., top:top + 224, :], uncropped))


def test_geneval_partial_jpeg_judges_the_quality_75_jpeg_of_each_image(judge):
    """geneval_partial_jpeg scores what Flow-GRPO's server receives: each image encoded by PIL as a quality-75 JPEG
    and decoded, here by hand; otherwise it is geneval_partial."""
    from PIL import Image

    images = torch.rand(3, 3, 24, 24)
    by_hand = []
    for image in images:
        buf = io.BytesIO()
        Image.fromarray((image * 255).round().byte().permute(1, 2, 0).numpy()).save(buf, format="JPEG", quality=75)
        by_hand.append(torch.from_numpy(np.array(Image.open(buf).convert("RGB"))).permute(2, 0, 1).float() / 255)
    by_hand = torch.stack(by_hand)
    assert (by_hand - images).abs().max() > 0.05                      # the encoding changes the pixels
    assert torch.equal(reward.jpeg_round_trip(images), by_hand)
    ramp = torch.linspace(0, 1, 24)                                   # smooth pictures: JPEG's quality shows
    colours = torch.rand(2, 3, 3, 1, 1, generator=torch.Generator().manual_seed(0))
    smooth = (ramp.view(1, 1, 1, 24) * colours[0] + ramp.view(1, 1, 24, 1) * colours[1]) / 2
    error = {q: (reward.jpeg_round_trip(smooth, quality=q) - smooth).abs().mean() for q in (75, 95)}
    assert error[95] < 0.8 * error[75]                                # the quality asked for is the one used
    metadata = [{"tag": "single_object", "include": [{"class": "dog", "count": 1}]}] * 3
    fn = reward.load_reward("geneval_partial_jpeg")
    scores = fn(images, ["a photo of a dog"] * 3, metadata)
    assert torch.equal(judge.last[0], by_hand)                        # the judge saw the JPEG's pixels
    assert torch.equal(scores, reward.load_reward("geneval_partial")(by_hand, ["a photo of a dog"] * 3, metadata))


def test_geneval_and_its_partial_score_share_one_detector_pass_per_batch(judge):
    """load_reward on the stand-ins: the verdicts equal the pieces composed here by hand (detector input, detector,
    post-processing, thresholds, rules), image by image with its own metadata; both rewards detect once."""
    fn = reward.load_reward("geneval:1,geneval_partial:1")
    assert reward.load_geneval_judge("cpu") is judge
    with torch.no_grad():   # random class weights score every class near 1/81: make "dog" and "cat" detectable
        judge.detector.class_predictor.bias[[16, 15]] += torch.tensor([9.0, 8.5])
    metadata = [{"tag": "single_object", "include": [{"class": "dog", "count": 1}]},
                {"tag": "counting", "include": [{"class": "dog", "count": 2}],
                 "exclude": [{"class": "dog", "count": 3}]},
                {"tag": "color_attr", "include": [{"class": "dog", "count": 1, "color": "red"},
                                                  {"class": "cat", "count": 1, "color": "blue"}]},
                {"tag": "position", "include": [{"class": "cat", "count": 1},
                                                {"class": "dog", "count": 1, "position": ["left of", 0]}]}] * 3
    images = torch.rand(len(metadata), 3, 24, 24)
    passes = []
    hook = judge.detector.register_forward_hook(lambda *_: passes.append(1))
    try:
        total = fn(images, ["a prompt"] * len(images), metadata)
    finally:
        hook.remove()
    assert len(passes) == 2                                           # 12 images, 8 per pass, once for both rewards
    by_hand = []
    for image, meta in zip(images, metadata):
        pixels, size = reward.detector_input(image[None])
        with torch.no_grad():
            out = judge.detector(pixel_values=pixels)
        found = reward.mask2former_detections(out.class_queries_logits[0], out.masks_queries_logits[0], size, (24, 24))
        threshold = 0.9 if meta["tag"] == "counting" else 0.3
        objects = {}
        for c, score, box, mask in sorted(found, key=lambda d: -d[1]):
            name = reward.GENEVAL_CLASSES[c]
            if np.float32(score) > np.float32(threshold) and len(objects.setdefault(name, [])) < 16:
                objects[reward.GENEVAL_CLASSES[c]].append((box, mask))
        picture = (image * 255).round() / 255
        by_hand.append(reward.geneval_rules(meta, objects, lambda name, objs: judge.colours(picture, name, objs)))
    correct, partial = (torch.tensor([v[k] for v in by_hand], dtype=torch.float32) for k in (0, 1))
    assert torch.allclose(fn.last_parts["geneval"], correct) and torch.allclose(fn.last_parts["geneval_partial"],
                                                                                partial, atol=1e-6)
    assert torch.allclose(total, correct + partial, atol=1e-6)
    assert len({round(v, 6) for v in partial.tolist()}) > 1           # the case is not degenerate


def test_geneval_without_metadata_is_one_clear_error(judge):
    fn = reward.load_reward("geneval_partial")
    with pytest.raises(reward.RewardError, match="needs GenEval metadata for every prompt"):
        fn(torch.rand(2, 3, 16, 16), ["a dog", "a cat"])


# --------------------------------------------------------------------------- the shipped training prompts


_DOG = {"class": "dog", "count": 1}


@pytest.mark.parametrize("metadata,problem", [
    ({"tag": "two_object", "include": [_DOG, {"class": "cat", "count": 2, "color": "black",
                                              "position": ["left of", 0]}], "exclude": [{"class": "cat", "count": 3}]},
     None),
    ({"tag": "single_object", "include": [_DOG]}, None),                       # "exclude" may be left out
    (None, 'no "include" clauses'),
    ({"tag": "x", "include": []}, 'no "include" clauses'),
    ({"include": [{"class": "mouse", "count": 1}]}, "include clause 0: class 'mouse' is none of GenEval's 80"),
    ({"include": [_DOG], "exclude": [{"class": "TV", "count": 1}]}, "exclude clause 0: class 'TV' is none"),
    ({"include": [{"class": "dog", "count": 0}]}, "include clause 0: count 0 is not a whole number >= 1"),
    ({"include": [{"class": "dog", "count": "2"}]}, "count '2' is not"),
    ({"include": [{"class": "dog", "count": True}]}, "count True is not"),
    ({"include": [{"class": "dog"}]}, "count None is not"),
    ({"include": [{"class": "dog", "count": 1, "color": "gray"}]}, "include clause 0: color 'gray' is none of red,"),
    ({"include": [_DOG, dict(_DOG, position=["left_of", 0])]}, "include clause 1: position ['left_of', 0] is not"),
    ({"include": [_DOG, dict(_DOG, position=["above", 1])]}, "position ['above', 1] is not [relation, j]"),
    ({"include": [dict(_DOG, position=["above", 0])]}, "include clause 0: position ['above', 0]"),
    ({"include": [_DOG], "exclude": [dict(_DOG, position=["above", 0])]}, "exclude clause 0: position"),
    ({"include": [_DOG], "exclude": {"class": "dog", "count": 2}}, '"exclude" is {'),
    ({"include": ["dog"]}, """include clause 0: 'dog' is not an object {"class": ..., "count": ...}"""),
])
def test_geneval_metadata_that_could_never_match_is_named(metadata, problem):
    """A class, colour or relation GenEval does not know is never found: such a prompt scores 0 every time and never
    trains; a position must name an earlier include clause (the rules index the clauses matched so far)."""
    got = reward.geneval_metadata_problem(metadata)
    assert got is None if problem is None else problem in (got or ""), got


def test_the_judge_names_the_metadata_problem(judge):
    fn = reward.load_reward("geneval")
    with pytest.raises(reward.RewardError, match=r"needs GenEval metadata for every prompt .*: include clause 0: "
                                                 r"class 'mouse' is none"):
        fn(torch.rand(2, 3, 16, 16), ["a dog", "a mouse"], [{"include": [_DOG]}, {"include": [{"class": "mouse",
                                                                                                "count": 1}]}])


def test_the_shipped_training_prompts_are_in_genevals_format_and_are_the_scripts_output(tmp_path):
    import json
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "prompts"))
    import make_prompts

    with open(os.path.join(root, "prompts", "geneval_train.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert [reward.geneval_metadata_problem(line) for line in lines] == [None] * len(lines)
    tags = {line["tag"] for line in lines}
    assert tags == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
    for line in lines:
        clauses = line["include"]
        assert all(c["class"] in reward.GENEVAL_CLASSES and c["class"] in line["prompt"] for c in clauses)
        assert all(c["color"] in reward.GENEVAL_COLORS and c["class"] != "person" for c in clauses if "color" in c)
        assert len(clauses) == {"single_object": 1, "counting": 1, "colors": 1}.get(line["tag"], 2), line
        if line["tag"] == "counting":
            count = clauses[0]["count"]
            assert 2 <= count <= 4 and line["exclude"] == [{"class": clauses[0]["class"], "count": count + 1}]
            assert line["prompt"].startswith(f"a photo of {('two', 'three', 'four')[count - 2]} ")
        if line["tag"] == "position":
            relation, target = clauses[1]["position"]
            assert target == 0 and f" {relation} " in line["prompt"]
        if line["tag"] == "single_object":  # GenEval evaluates every "a photo of a NAME": none of those here
            assert not line["prompt"].startswith("a photo of")
    assert len({line["prompt"] for line in lines}) == len(lines)
    # the file is the script's output with GenEval's evaluation prompts left out (the count its docstring states)
    everything, excluded = make_prompts.write(str(tmp_path))
    assert excluded == 0 and len(everything) - len(lines) == 104
    it = iter(everything)
    assert all(line in it for line in lines)                          # in order: a subsequence of the draws
    assert open(tmp_path / "ocr_train.txt").read() == open(os.path.join(root, "prompts", "ocr_train.txt")).read()
    assert make_prompts.plural("bus") == "buses" and make_prompts.plural("sheep") == "sheeps"
