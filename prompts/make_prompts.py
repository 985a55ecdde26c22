"""Write the curriculum's training prompt files that the project ships, deterministically:

    python prompts/make_prompts.py                     # prompts/geneval_train.jsonl and prompts/ocr_train.txt
    python prompts/make_prompts.py --exclude evaluation_metadata.jsonl   # also drop GenEval's evaluation prompts

geneval_train.jsonl: GenEval-format lines ({"tag", "include", "exclude", "prompt"}) for the six task types of
GenEval, from the 80 COCO classes and GenEval's 10 colours, in GenEval's own phrasing ("a photo of ..."):
single_object (in three other phrasings: the evaluation holds every "a photo of a NAME"), two_object, counting (2
to 4 of every class), colors, position (left of, right of, above, below) and color_attr (two objects, each with a
colour), with GenEval's plural rule and no colour asked of a person, as its evaluation prompts are written.
Every object pair, count and colour is drawn with a fixed seed. The prompts of GenEval's 553-prompt evaluation set
(its prompts/evaluation_metadata.jsonl) are left out with --exclude: the shipped file (1,466 prompts) was made so,
and 104 prompts were left out for it. What each tag's metadata means for the reward: reward.geneval_rules.

ocr_train.txt: text-rendering prompts for the OCR stage, each quoting the text to render ("a neon sign that says
\"OPEN LATE\""), from templates and texts written for this project.
"""

import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import reward  # noqa: E402

PER_TAG = {"two_object": 300, "counting": 240, "colors": 240, "position": 300, "color_attr": 300}  # draws
SINGLE_OBJECT_PHRASINGS = ("a picture of {}", "an image of {}", "a close-up photo of {}")
NUMBERS = {2: "two", 3: "three", 4: "four"}
RELATIONS = ("left of", "right of", "above", "below")

OCR_TEMPLATES = (
    'a neon sign that says "{}"', 'a wooden sign reading "{}"', 'a chalkboard with "{}" written on it',
    'a coffee mug printed with "{}"', 'a t-shirt with the words "{}"', 'a book cover titled "{}"',
    'a street sign that reads "{}"', 'a birthday cake with "{}" written in icing', 'a poster that says "{}"',
    'a shop window painted with "{}"', 'a license plate reading "{}"', 'graffiti on a brick wall that says "{}"',
    'a banner over a stage that reads "{}"', 'a handwritten note saying "{}"', 'a billboard with the text "{}"',
    'a cereal box labelled "{}"', 'a road marking that says "{}"', 'a sticky note with "{}" on it',
    'a movie poster with the title "{}"', 'an old typewriter page with "{}" typed on it',
    'a glowing arcade screen showing "{}"', 'a sandcastle next to "{}" written in the sand',
    'a jar labelled "{}"', 'a vintage postcard that says "{}"', 'a lighthouse with "{}" painted on its side',
)
OCR_TEXTS = (
    "OPEN LATE", "HELLO WORLD", "fresh bread", "GAME OVER", "welcome home", "NO PARKING", "best friends",
    "SALE 50%", "Good Morning", "EXIT", "slow down", "HAPPY BIRTHDAY", "coffee first", "STOP", "thank you",
    "ROUTE 66", "Made with love", "PIZZA", "keep calm", "BOOKS", "Sunset Cafe", "LIVE MUSIC", "dream big",
    "FRAGILE", "Lemonade 2$", "TOKYO", "the end", "SPACE", "hot tea", "PLAY", "wild flowers", "JAZZ NIGHT",
    "be kind", "RAIN", "Ocean View", "V-GRPO", "MONDAY", "tiny robot", "GOLD", "night owl",
)


def noun(name, count=1):
    """A class name as GenEval's prompts write it: 'an apple', 'two apples'."""
    if count == 1:
        return ("an " if name[0] in "aeiou" else "a ") + name
    return f"{NUMBERS[count]} {plural(name)}"


def plural(name):
    """GenEval's plural rule, kept so that training prompts read like its evaluation prompts ('two buses', 'three
    persons', 'two sheeps'): -es after a final s, else -s."""
    return name + ("es" if name.endswith("s") else "s")


def coloured(colour, name):
    return ("an " if colour[0] in "aeiou" else "a ") + f"{colour} {name}"


def geneval_lines(rng):
    """Candidate lines per tag, drawn with rng, before the exclusion of GenEval's evaluation prompts."""
    classes, colours = list(reward.GENEVAL_CLASSES), list(reward.GENEVAL_COLORS)
    colourable = [name for name in classes if name != "person"]   # GenEval asks no colour of a person
    lines = []
    for name in classes:  # GenEval's evaluation holds all 80 "a photo of a NAME": other phrasings here
        lines += [{"tag": "single_object", "include": [{"class": name, "count": 1}],
                   "prompt": phrasing.format(noun(name))} for phrasing in SINGLE_OBJECT_PHRASINGS]
    for _ in range(PER_TAG["two_object"]):
        a, b = rng.sample(classes, 2)
        lines.append({"tag": "two_object", "include": [{"class": a, "count": 1}, {"class": b, "count": 1}],
                      "prompt": f"a photo of {noun(a)} and {noun(b)}"})
    for name, count in rng.sample([(name, count) for name in classes for count in NUMBERS], PER_TAG["counting"]):
        lines.append({"tag": "counting", "include": [{"class": name, "count": count}],
                      "exclude": [{"class": name, "count": count + 1}],
                      "prompt": f"a photo of {noun(name, count)}"})
    for _ in range(PER_TAG["colors"]):
        name, colour = rng.choice(colourable), rng.choice(colours)
        lines.append({"tag": "colors", "include": [{"class": name, "count": 1, "color": colour}],
                      "prompt": f"a photo of {coloured(colour, name)}"})
    for _ in range(PER_TAG["position"]):
        a, b = rng.sample(classes, 2)
        relation = rng.choice(RELATIONS)
        lines.append({"tag": "position", "include": [{"class": b, "count": 1},
                                                     {"class": a, "count": 1, "position": [relation, 0]}],
                      "prompt": f"a photo of {noun(a)} {relation} {noun(b)}"})
    for _ in range(PER_TAG["color_attr"]):
        a, b = rng.sample(colourable, 2)
        ca, cb = rng.sample(colours, 2)
        lines.append({"tag": "color_attr", "include": [{"class": a, "count": 1, "color": ca},
                                                       {"class": b, "count": 1, "color": cb}],
                      "prompt": f"a photo of {coloured(ca, a)} and {coloured(cb, b)}"})
    return lines


def write(directory, exclude=(), seed=0):
    rng = random.Random(seed)
    seen, kept, excluded = set(), [], set()
    for line in geneval_lines(rng):
        if line["prompt"] in exclude:
            excluded.add(line["prompt"])
        elif line["prompt"] not in seen:   # draws repeat: keep the first
            seen.add(line["prompt"])
            kept.append(line)
    with open(os.path.join(directory, "geneval_train.jsonl"), "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in kept)
    texts = [template.format(text) for template in OCR_TEMPLATES for text in OCR_TEXTS]
    random.Random(seed + 1).shuffle(texts)
    with open(os.path.join(directory, "ocr_train.txt"), "w") as f:
        f.writelines(text + "\n" for text in texts[:600])
    return kept, len(excluded)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--exclude", help="GenEval's evaluation_metadata.jsonl: its prompts are left out")
    p.add_argument("--out", default=HERE)
    a = p.parse_args()
    exclude = []
    if a.exclude:
        with open(a.exclude) as f:
            exclude = [json.loads(line)["prompt"] for line in f if line.strip()]
    kept, excluded = write(a.out, set(exclude))
    print(f"{len(kept)} GenEval-format prompts ({excluded} of the {len(exclude)} evaluation prompts were drawn "
          f"and left out) and 600 OCR prompts in {a.out}")


if __name__ == "__main__":
    main()
