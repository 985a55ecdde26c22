"""What a newcomer reads first: the README's size and picture, and docs/demo_picture.py, which makes that picture from
a run (its grids written here by vgrpo's own save_sample_grid, the output read back image by image)."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import torch
from PIL import Image

import vgrpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_readme_is_at_most_12_kb_and_shows_the_demo_picture_before_the_set_up():
    with open(os.path.join(ROOT, "README.md"), "rb") as f:
        text = f.read()
    assert len(text) <= 12_000, f"README.md is {len(text)} bytes"
    text = text.decode()
    picture = re.search(r"!\[[^\]]*\]\(([^)]+\.png)\)", text)
    assert picture and os.path.isfile(os.path.join(ROOT, picture.group(1)))
    assert picture.start() < text.index("## Set up")


def slug(heading):
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped but hyphens, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_of_the_readme_and_the_docs_names_a_file_and_heading_that_exist():
    for page in ("README.md", "docs/guide.md", "docs/method.md", "bench/README.md"):
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        for target, anchor in re.findall(r"\]\(([^)#:\s]*)(?:#([^)\s]*))?\)", text):
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target)) if target else \
                os.path.join(ROOT, page)
            assert os.path.exists(path), f"{page}: {target}"
            if anchor and path.endswith(".md"):
                with open(path) as f:
                    headings = {slug(line.lstrip("#")) for line in f if line.startswith("#")}
                assert anchor in headings, f"{page}: {target}#{anchor}"


def test_demo_picture_puts_the_first_and_last_held_out_grids_side_by_side(tmp_path):
    run, prompts = tmp_path / "run", tmp_path / "eval.jsonl"
    (run / "samples").mkdir(parents=True)
    names = ["zero", "one", "two"]
    prompts.write_text("".join(json.dumps({"prompt": f"the digit {n}", "tag": n}) + "\n" for n in names))
    (run / "config.json").write_text(json.dumps({"eval_images": 4, "eval_prompts": str(prompts)}))
    (run / "eval.jsonl").write_text("".join(json.dumps({"iteration": it, "eval_digit_correct": acc,
                                                        "eval_digit_knn": acc + 0.1}) + "\n"
                                            for it, acc in ((0, 0.25), (20, 0.5), (40, 0.75))))
    g = torch.Generator().manual_seed(0)
    grids = {it: torch.rand(12, 1, 16, 16, generator=g).expand(12, 3, 16, 16) for it in (0, 20, 40)}
    for it, images in grids.items():
        vgrpo.save_sample_grid(str(run / "samples" / f"eval-{it:05d}.png"), images,
                               [f"the digit {n}" for n in names for _ in range(4)], torch.ones(12), 4, max_groups=10)
    out = tmp_path / "demo.png"
    subprocess.run([sys.executable, os.path.join(ROOT, "docs", "demo_picture.py"), str(run), str(out)], check=True,
                   capture_output=True)
    picture = Image.open(out)
    cell, space, label, gap, heading = 64, 6, 56, 24, 26                # the script's layout
    assert picture.size == (label + 2 * 4 * (cell + space) + gap, heading + 3 * (cell + space))
    for half, it in enumerate((0, 40)):                                 # the first grid and the last, not the middle
        for k in range(12):
            row, member = divmod(k, 4)
            x, y = label + half * (4 * (cell + space) + gap) + member * (cell + space), heading + row * (cell + space)
            expected = vgrpo.rewards_lib.to_uint8_images(grids[it][k:k + 1])[0].convert("L")
            assert np.array_equal(np.asarray(picture.crop((x, y, x + cell, y + cell))),
                                  np.asarray(expected.resize((cell, cell), Image.NEAREST)))


def test_every_tag_of_a_per_tag_panel_has_its_own_line_and_the_mean_is_thick_and_black():
    """rewards.png's per-tag panel: matplotlib's default cycle repeats after ten colours, so the ten digits and their
    mean shared colours; each tag now gets its own (colour, line style), up to 40 tags, and the mean stands apart."""
    keys = [f"eval_digit_correct/tag{j}" for j in range(25)] + ["eval_digit_correct/mean_of_tags"]
    styles = vgrpo.tag_line_styles(keys)
    tags = [styles[k] for k in keys[:-1]]
    assert len({(s["color"], s["ls"]) for s in tags}) == 25
    assert len({s["color"] for s in tags[:10]}) == 10                    # the first ten: ten colours, all solid
    mean = styles["eval_digit_correct/mean_of_tags"]
    assert mean["color"] == "black" and mean["lw"] > 2 * max(s["lw"] for s in tags)
    assert "black" not in {s["color"] for s in tags}


def test_the_per_tag_panel_draws_each_tag_in_its_style(tmp_path):
    """The demo's ten digits and their mean through write_curves: the drawn lines carry tag_line_styles' styles."""
    import matplotlib.pyplot as plt

    digits = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    with open(tmp_path / "eval.jsonl", "w") as f:
        for it in (0, 20, 40):
            f.write(json.dumps({"iteration": it, **{f"eval_digit_correct/{d}": (j + it) / 60 for j, d in
                                                    enumerate(digits)}, "eval_digit_correct/mean_of_tags": 0.5}) + "\n")
    drawn = []
    real_plot = plt.Axes.plot

    def recording(ax, *args, **kwargs):
        drawn.append(kwargs)
        return real_plot(ax, *args, **kwargs)

    plt.Axes.plot = recording
    try:
        assert vgrpo.write_curves(str(tmp_path)) == str(tmp_path / "rewards.png")
    finally:
        plt.Axes.plot = real_plot
    lines = {d["label"]: (d["color"], d["ls"], d["lw"]) for d in drawn if "label" in d}
    assert len(lines) == 11 and len(set(lines.values())) == 11
    assert lines["mean_of_tags"][0] == "black" and list(lines)[-1] == "mean_of_tags"


def test_a_drawing_that_fails_leaves_the_csv_and_one_line_not_a_stopped_run(tmp_path, monkeypatch, capsys):
    """write_curves runs after every evaluation of a long run: a matplotlib failure must cost the picture only."""
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for it in (1, 2):
            f.write(json.dumps({"iteration": it, "reward_mean": it / 10, "loss": 0.1}) + "\n")

    def broken(*args):
        raise ValueError("no such font")

    monkeypatch.setattr(vgrpo, "plot_curves", broken)
    assert vgrpo.write_curves(str(tmp_path)) is None
    assert capsys.readouterr().err == "vgrpo: could not draw rewards.png (ValueError: no such font)\n"
    assert (tmp_path / "rewards.csv").read_text().splitlines() == ["iteration,reward_mean", "1,0.1", "2,0.2"]
    assert not (tmp_path / "rewards.png").exists()


def test_a_run_without_reward_columns_draws_no_picture(tmp_path):
    import matplotlib.pyplot as plt

    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"iteration": 1, "reward_std": 0.0, "loss": 0.1}) + "\n")   # std alone is no curve
    assert vgrpo.plot_curves(plt, {1: {"reward_std": 0.0}}, ["reward_std"], str(tmp_path / "rewards.png")) is None
    assert vgrpo.write_curves(str(tmp_path)) is None and not (tmp_path / "rewards.png").exists()


def test_ci_runs_the_readmes_test_command():
    """.ci/run installs and tests as the README's second set-up command does, step for step (pip's -q aside; CI
    adds HF_HUB_OFFLINE=1 and skips the CPU torch on a machine with CUDA): a change to one that misses the other
    fails here."""
    with open(os.path.join(ROOT, "README.md")) as f:
        block = f.read().split("# 2. install and run the tests", 1)[1].split("```", 1)[0]
    readme = [" ".join(step.split()) for step in block.split("\n", 1)[1].replace("\\\n", " ").split("&&")]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        lines = [" ".join(line.split()) for line in f]
    ci = [line.replace("python -m pip install -q ", "pip install ") for line in lines
          if line.startswith(("python3 -m venv", ". .venv/", "python -m pip install", "python -m pytest"))]
    assert readme == ci and len(ci) == 6, (readme, ci)
    assert "export HF_HUB_OFFLINE=1" in lines
