"""`TrainConfig`: a whole run's config, its sections and its top-level keys. Building one checks
every value (the sections' own checks, then `train_checks`' of the sections together) and fills
in the short forms (``optimizer: adam``, ``learning_rate``, ``wandb: true``, ``init_from``'s
model sizes)."""

from __future__ import annotations

import dataclasses
import os

from replicator.cli.checks import at_least, finite_positive, where_of
from replicator.cli.config.checkpoint import checkpoint_model
from replicator.cli.config.constants import BYTE_VOCAB
from replicator.cli.config.sections import ModelConfig, PipelineConfig, ProfileConfig, WandbConfig
from replicator.cli.config.train_checks import (
    check_context_and_experts,
    check_mesh_and_counts,
    check_model_fits_the_job,
)
from replicator.cli.data import DataConfig
from replicator.cli.optimizers import DEFAULT_LEARNING_RATE, OptimizerConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    name: str = "run"
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: dict = dataclasses.field(default_factory=lambda: {"data": -1})
    cpu_devices: int = 8  # emulated when JAX has one CPU device only; 0: never emulate
    steps: int = 100
    global_batch: int = 32
    # {name, learning_rate, schedule, warmup_steps, ...} (`replicator.cli.optimizers`), or a name
    optimizer: OptimizerConfig | str = dataclasses.field(default_factory=OptimizerConfig)
    learning_rate: float | None = None  # short for optimizer.learning_rate
    clip_global_norm: float | None = 1.0
    zero_stage: int = 0
    accumulate_steps: int = 1
    pipeline: PipelineConfig | None = None  # needed when mesh has a "stage" axis
    data: DataConfig = dataclasses.field(default_factory=DataConfig)  # path: your own data
    log_every: int = 10
    checkpoint_every: int = 50
    async_checkpoints: bool = False  # write checkpoints in the background (rp.fit's)
    keep: int = 3  # checkpoints kept (rp.fit's)
    # on SIGTERM/SIGINT, save if the newest checkpoint is this many steps old; null: never
    emergency_after: int | None = 1
    # when no checkpoint is readable: move them aside (not deleted) and train from step 0
    start_over_if_unreadable: bool = False
    # on fewer processes than launched (replicator launch --min-processes): "keep" the global
    # batch (more micro-batches per step), or "shrink" it with the data axes
    elastic_batch: str = "keep"
    # a Hugging Face Llama or Mixtral directory (config.json, *.safetensors) to start from: its
    # sizes are the model's (model.kind becomes llama; a Mixtral's experts and top_k too, its
    # routing dropless and its aux_weight 0 as in transformers, unless model: sets them), its
    # weights the initial parameters. Given on the command line, it replaces the file's model
    # sizes; a size given there too, or beside init_from in the file, must agree.
    init_from: str | None = None
    out_dir: str = "runs"
    plot: bool = True
    tensorboard: bool = False  # also write the metrics to out_dir/name/tensorboard
    profile: ProfileConfig | None = None  # a jax.profiler trace in out_dir/name/profile
    wandb: WandbConfig | bool | None = None  # a W&B run (offline) in out_dir/name/wandb

    def __post_init__(self) -> None:
        where = where_of(self)
        if not self.name or self.name != os.path.basename(self.name) or self.name in (".", ".."):
            raise ValueError(
                f"{where}name={self.name!r} must be a plain directory name (the run's outputs go "
                f"to out_dir/name); use e.g. name=run1, and out_dir for the parent directory."
            )
        if not self.out_dir:
            raise ValueError(f"{where}out_dir must be a directory; got {self.out_dir!r}.")
        check_mesh_and_counts(self)
        for name in ("out_dir", "init_from"):  # ~ is the home directory, in a file too
            value = getattr(self, name)
            if isinstance(value, str) and value.startswith("~"):
                object.__setattr__(self, name, os.path.expanduser(value))
        at_least(self, "keep", 1)
        if self.init_from == "":  # empty: the same as no init_from
            object.__setattr__(self, "init_from", None)
        if self.init_from is not None:
            object.__setattr__(self, "model", checkpoint_model(self))
        m = self.model
        if m.kind == "gpt" and m.vocab < BYTE_VOCAB and self.data.path is None:
            raise ValueError(
                f"{where}model.vocab={m.vocab} is smaller than the built-in text's {BYTE_VOCAB} "
                f"byte tokens (ids 0-255); use model.vocab >= {BYTE_VOCAB}, or data.path with "
                f"data.tokenizer (or token ids) below {m.vocab}."
            )
        if self.elastic_batch not in ("keep", "shrink"):
            raise ValueError(
                f"{where}elastic_batch must be 'keep' (the global batch, in more micro-batches "
                f"per step) or 'shrink' (with the data axes); got {self.elastic_batch!r}."
            )
        if self.emergency_after is not None:
            at_least(self, "emergency_after", 1)
        if isinstance(self.optimizer, str):  # optimizer: adam, short for {name: adam}
            try:
                object.__setattr__(self, "optimizer", OptimizerConfig(name=self.optimizer))
            except ValueError as e:
                raise ValueError(
                    f"{where}optimizer{str(e).removeprefix('OptimizerConfig: ')[4:]}"
                ) from None
        if self.learning_rate is not None:  # learning_rate: 1e-3, short for the optimizer's
            finite_positive(self, "learning_rate", example="learning_rate=3e-3")
            if self.optimizer.learning_rate not in (DEFAULT_LEARNING_RATE, self.learning_rate):
                raise both_rates(where)
            object.__setattr__(
                self,
                "optimizer",
                dataclasses.replace(self.optimizer, learning_rate=float(self.learning_rate)),
            )
        if self.clip_global_norm is not None:
            finite_positive(self, "clip_global_norm", example="clip_global_norm=1.0", none=True)
        if isinstance(self.wandb, bool):  # wandb: true, short for wandb: {} (offline)
            object.__setattr__(self, "wandb", WandbConfig() if self.wandb else None)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"{where}zero_stage must be 0, 1, 2 or 3; got {self.zero_stage!r}.")
        check_model_fits_the_job(self)
        check_context_and_experts(self)


def both_rates(where: str) -> ValueError:
    return ValueError(
        f"{where}learning_rate and optimizer.learning_rate are both set; set one of them (the "
        f"top-level learning_rate is short for optimizer.learning_rate), e.g. "
        f"optimizer: {{name: adam, learning_rate: 3e-3}}."
    )
