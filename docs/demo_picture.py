"""The README's picture of the CPU demo: a run's held-out grid before training and after it, side by side.

    rm -rf runs/demo && python vgrpo.py --output-dir runs/demo && python docs/demo_picture.py runs/demo docs/demo.png

Reads RUN/samples/eval-00000.png and the last evaluation's grid (save_sample_grid's layout: one row per prompt,
a caption above and a reward below every image) and RUN/eval.jsonl (the accuracies in the heading). Each image is
kept pixel for pixel, shrunk from the grid's 8x enlargement to 4x by dropping every other row and column, so the
digits stay as sharp as the run drew them.
"""

import argparse
import glob
import json
import os

from PIL import Image, ImageDraw

CAPTION, FOOTER = 14, 12   # save_sample_grid's text strips above and below each row of images
LABEL, GAP, HEADING, SPACE = 56, 24, 26, 6   # the new picture's margins, in pixels


def grid_cells(path, columns):
    """A save_sample_grid PNG -> [[cell image, ...] per row]: `columns` square cells a row."""
    grid = Image.open(path).convert("L")
    side = grid.width // columns
    rows = grid.height // (CAPTION + side + FOOTER)
    return [[grid.crop((m * side, top, (m + 1) * side, top + side)) for m in range(columns)]
            for top in (g * (CAPTION + side + FOOTER) + CAPTION for g in range(rows))]


def accuracy_line(evaluation, key="eval_digit_correct"):
    judged = [f"{name}: {evaluation[k]:.2f}" for name, k in (("CNN", key), ("k-NN", "eval_digit_knn"))
              if k in evaluation]
    return f"after {evaluation['iteration']} iterations" + (f" ({', '.join(judged)})" if judged else "")


def compose(run, out, cell=64):
    """Write the side-by-side picture of `run` to `out`: each image `cell` pixels square, SPACE pixels apart."""
    with open(os.path.join(run, "config.json")) as f:
        columns = min(json.load(f).get("eval_images", 8), 8)
    grids = sorted(glob.glob(os.path.join(run, "samples", "eval-*.png")))
    if len(grids) < 2:
        raise SystemExit(f"{run}: needs at least two evaluation grids in samples/ (run with --eval-every)")
    with open(os.path.join(run, "eval.jsonl")) as f:
        evaluations = {m["iteration"]: m for m in map(json.loads, filter(str.strip, f))}
    first, last = grids[0], grids[-1]
    before, after = grid_cells(first, columns), grid_cells(last, columns)
    labels = row_labels(run, len(before))
    step, half_width = cell + SPACE, columns * (cell + SPACE)
    picture = Image.new("L", (LABEL + 2 * half_width + GAP, HEADING + len(before) * step), 255)
    draw = ImageDraw.Draw(picture)
    iteration = lambda path: int(os.path.basename(path)[5:10])  # noqa: E731
    titles = [accuracy_line(evaluations[iteration(first)]).replace("after 0 iterations", "before training"),
              accuracy_line(evaluations[iteration(last)])]
    for half, title in enumerate(titles):
        draw.text((LABEL + half * (half_width + GAP), 8), title, fill=0)
    for g, (old, new) in enumerate(zip(before, after)):
        top = HEADING + g * step
        draw.text((2, top + cell // 2 - 6), labels[g], fill=0)
        for half, cells in enumerate((old, new)):
            for m, image in enumerate(cells):
                picture.paste(image.resize((cell, cell), Image.NEAREST),
                              (LABEL + half * (half_width + GAP) + m * step, top))
    picture.save(out, optimize=True)
    return out


def row_labels(run, rows):
    """The prompt of each pictured row: the run's held-out prompts, in order (the grids show the first ones)."""
    with open(os.path.join(run, "config.json")) as f:
        path = json.load(f).get("eval_prompts", "")
    if not path or not os.path.isfile(path):
        return [""] * rows
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    prompts = [json.loads(line)["prompt"] if path.endswith(".jsonl") else line.strip() for line in lines]
    return [p.removeprefix("the digit ") for p in prompts[:rows]] + [""] * (rows - len(prompts))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run's --output-dir, evaluated at least twice")
    parser.add_argument("out", help="the PNG to write")
    print(compose(**vars(parser.parse_args())))
