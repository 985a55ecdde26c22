"""What bench/smoke.py, bench/memory.py and bench/gpu.py share about their result files: each is written whole, and
the runs of one GPU session are read back together to be merged into one report (their --merge)."""
import json
import os


def write_whole(path, text):
    """path's new text, or (killed while writing: bench/device.sh's timeout) its previous one, never half of each."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".partial", "w") as f:
        f.write(text)
    os.replace(path + ".partial", path)


def read_runs(paths, same, script):
    """The JSON of several runs, in the order given; SystemExit when they differ in one of the keys `same` (the
    device, torch, ...): runs on different machines or stacks are not one measurement."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    where = {tuple(run[key] for key in same) for run in runs}
    if len(where) > 1:
        raise SystemExit(f"bench/{script} --merge: the runs differ in {', '.join(same)}: {sorted(where)}")
    return runs
