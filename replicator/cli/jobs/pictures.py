"""The pictures of a run in ``out_dir/name``: the loss curve (``loss.png``) and a pipeline's
schedule (``schedule.txt``, ``schedule.png``)."""

from __future__ import annotations

import json
import os
import sys

import replicator as rp
from replicator.cli.config import TrainConfig
from replicator.cli.jobs.gpt_job import pipeline_schedule


def draw_schedule(config: TrainConfig, num_stages: int, out: str) -> None:
    """The pipeline schedule as ``schedule.txt`` (ASCII) and, with ``plot``, ``schedule.png``."""
    args = (pipeline_schedule(config), num_stages, config.pipeline.microbatches)
    png = os.path.join(out, "schedule.png") if config.plot else None
    try:
        picture = rp.pipeline.render(*args, path=png)
    except ImportError:
        print('replicator train: no schedule.png (pip install "replicator[plot]")', file=sys.stderr)
        picture = rp.pipeline.render(*args)
    with open(os.path.join(out, "schedule.txt"), "w") as f:
        f.write(picture + "\n")


def logged_losses(metrics_path: str) -> list[tuple[int, float]]:
    """``(step, loss)`` of each training line of the run's JSONL file, every run of it (a
    resumed run continues the file, each step once)."""
    losses = []
    with open(metrics_path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by a kill
                continue
            if isinstance(record, dict) and "loss" in record:
                losses.append((record["step"], record["loss"]))
    return losses


def plot_loss(metrics_path: str, path: str, config: TrainConfig) -> None:
    """The loss curve of the whole run (`logged_losses`), from its first logged step, as
    ``path``; a point per logged step where there are few."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('replicator train: no loss plot (pip install "replicator[plot]")', file=sys.stderr)
        return
    losses = logged_losses(metrics_path)
    steps, values = zip(*losses)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, values, marker="o" if len(losses) <= 50 else None, markersize=3)
    ax.set_xlim(steps[0], max(steps[-1], steps[0] + 1))
    ax.set(xlabel="step", ylabel="loss", title=f"{config.name}: {config.model.kind}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
