"""The pictures of a run in ``out_dir/name``: the loss curve (``loss.png``) and a pipeline's
schedule (``schedule.txt``, ``schedule.png``)."""

from __future__ import annotations

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


def plot_loss(losses, path: str, config: TrainConfig) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('replicator train: no loss plot (pip install "replicator[plot]")', file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(*zip(*losses))
    ax.set(xlabel="step", ylabel="loss", title=f"{config.name}: {config.model.kind}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
