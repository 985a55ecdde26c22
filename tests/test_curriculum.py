"""The curriculum as one launch: --curriculum sd3 resolves to the paper's five stages, and a curriculum runs its
stages in order (reward, prompts and settings switching at the right iterations), carries the weights across them,
logs the stage and resumes inside the right one exactly as an uninterrupted run."""

import json
import os
import re
import subprocess
import sys
import types

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from safetensors.torch import load_file

import vgrpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
SMALL = ["--model", "tiny", "--sample-steps", "4", "--prompts-per-step", "2", "--group-size", "4", "--micro-batch", "4",
         "--lr", "3e-3", "--no-full-finetune", "--sample-every", "100"]

REWARDS = '''
import os
import signal


def brightness(images, prompts):
    return images.mean((1, 2, 3))


def darkness(images, prompts):
    if os.environ.pop("SIGTERM_ME", None):   # preempted in the first iteration of stage 3, whatever the machine's speed
        os.kill(os.getpid(), signal.SIGTERM)
    return -images.mean((1, 2, 3))
'''


def test_the_sd3_curriculum_is_the_papers_five_stages():
    args = vgrpo.parse_args(["--curriculum", "sd3"])
    assert (args.model, args.iterations) == ("sd3", 580)
    stages = vgrpo.curriculum_stages(args)
    assert [(name, start, end) for name, start, end, _ in stages] == [
        ("sd3-preference", 0, 150), ("sd3-geneval", 150, 350), ("sd3-preference", 350, 500),
        ("sd3-geneval", 500, 550), ("sd3-ocr", 550, 580)]
    settings = [(a.reward, os.path.basename(a.prompts), a.n_mc, a.adv_soft_clip, a.beta) for *_, a in stages]
    preference = ("pickscore:1,hpsv2:1,clipscore:1", "train.txt", 4, 3.0, 0.0)   # SD3's recipe: N_MC 4, soft clip 3
    geneval = ("geneval_partial", "geneval_train.jsonl", 10, 0.0, 0.0)             # ~10 pairs, no soft clip
    assert settings == [preference, geneval, preference, geneval, ("ocr", "ocr_train.txt", 10, 0.0, 0.3)]
    for *_, a in stages:   # everything else is the run's: the model's recipe
        assert (a.model, a.group_size, a.prompts_per_step, a.iterations, a.lora_rank) == ("sd3", 24, 48, 580, 32)
        assert os.path.isfile(a.prompts)   # the shipped prompt files
    other = vgrpo.parse_args(["--curriculum", "sd3", "--stage-prompts", "sd3-geneval=mine.jsonl"])
    assert [os.path.basename(a.prompts) for *_, a in vgrpo.curriculum_stages(other)] == [
        "train.txt", "mine.jsonl", "train.txt", "mine.jsonl", "ocr_train.txt"]
    # the printed configuration reproduces itself (it leaves out what the stages set)
    import shlex
    assert vgrpo.parse_args(shlex.split(vgrpo.command_line(args))) == args


@pytest.mark.parametrize("argv,message", [
    (["--curriculum", "sd3", "--reward", "jpeg"], "--curriculum sd3 sets --reward stage by stage"),
    (["--curriculum", "sd3", "--iterations=10"], "sets --iterations stage by stage"),
    (["--curriculum", "sd4"], "unknown --curriculum 'sd4': use sd3 or a .json file"),
])
def test_curriculum_flags_that_cannot_work_are_one_line(argv, message):
    with pytest.raises(vgrpo.UsageError, match=message):
        vgrpo.parse_args(argv)


def test_bad_curriculum_files_and_stage_prompts_are_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    for content, message in (("[]", "stage 1: expected"), ('[{"iterations": 0}]', "stage 1: expected"),
                             ('[{"iterations": 2, "lr": 1}]', "stage 1: expected"), ("{", "not JSON"),
                             ('[{"iterations": 2, "preset": "sd9"}]', "stage 1: expected")):
        bad.write_text(content)
        with pytest.raises(vgrpo.UsageError, match=message):
            vgrpo.parse_args(["--curriculum", str(bad)])
    args = vgrpo.parse_args(["--curriculum", "sd3", "--stage-prompts", "sd3-nothing=a.txt",
                             "--output-dir", str(tmp_path / "out")])
    with pytest.raises(vgrpo.UsageError, match="--stage-prompts 'sd3-nothing=a.txt': expected PRESET=FILE"):
        vgrpo.validate(args, 8)
    args = vgrpo.parse_args(["--curriculum", "sd3", "--stage-prompts", "sd3-ocr=missing.txt",
                             "--output-dir", str(tmp_path / "out")])
    with pytest.raises(vgrpo.UsageError, match=r"prompt file not found: missing.txt \(stage sd3-ocr\)"):
        vgrpo.validate(args, 8)
    with pytest.raises(vgrpo.UsageError, match="^--stage-prompts replaces .* give --curriculum$"):
        vgrpo.validate(vgrpo.parse_args(["--stage-prompts", "sd3-ocr=a.txt", "--output-dir", str(tmp_path)]), 1)


def write_curriculum(tmp_path):
    rewards = tmp_path / "rw.py"
    rewards.write_text(REWARDS)
    stages = [{"iterations": 2, "reward": "jpeg:100"},
              {"iterations": 2, "reward": f"{rewards}:brightness", "n_mc": 2},
              {"iterations": 3, "reward": f"jpeg:100,{rewards}:darkness", "n_mc": 3, "adv_soft_clip": 1.0}]
    path = tmp_path / "curriculum.json"
    path.write_text(json.dumps(stages))
    return path


def launch(*args, env=None):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "vgrpo.py"), *map(str, args)], env=env or ENV,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read(path):
    return [json.loads(line) for line in open(path) if line.strip()] if os.path.exists(path) else []


@pytest.mark.slow
def test_a_curriculum_switches_stages_and_resumes_inside_the_right_one_exactly(tmp_path):
    """Three stages on the tiny model, 7 iterations: each stage's reward and N_MC at its own iterations, the weights
    carried over; a run stopped by SIGTERM in stage 3 and continued with --resume auto ends with the same weights,
    bit for bit, as the uninterrupted one."""
    curriculum = write_curriculum(tmp_path)
    command = [*SMALL, "--curriculum", curriculum, "--save-every", "1"]
    full = launch(*command, "--output-dir", tmp_path / "full")
    out, err = full.communicate(timeout=600)
    assert full.returncode == 0, err[-3000:]
    m = read(tmp_path / "full" / "metrics.jsonl")
    assert [x["stage"] for x in m] == [1, 1, 2, 2, 3, 3, 3]
    assert [x["iteration"] for x in m] == list(range(1, 8))
    # stage 1's reward is jpeg alone, stage 2's brightness alone (in [0, 1]), stage 3 logs its two parts
    assert all(x["reward_mean"] < 0 for x in m[:2]) and all(0 < x["reward_mean"] < 1 for x in m[2:4])
    assert all("reward_darkness" in x and "reward_jpeg" in x for x in m[4:]) and "reward_jpeg" not in m[0]
    assert all(x["adv_abs_max"] <= 1.0 for x in m[4:]) and any(x["adv_abs_max"] > 1.0 for x in m[:4])  # soft clip
    for number, start in ((1, 1), (2, 3), (3, 5)):
        assert f"vgrpo: stage {number}/3 " in out and f"iterations {start}.." in out
    assert "N_MC 2" in out and "N_MC 3, soft clip 1" in out

    part = tmp_path / "part"   # SIGTERM in iteration 5, stage 3's first, from its reward (a poll could miss stage 3)
    proc = launch(*command, "--output-dir", part, env={**ENV, "SIGTERM_ME": "1"})
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    stopped = len(read(part / "metrics.jsonl"))
    assert stopped == 5 and "stopped after iteration 5" in out        # stopped inside stage 3
    rest = launch(*command, "--output-dir", part, "--resume", "auto")
    out, err = rest.communicate(timeout=600)
    assert rest.returncode == 0, err[-3000:]
    assert f"resumed from {part / f'checkpoint-{stopped}'}" in out and "vgrpo: stage 3/3" in out
    assert "stage 1/3" not in out                                     # it went straight to the right stage
    assert [x["stage"] for x in read(part / "metrics.jsonl")] == [1, 1, 2, 2, 3, 3, 3]
    name = "pytorch_lora_weights.safetensors"
    a, b = (load_file(os.path.join(d, "checkpoint-7", name)) for d in (tmp_path / "full", part))
    start = load_file(tmp_path / "full" / "checkpoint-1" / name)
    assert any(not torch.equal(a[k], start[k]) for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [x["reward_mean"] for x in read(part / "metrics.jsonl")] == [x["reward_mean"] for x in m]


def test_a_curriculum_file_read_from_another_folder_uses_the_projects_prompt_files(tmp_path, monkeypatch):
    """A first stage whose preset has a length of its own (sd3-ocr's 30: the file's count wins), a stage without a
    preset (its own flags, the model's recipe under them), each one iteration or two; the presets' prompt files are
    the project's wherever vgrpo is launched from."""
    (tmp_path / "c.json").write_text(json.dumps([{"iterations": 1, "preset": "sd3-ocr"},
                                                 {"iterations": 2, "reward": "jpeg", "n_mc": 3}]))
    monkeypatch.chdir(tmp_path)
    args = vgrpo.parse_args(["--curriculum", "c.json"])
    assert (args.model, args.iterations, args.reward) == ("sd3", 3, "ocr")
    stages = vgrpo.curriculum_stages(args)
    assert [(name, start, end) for name, start, end, _ in stages] == [("sd3-ocr", 0, 1), ("stage-2", 1, 3)]
    ocr, own = stages[0][3], stages[1][3]
    # paths relative to where vgrpo runs (nodes with the project elsewhere agree on them), reaching the project's
    assert not os.path.isabs(ocr.prompts) and not os.path.isabs(own.prompts)
    assert os.path.samefile(ocr.prompts, os.path.join(ROOT, "prompts", "ocr_train.txt"))
    assert os.path.samefile(own.prompts, os.path.join(ROOT, "prompts", "train.txt"))
    assert (ocr.reward, ocr.n_mc, ocr.adv_soft_clip, ocr.beta, ocr.iterations) == ("ocr", 10, 0.0, 0.3, 3)
    assert (own.reward, own.n_mc, own.adv_soft_clip, own.beta, own.iterations) == ("jpeg", 3, 3.0, 0.0, 3)


def test_a_curriculum_is_a_name_or_an_existing_json_file_and_a_bad_stage_names_what_a_stage_holds(tmp_path):
    text = tmp_path / "stages.txt"
    text.write_text('[{"iterations": 1}]')
    for name in (str(tmp_path / "missing.json"), str(text)):
        with pytest.raises(vgrpo.UsageError, match=rf"^unknown --curriculum '{re.escape(name)}': use sd3 or a \.json "
                                                   r"file of stages$"):
            vgrpo.load_curriculum(name)
    one = tmp_path / "one.json"
    one.write_text('[{"iterations": 1}]')
    assert vgrpo.load_curriculum(str(one)) == [{"iterations": 1}]
    for content, stage in (("[3]", 1), ('[{"iterations": 1}, {"iterations": "2"}]', 2)):
        one.write_text(content)
        with pytest.raises(vgrpo.UsageError, match=rf'^--curriculum \S+, stage {stage}: expected \{{"iterations": '
                                                   r'N >= 1, "preset": one of sd3-preference, sd3-geneval, sd3-ocr, '
                                                   r'flux-preference, or any of reward, prompts, n_mc, adv_soft_clip, '
                                                   r'beta\}$'):
            vgrpo.load_curriculum(str(one))


def test_each_stage_becomes_the_runs_at_its_first_iteration_and_rank_0_says_so(capsys):
    stages = [vgrpo.Stage(name, start, end, args, reward_fn=f"{name} reward", prompts=[name],
                          metadata=[{"stage": name}])
              for name, start, end, args in vgrpo.curriculum_stages(vgrpo.parse_args(["--curriculum", "sd3"]))]
    for rank in (0, 1):
        run = types.SimpleNamespace(stages=stages, args=None, reward_fn=None, prompts=None, metadata=None, rank=rank)
        used = []
        for it in (0, 149, 150, 349, 350, 549, 550, 579):
            vgrpo.use_stage(run, it)
            used.append(stages.index(next(s for s in stages if s.args is run.args)))
            name = stages[used[-1]].name
            assert (run.reward_fn, run.prompts, run.metadata) == (f"{name} reward", [name], [{"stage": name}])
        assert used == [0, 0, 1, 1, 2, 3, 4, 4]
        lines = capsys.readouterr().out.splitlines()
        assert lines == ([] if rank else [
            f"vgrpo: stage {k + 1}/5 {s.name}, iterations {s.start + 1}..{s.end}: reward {s.args.reward}, prompts "
            f"{s.args.prompts}, N_MC {s.args.n_mc}, soft clip {s.args.adv_soft_clip:g}, beta {s.args.beta:g}"
            for k, s in enumerate(stages)])
        if rank == 0:
            assert lines[1].startswith("vgrpo: stage 2/5 sd3-geneval, iterations 151..350: reward geneval_partial, "
                                       "prompts ") and lines[1].endswith("geneval_train.jsonl, N_MC 10, soft clip 0, "
                                                                         "beta 0")


def test_stage_prompts_name_unnamed_stages_by_number_and_split_each_item_at_its_first_equals_sign(tmp_path,
                                                                                                   monkeypatch):
    """--stage-prompts PRESET=FILE,...: a stage without a preset is stage-N (counted from 1), several items are
    comma-separated, and a file's path may itself hold '=' (a folder named lr=1e-4)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.json").write_text(json.dumps([{"iterations": 1, "preset": "sd3-ocr"},
                                                 {"iterations": 1, "reward": "jpeg"}]))
    (tmp_path / "lr=1e-4").mkdir()
    (tmp_path / "lr=1e-4" / "p.txt").write_text("a red apple\n")
    (tmp_path / "q.txt").write_text('a sign that says "open"\n')
    args = vgrpo.parse_args(["--curriculum", "c.json", "--stage-prompts", "stage-2=lr=1e-4/p.txt,sd3-ocr=q.txt",
                             "--output-dir", "out"])
    vgrpo.validate(args, 1)
    assert [a.prompts for *_, a in vgrpo.curriculum_stages(args)] == ["q.txt", "lr=1e-4/p.txt"]
    # stage 1 is named by its preset; there is no third (after a good item, the bad one is named)
    for given, item in (("stage-1=q.txt", "stage-1=q.txt"), ("sd3-ocr=q.txt,stage-3=q.txt", "stage-3=q.txt")):
        args = vgrpo.parse_args(["--curriculum", "c.json", "--stage-prompts", given, "--output-dir", "out"])
        with pytest.raises(vgrpo.UsageError, match=rf"^--stage-prompts '{item}': expected PRESET=FILE with PRESET one "
                                                   r"of the stages sd3-ocr, stage-2$"):
            vgrpo.validate(args, 1)
