#!/usr/bin/python3
# Training curves from runs' metrics.jsonl, side by side: train loss, the evaluation
# metric (accuracy or perplexity), the learning rate and throughput against step, one line
# per run, labelled by its run directory's name.
#   scripts/plot.py RUN_DIR [RUN_DIR...] [-o curves.png] [--title TITLE]
# Needs Debian's python3-matplotlib (scripts/setup.sh --test installs it); /usr/bin/python3
# is named so that a virtual environment first on PATH does not hide it.
import argparse
import json
import os
import sys


def fail(message):
    print(f"plot: {message}", file=sys.stderr)
    sys.exit(2)


def read_run(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        fail(f"'{path}' does not exist (is '{run_dir}' a dtrain run directory?)")
    lines = []
    # Bytes that are not UTF-8 are damage to name, not a traceback.
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            numbered = list(enumerate(f, 1))
        except UnicodeDecodeError as e:
            fail(f"{path}: not UTF-8 text (byte {e.start} of a line: {e.reason})")
    for number, text in numbered:
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as e:
            # A run cut short may end in a partial line; anywhere else it is damage.
            if number == 1 or text.endswith("\n"):
                fail(f"{path}:{number}: not JSON ({e.msg})")
            continue
        if not isinstance(line, dict):
            fail(f"{path}:{number}: not a JSON object")
        step = line.get("step")
        if line.get("kind") in ("train", "eval") and (isinstance(step, bool) or
                                                      not isinstance(step, int)):
            fail(f"{path}:{number}: a {line['kind']} line without an integer step")
        for key in ("loss", "lr", "samples_per_s", "tokens_per_s", "accuracy", "perplexity"):
            if key in line and line[key] is not None and (isinstance(line[key], bool) or
                                                          not isinstance(line[key], (int, float))):
                fail(f"{path}:{number}: {key} is not a number")
        lines.append(line)
    train = [l for l in lines if l.get("kind") == "train"]
    if not train:
        fail(f"{path}: no train lines")
    # dtrain keeps one timeline (a rollback's abandoned lines move aside); a log edited by
    # hand may still repeat a step: the last line written for it counts.
    by_step = {l["step"]: l for l in train}
    evals = {l["step"]: l for l in lines if l.get("kind") == "eval"}
    branches = sorted(l["step"] for l in lines if l.get("kind") == "branch"
                      and isinstance(l.get("step"), int) and not isinstance(l.get("step"), bool))
    return [by_step[s] for s in sorted(by_step)], [evals[s] for s in sorted(evals)], branches


def values(lines, key):
    # A non-finite figure is logged as null: a gap in the curve.
    return [float("nan") if l.get(key) is None else l[key] for l in lines]


def eval_metric(evals):
    # The figure each eval line carries besides its loss: the task's metric.
    for key in ("accuracy", "perplexity"):
        if evals and key in evals[0]:
            return key
    return "loss"


def main():
    parser = argparse.ArgumentParser(description="Plot dtrain runs' training curves.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("-o", "--output", default="curves.png")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    try:
        import matplotlib
    except ImportError:
        fail("matplotlib is missing: apt-get install python3-matplotlib")
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    runs = [(os.path.basename(os.path.normpath(r)), *read_run(r)) for r in args.runs]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    (loss_ax, eval_ax), (lr_ax, speed_ax) = axes
    for name, train, evals, branches in runs:
        steps = [l["step"] for l in train]
        loss_ax.plot(steps, values(train, "loss"), label=name)
        for at in branches:  # where a resume from an older checkpoint began a new branch
            loss_ax.axvline(at, color=loss_ax.lines[-1].get_color(), linestyle=":", linewidth=1)
        lr_ax.plot(steps, values(train, "lr"), label=name)
        speed = "tokens_per_s" if "tokens_per_s" in train[0] else "samples_per_s"
        speed_ax.plot(steps, values(train, speed), label=f"{name} ({speed.replace('_per_s', '')}/s)")
        metric = eval_metric(evals)
        if evals:
            eval_ax.plot([l["step"] for l in evals], values(evals, metric), marker="o",
                         markersize=3, label=f"{name} ({metric})")
    loss_ax.set_title("train loss")
    loss_ax.set_yscale("log")
    eval_ax.set_title("evaluation")
    lr_ax.set_title("learning rate")
    speed_ax.set_title("throughput per second")
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    try:
        fig.savefig(args.output, dpi=100)
    except OSError as e:
        fail(f"cannot write '{args.output}': {e.strerror}")
    print(f"plot: {args.output} ({len(runs)} run(s))")


if __name__ == "__main__":
    main()
