"""`TrainConfig`: a whole run's config, its sections and its top-level keys, frozen and checked.

Building one checks every value (the sections' own checks, then `train_checks`' of the sections
together) and changes none: a config file's short forms (``optimizer: adam``,
``learning_rate``, ``wandb: true``, ``kind: llama``, ``~``, ``init_from``'s model sizes) are
turned into their long forms before it is built, as plain data (`short_forms`, which
`replicator.cli.config.load` and ``from_dict`` apply).

>>> TrainConfig(optimizer="adam")
Traceback (most recent call last):
...
ValueError: TrainConfig: optimizer='adam' is a config file's short form of optimizer: {name: adam}; give optimizer=OptimizerConfig(name='adam'), or read the config with replicator.cli.config.from_dict, which takes the short forms.
"""

from __future__ import annotations

import dataclasses
import os

from replicator.cli.checks import at_least, finite_positive, where_of
from replicator.cli.config.constants import BYTE_VOCAB
from replicator.cli.config.sections import ModelConfig, PipelineConfig, ProfileConfig, WandbConfig
from replicator.cli.config.train_checks import (
    check_context_and_experts,
    check_local_steps,
    check_mesh_and_counts,
    check_model_fits_the_job,
    check_zero_axes,
)
from replicator.cli.data import DataConfig
from replicator.cli.optimizers import OptimizerConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    name: str = "run"
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: dict = dataclasses.field(default_factory=lambda: {"data": -1})
    cpu_devices: int = 8  # emulated when JAX has one CPU device only; 0: never emulate
    steps: int = 100
    global_batch: int = 32
    # {name, learning_rate, schedule, warmup_steps, ...} (`replicator.cli.optimizers`); in a
    # file, a name alone (optimizer: adam) and a top-level learning_rate are short forms
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    clip_global_norm: float | None = 1.0
    zero_stage: int = 0
    # hybrid ZeRO: the replica axes ZeRO splits over, e.g. [data] with mesh.dcn_data: split
    # inside each slice, whole on every one (FSDP's HYBRID_SHARD); null: every replica axis
    zero_axes: list | None = None
    accumulate_steps: int = 1
    # local SGD / DiLoCo: each index of mesh.dcn_data (a slice) takes this many steps on its
    # own, its gradients reduced inside it; then the slices average their moves, the one
    # exchange across them, and an outer SGD step with Nesterov momentum takes the mean. A step
    # is all of them: each replica's share of global_batch is split into local_steps inner
    # batches; the optimizer's schedule (warmup_steps, decay_steps) counts inner steps, and
    # spans steps x local_steps of them. null: synchronous (every step's gradients cross).
    local_steps: int | None = None
    outer_learning_rate: float = 0.7  # DiLoCo's outer step (its paper's values)
    outer_momentum: float = 0.9
    # gpt: kept in the host's memory between steps (MaxText's parameter_memory_host_offload
    # and optimizer_memory_host_offload): the parameters, brought to the device a layer at a
    # time, and the optimizer state, for its update; HBM freed for activations, for a trip over
    # the host link each step (`replicator explain --target` prices it). Not with a pipeline.
    offload_params: bool = False
    offload_optimizer: bool = False
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
    # a Hugging Face checkpoint directory (config.json, *.safetensors) of a family of
    # replicator.models.families (Llama, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Mistral, Gemma 2,
    # Gemma 3) to start from: its sizes are the model's (model.family becomes its family; a Mixtral's experts and
    # top_k too, its routing dropless and its aux_weight 0 as in transformers, unless model:
    # sets them), its weights the initial parameters. Given on the command line, it replaces
    # the file's model sizes; a size given there too, or beside init_from in the file, must
    # agree. In a file, an empty init_from is none.
    init_from: str | None = None
    out_dir: str = "runs"
    plot: bool = True
    tensorboard: bool = False  # also write the metrics to out_dir/name/tensorboard
    profile: ProfileConfig | None = None  # a jax.profiler trace in out_dir/name/profile
    # a W&B run (offline) in out_dir/name/wandb; in a file, wandb: true is short for wandb: {}
    wandb: WandbConfig | None = None

    def __post_init__(self) -> None:
        where = where_of(self)
        if not self.name or self.name != os.path.basename(self.name) or self.name in (".", ".."):
            raise ValueError(
                f"{where}name={self.name!r} must be a plain directory name (the run's outputs go "
                f"to out_dir/name); use e.g. name=run1, and out_dir for the parent directory."
            )
        if not self.out_dir:
            raise ValueError(f"{where}out_dir must be a directory; got {self.out_dir!r}.")
        counts = ("cpu_devices", "steps", "global_batch", "accumulate_steps", "log_every")
        counts = {name: getattr(self, name) for name in (*counts, "checkpoint_every")}
        check_mesh_and_counts(self.mesh, counts, self.profile)
        self._check_short_forms()
        at_least(self, "keep", 1)
        m = self.model
        if self.init_from is not None and (m.kind != "gpt" or m.family == "gpt"):
            raise ValueError(
                f"{where}init_from={self.init_from!r} starts a model of a Hugging Face family "
                f"(llama, mixtral or qwen2) from its checkpoint; got model.kind={m.kind!r}, "
                f"model.family={m.family!r}. Read the config with "
                f"replicator.cli.config.from_dict, which takes the checkpoint's sizes and family."
            )
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
        if self.clip_global_norm is not None:
            finite_positive(self, "clip_global_norm", example="clip_global_norm=1.0", none=True)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"{where}zero_stage must be 0, 1, 2 or 3; got {self.zero_stage!r}.")
        for key in ("offload_params", "offload_optimizer"):
            if getattr(self, key) and (m.kind != "gpt" or "stage" in self.mesh):
                what = f"model.kind={m.kind!r}" if m.kind != "gpt" else "a pipeline (mesh.stage)"
                raise ValueError(
                    f"{where}{key}=true is for model.kind='gpt' without a pipeline; with "
                    f"{what} keep it false (or use zero_stage=3 to shard what is kept)."
                )
        check_local_steps(self)
        check_zero_axes(self)
        jobs = dict(model=self.model, mesh=self.mesh, pipeline=self.pipeline)
        check_model_fits_the_job(
            **jobs, zero_stage=self.zero_stage, accumulate_steps=self.accumulate_steps
        )
        check_context_and_experts(
            **jobs, global_batch=self.global_batch, accumulate_steps=self.accumulate_steps
        )

    def _check_short_forms(self) -> None:
        """Refuses, with the long form to write, a short form built in Python: a file's short
        forms are turned into their long forms before a config is built (`short_forms`)."""
        refused = None
        if isinstance(self.optimizer, str):
            long = f"optimizer: {{name: {self.optimizer}}}"
            refused = "optimizer", long, f"optimizer=OptimizerConfig(name={self.optimizer!r})"
        elif isinstance(self.wandb, bool):
            fix = "wandb=WandbConfig()" if self.wandb else "wandb=None"
            refused = "wandb", "wandb: {}" if self.wandb else "no wandb", fix
        for key in ("out_dir", "init_from"):
            value = getattr(self, key)
            if isinstance(value, str) and value.startswith("~"):
                refused = key, "the home directory", f"{key}=os.path.expanduser({value!r})"
            elif key == "init_from" and value == "":
                refused = key, "no init_from", "init_from=None"
        if refused is not None:
            key, long, fix = refused
            raise ValueError(
                f"{where_of(self)}{key}={getattr(self, key)!r} is a config file's short form of "
                f"{long}; give {fix}, or read the config with replicator.cli.config.from_dict, "
                f"which takes the short forms."
            )
