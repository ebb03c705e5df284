"""Run configs: YAML files validated into typed dataclasses, with ``key=value`` overrides.

Only the CLI and the examples read configs; the library takes explicit arguments. A config names
every field it sets; an unknown or mistyped key is an error that names it and lists the valid
ones. Every value is checked here, when the config is built, before any JAX work: a value out of
range, or one the model kind cannot use, is a ``ValueError`` naming the key.

>>> TrainConfig(model=ModelConfig(kind="cnn"), zero_stage=3)
Traceback (most recent call last):
...
ValueError: TrainConfig: model.kind='cnn' supports zero_stage 0, 1 or 2 and accumulate_steps=1 (its BatchNorm takes statistics over the whole batch); got zero_stage=3, accumulate_steps=1.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from typing import Any

from replicator.cli.checks import _at_least, _did_you_mean, _finite_positive, _one_of, _where
from replicator.cli.data import DataConfig
from replicator.cli.optimizers import DEFAULT_LEARNING_RATE, OptimizerConfig
from replicator.cli.yaml_files import DuplicateKeyError, UniqueKeyLoader, _read, _set  # noqa: F401


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # "gpt": a byte-level decoder on Python's stdlib sources (d_model, layers, heads, seq_len,
    #   and the gpt-only vocab, d_ff, dtype, remat);
    # "mlp": a residual MLP regression (d_model, layers);
    # "cnn": a classifier with cross-replica BatchNorm on generated shape images (width);
    # "module:function": your own job, `function(config, repl, tx)` (see jobs.own_model).
    kind: str = "gpt"
    d_model: int = 64
    layers: int = 4
    heads: int = 4
    seq_len: int = 64
    width: int = 16  # cnn: channels of the first conv block (the second has twice as many)
    vocab: int = 256  # gpt: token ids (the built-in text and untokenized text are bytes, 0-255)
    d_ff: int | None = None  # gpt: the MLP's hidden units; null: 4 * d_model
    dtype: str = "float32"  # gpt: the compute dtype, "float32" or "bfloat16" (params stay fp32)
    # gpt: what each block keeps for its backward pass (the same numbers whatever it is):
    # none (false) all its activations; full (true) its input, recomputing the block; dots the
    # outputs of its linear layers, recomputing attention's scores (Megatron-LM's selective
    # recomputation). In a pipeline it is the engine's remat, for every schedule.
    remat: bool | str = False
    # gpt: attention over a `context` axis (the sequence split over it): ring (each device's
    # keys and values passed round the axis) or all_to_all (DeepSpeed-Ulysses: the heads split
    # over it instead, heads / mesh.model a multiple of mesh.context); the same numbers.
    # dot_product: jax.nn.dot_product_attention (the platform's own; no context axis).
    # splash: the TPU's splash-attention kernel (Pallas; interpreted off a TPU; no context
    # axis: ring and all_to_all run the same kernel on a TPU).
    attention: str = "ring"
    zigzag: bool = True  # gpt, ring: chunks in zigzag order, the causal work even over `context`
    # gpt: the vocabulary split over `model` too (the token table by rows, the output matrix by
    # columns: each device computes its share of the logits, as Megatron-LM's vocab-parallel
    # embedding and cross-entropy), when the vocabulary divides by mesh.model and the mesh has
    # no context or expert axis (XLA's partitioner aborts there); false keeps them whole on
    # every device (each then computes every logit). The same numbers either way.
    vocab_parallel: bool = True
    # gpt: the blocks as one lax.scan (compiled once); false unrolls them, a copy per layer
    scan_layers: bool = True
    # gpt, zero_stage 3: the dtype the stored parameters are gathered in and their gradients
    # reduce-scattered in: null their own (fp32, summed as one device sums them), or bfloat16
    # (as MaxText's FSDP: half the bytes, each gradient rounded to bf16 once more)
    reduce_dtype: str | None = None
    # gpt: a mixture of experts: experts per MoE block (0: dense MLPs; the keys below are then
    # unused), split over an `expert` axis; every moe_every-th block is one (layers a multiple
    # of it); each token goes to its top_k experts, each taking at most capacity_factor x its
    # share of a sequence's token-choices (the rest dropped: the token keeps its residual only;
    # null: none dropped); aux_weight x the load-balancing loss is added to the loss.
    experts: int = 0
    moe_every: int = 1
    top_k: int = 1
    capacity_factor: float | None = 1.25
    aux_weight: float = 0.01
    # gpt: the decoder's family: gpt (LayerNorm, learned positions, GELU MLP, biases) or llama
    # (RMSNorm, rotary positions, SwiGLU, no biases, grouped-query attention); kind: llama is
    # short for kind: gpt with family: llama. The llama-only keys: kv_heads (key/value heads;
    # null: heads), rope_theta, norm_eps, tie_embeddings (the head is the token table).
    family: str = "gpt"
    kv_heads: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.kind == "llama":  # short for kind: gpt, family: llama
            object.__setattr__(self, "kind", "gpt")
            object.__setattr__(self, "family", "llama")
        _one_of(self, "family", FAMILIES, what="a decoder family")
        if self.family != "llama":
            for name, default in LLAMA_ONLY.items():
                if getattr(self, name) != default:
                    raise ValueError(
                        f"{_where(self)}{name}={getattr(self, name)!r} is for model.kind='llama' "
                        f"(or family: llama); remove the key, or use kind: llama."
                    )
        for name, example in (("rope_theta", "rope_theta=10000.0"), ("norm_eps", "norm_eps=1e-5")):
            _finite_positive(self, name, example=example)  # else NaN from the first step
        if self.kv_heads is not None:
            _at_least(self, "kv_heads", 1)
            if self.heads % self.kv_heads:
                raise ValueError(
                    f"{_where(self)}kv_heads={self.kv_heads} must divide heads={self.heads} (each "
                    f"key/value head serves heads / kv_heads query heads)."
                )
        if not _OWN_KIND.fullmatch(str(self.kind)):  # else "module:function", your own model
            _one_of(self, "kind", MODEL_KINDS, what="a model kind (or 'module:function')")
        for name in ("d_model", "layers", "heads", "seq_len", "width"):
            _at_least(self, name, 1)
        if self.kind in ("mlp", "cnn"):  # your own job reads what it likes of the section
            for name, default in GPT_ONLY.items():
                if getattr(self, name) != default:
                    raise ValueError(
                        f"{_where(self)}{name}={getattr(self, name)!r} is for model.kind='gpt'; "
                        f"model.kind={self.kind!r} has no {name}. Remove the key (or set it to "
                        f"{default!r})."
                    )
        _at_least(self, "vocab", 1)
        if self.d_ff is not None:
            _at_least(self, "d_ff", 1)
        _one_of(self, "dtype", DTYPES, what="a compute dtype")
        if self.reduce_dtype is not None:
            _one_of(self, "reduce_dtype", DTYPES, what="a dtype to reduce gradients in (or null)")
        if not isinstance(self.remat, bool) and self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"{_where(self)}remat must be one of none, full, dots (or false = none, true = "
                f"full); got {self.remat!r}."
            )
        self._check_attention_and_experts()
        if self.kind == "gpt" and self.d_model % self.heads:
            raise ValueError(
                f"{_where(self)}heads={self.heads} does not divide d_model={self.d_model}; use a "
                f"d_model that is a multiple of heads (e.g. "
                f"d_model={self.heads * math.ceil(self.d_model / self.heads)})."
            )

    def _check_attention_and_experts(self) -> None:
        """The attention and mixture-of-experts keys, each on its own."""
        _one_of(self, "attention", ATTENTIONS, what="an attention over the context axis")
        _at_least(self, "experts", 0)
        _at_least(self, "moe_every", 1)
        _at_least(self, "top_k", 1)
        if self.capacity_factor is not None:
            _finite_positive(self, "capacity_factor", example="capacity_factor=1.25", none=True)
        value = self.aux_weight
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not (math.isfinite(value) and value >= 0)
        ):
            raise ValueError(
                f"{_where(self)}aux_weight must be a finite number >= 0; got {value!r} (e.g. "
                f"aux_weight=0.01, or 0 for no load-balancing loss)."
            )
        if not self.experts:
            return
        if self.top_k > self.experts:
            raise ValueError(
                f"{_where(self)}top_k={self.top_k} is more than experts={self.experts} (each "
                f"token goes to top_k different experts); use top_k <= {self.experts} (e.g. "
                f"top_k={min(2, self.experts)}), or more experts."
            )
        if self.layers % self.moe_every:
            raise ValueError(
                f"{_where(self)}moe_every={self.moe_every} does not divide layers={self.layers} "
                f"(every moe_every-th block is a mixture of experts); use layers a multiple of "
                f"{self.moe_every} (e.g. layers="
                f"{self.moe_every * math.ceil(self.layers / self.moe_every)}), or moe_every=1."
            )


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    # "gpipe", "circular", "1f1b", "interleaved" (Megatron-LM's interleaved 1F1B) or "zerobubble"
    schedule: str = "1f1b"
    microbatches: int = 4  # interleaved: a multiple of the stage axis
    repeats: int = 2  # virtual stages per device, for "circular" and "interleaved" (>= 2)
    # zero_stage 3: "step" sums the stages' gradients whole over the micro-batches and
    # reduce-scatters them once a step; "microbatch" in each micro-batch's backward pass
    scatter_grads: str = "microbatch"

    def __post_init__(self) -> None:
        _one_of(self, "schedule", SCHEDULES, what="a schedule")
        _one_of(self, "scatter_grads", ("microbatch", "step"), what="a reduce-scatter setting")
        _at_least(self, "microbatches", 1)
        _at_least(self, "repeats", 1)
        if self.schedule == "interleaved" and self.repeats < 2:
            raise ValueError(
                f"{_where(self)}repeats={self.repeats}: schedule='interleaved' needs 2 or more "
                f"virtual stages per device; use repeats=2 (layers a multiple of 2 x the stage "
                f"axis), or schedule='1f1b' for one stage per device."
            )


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    start_step: int = 3  # the first traced step, counted from 1 (step 1 compiles)
    num_steps: int = 3

    def __post_init__(self) -> None:
        _at_least(self, "start_step", 1)
        _at_least(self, "num_steps", 1)


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    # A Weights & Biases run in out_dir/name/wandb; `wandb: true` is short for `wandb: {}`.
    project: str | None = None  # null: the run's name
    name: str | None = None  # the W&B run's display name; null: the run's name
    mode: str = "offline"  # nothing sent: `wandb sync` the run later; "online" or "disabled"

    def __post_init__(self) -> None:
        _one_of(self, "mode", WANDB_MODES, what="a wandb mode")
        for key in ("project", "name"):
            value = getattr(self, key)
            if value is not None and not value.strip():
                raise ValueError(
                    f"{_where(self)}{key} must be a non-empty name or null; got {value!r}."
                )


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
        where = _where(self)
        if not self.name or self.name != os.path.basename(self.name) or self.name in (".", ".."):
            raise ValueError(
                f"{where}name={self.name!r} must be a plain directory name (the run's outputs go "
                f"to out_dir/name); use e.g. name=run1, and out_dir for the parent directory."
            )
        if not self.out_dir:
            raise ValueError(f"{where}out_dir must be a directory; got {self.out_dir!r}.")
        self._check_mesh_and_counts()
        _at_least(self, "keep", 1)
        if self.init_from == "":  # empty: the same as no init_from
            object.__setattr__(self, "init_from", None)
        if self.init_from is not None:
            object.__setattr__(self, "model", _checkpoint_model(self))
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
            _at_least(self, "emergency_after", 1)
        if isinstance(self.optimizer, str):  # optimizer: adam, short for {name: adam}
            try:
                object.__setattr__(self, "optimizer", OptimizerConfig(name=self.optimizer))
            except ValueError as e:
                raise ValueError(
                    f"{where}optimizer{str(e).removeprefix('OptimizerConfig: ')[4:]}"
                ) from None
        if self.learning_rate is not None:  # learning_rate: 1e-3, short for the optimizer's
            _finite_positive(self, "learning_rate", example="learning_rate=3e-3")
            if self.optimizer.learning_rate not in (DEFAULT_LEARNING_RATE, self.learning_rate):
                raise _both_rates(where)
            object.__setattr__(
                self,
                "optimizer",
                dataclasses.replace(self.optimizer, learning_rate=float(self.learning_rate)),
            )
        if self.clip_global_norm is not None:
            _finite_positive(self, "clip_global_norm", example="clip_global_norm=1.0", none=True)
        if isinstance(self.wandb, bool):  # wandb: true, short for wandb: {} (offline)
            object.__setattr__(self, "wandb", WandbConfig() if self.wandb else None)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"{where}zero_stage must be 0, 1, 2 or 3; got {self.zero_stage!r}.")
        self._check_model_fits_the_job()

    def _check_mesh_and_counts(self) -> None:
        """The mesh, the device and step counts, the profile's window; ``~`` in paths."""
        where = _where(self)
        if not self.mesh:
            raise ValueError(
                f"{where}mesh must name at least one axis; got {{}}. e.g. mesh: {{data: -1}} (every "
                f"device a replica) or mesh: {{data: 2, stage: 4}}."
            )
        for key, size in self.mesh.items():
            if not isinstance(key, str) or isinstance(size, bool) or not isinstance(size, int):
                raise ValueError(
                    f"{where}mesh must map axis names to sizes (ints); got {key!r}: {size!r}. "
                    f"e.g. mesh: {{data: -1}} or mesh: {{data: 2, stage: 4}}."
                )
            if size < 1 and size != -1:
                raise ValueError(
                    f"{where}mesh.{key}={size}: an axis size must be an int >= 1, or -1 for the "
                    f"remaining devices."
                )
        _at_least(self, "cpu_devices", 0)
        if self.cpu_devices > MAX_CPU_DEVICES:
            raise ValueError(
                f"{where}cpu_devices={self.cpu_devices} is more CPU devices than this process can "
                f"emulate (each is a thread pool and its memory; at most {MAX_CPU_DEVICES}); use "
                f"cpu_devices <= {MAX_CPU_DEVICES} (e.g. cpu_devices=8), or 0 for the platform's "
                f"own devices."
            )
        for name in ("steps", "global_batch", "accumulate_steps", "log_every", "checkpoint_every"):
            _at_least(self, name, 1)
        if self.steps > MAX_STEPS:
            raise ValueError(
                f"{where}steps={self.steps} is more than the run's step counter holds (an int32, "
                f"at most {MAX_STEPS}); use fewer steps."
            )
        if isinstance(self.profile, ProfileConfig) and self.profile.start_step > self.steps:
            raise ValueError(
                f"{where}profile.start_step={self.profile.start_step} comes after the run's last "
                f"step (steps={self.steps}), so nothing would be traced; use profile.start_step "
                f"<= {self.steps} (step 1 compiles, e.g. profile.start_step={min(3, self.steps)})."
            )
        for name in ("out_dir", "init_from"):  # ~ is the home directory, in a file too
            value = getattr(self, name)
            if isinstance(value, str) and value.startswith("~"):
                object.__setattr__(self, name, os.path.expanduser(value))

    def _check_model_fits_the_job(self) -> None:
        """What a model kind asks of the mesh, the pipeline and the optimizer options."""
        where, kind = _where(self), self.model.kind
        if kind == "gpt" and "stage" in self.mesh and self.pipeline is None:
            raise ValueError(
                f"{where}a mesh with a 'stage' axis needs a pipeline: section, e.g. pipeline: "
                f"{{schedule: 1f1b, microbatches: 4}}."
            )
        if kind in ("mlp", "cnn") and "model" in self.mesh:
            raise ValueError(
                f"{where}model.kind={kind!r} has no tensor-parallel layout; use a mesh without "
                f"'model' (e.g. mesh: {{data: -1}}), or model.kind='gpt'."
            )
        t = self.mesh.get("model", 1)
        if kind == "gpt" and t > 1 and self.model.heads % t:
            raise ValueError(
                f"{where}model.heads={self.model.heads} does not split over mesh.model={t} (each "
                f"device holds whole attention heads); use heads a multiple of {t} (e.g. heads="
                f"{t * math.ceil(self.model.heads / t)}), or a smaller model axis."
            )
        d_ff = self.model.d_ff
        if kind == "gpt" and t > 1 and d_ff is not None and d_ff % t:
            raise ValueError(
                f"{where}model.d_ff={d_ff} does not split over mesh.model={t} (each device holds "
                f"d_ff / {t} of the MLP's hidden units); use d_ff a multiple of {t} (e.g. d_ff="
                f"{t * math.ceil(d_ff / t)}), or a smaller model axis."
            )
        if kind == "gpt" and "stage" in self.mesh and self.accumulate_steps != 1:
            raise ValueError(
                f"{where}accumulate_steps={self.accumulate_steps} does not apply to a pipeline "
                f"(mesh has a 'stage' axis), which splits each replica's batch into micro-batches "
                f"already; use pipeline.microbatches instead (e.g. pipeline.microbatches="
                f"{self.accumulate_steps * (self.pipeline.microbatches if self.pipeline else 4)}"
                f") with accumulate_steps=1."
            )
        if kind == "cnn" and "stage" in self.mesh:
            raise ValueError(
                f"{where}model.kind='cnn' is data parallel; use a mesh without 'stage'."
            )
        if kind == "cnn" and (self.zero_stage == 3 or self.accumulate_steps != 1):
            raise ValueError(
                f"{where}model.kind='cnn' supports zero_stage 0, 1 or 2 and accumulate_steps=1 "
                f"(its BatchNorm takes statistics over the whole batch); got zero_stage="
                f"{self.zero_stage}, accumulate_steps={self.accumulate_steps}."
            )
        if self.model.reduce_dtype not in (None, "float32") and self.zero_stage != 3:
            raise ValueError(
                f"{where}model.reduce_dtype={self.model.reduce_dtype!r} is the dtype ZeRO-3 "
                f"gathers the parameters and sums their gradients in; with zero_stage="
                f"{self.zero_stage} the gradients are summed in fp32 and it would change "
                f"nothing. Use zero_stage=3, or model.reduce_dtype=null."
            )
        if self.pipeline and self.pipeline.scatter_grads != "microbatch" and self.zero_stage != 3:
            raise ValueError(
                f"{where}pipeline.scatter_grads={self.pipeline.scatter_grads!r} is when ZeRO-3 "
                f"reduce-scatters the stages' gradients; with zero_stage={self.zero_stage} it "
                f"would change nothing. Use zero_stage=3, or pipeline.scatter_grads=microbatch."
            )
        self._check_context_and_experts()

    def _check_context_and_experts(self) -> None:
        """What the ``context`` and ``expert`` axes ask of the model, the batch and the schedule.

        A size of -1 (the remaining devices) is not known here: what needs it is left to the
        library, which refuses it before the first step."""
        where, m, mesh = _where(self), self.model, self.mesh
        c, e, kind = mesh.get("context", 1), mesh.get("expert", 1), m.kind
        for axis in ("context", "expert"):
            if kind in ("mlp", "cnn") and axis in mesh:
                what = "the sequence" if axis == "context" else "a mixture of experts"
                raise ValueError(
                    f"{where}mesh.{axis}: model.kind={kind!r} has no {axis} axis (it splits "
                    f"{what} of model.kind='gpt'); use a mesh without {axis!r} (e.g. mesh: "
                    f"{{data: -1}}), or model.kind='gpt'."
                )
        if kind != "gpt":
            return
        if m.experts and "stage" in mesh:
            raise ValueError(
                f"{where}model.experts={m.experts}: the mixture-of-experts GPT has no pipeline "
                f"layout (its load-balancing loss and routing counts do not travel between "
                f"stages); use a mesh without 'stage' (e.g. mesh: {{data: 2, expert: 4}}), or "
                f"model.experts=0."
            )
        if e != 1 and not m.experts:
            raise ValueError(
                f"{where}mesh.expert={e} with model.experts=0: a dense GPT has no experts to "
                f"split, and the axis would only split each replica's sequences as data does; "
                f"use mesh.data for that (e.g. mesh: {{data: -1}}), or set model.experts (a "
                f"multiple of mesh.expert, e.g. model.experts={8 if e == -1 else 2 * e})."
            )
        if c != 1 and e != 1:
            raise ValueError(
                f"{where}mesh.context={c} with mesh.expert={e}: a context axis and an expert "
                f"axis together are not supported yet; use one of them (e.g. mesh: {{data: 2, "
                f"context: 4}} or mesh: {{data: 2, expert: 4}})."
            )
        schedule = self.pipeline.schedule if self.pipeline and "stage" in mesh else None
        if c != 1 and m.attention == "ring" and schedule in RING_IN_ONE_COND:
            raise ValueError(
                f"{where}model.attention='ring' with mesh.context={c} cannot run under "
                f"pipeline.schedule={schedule!r} (it runs each stage's work under a condition, "
                f"which the ring's collectives cannot be in); use model.attention=all_to_all, "
                f"or pipeline.schedule gpipe or circular."
            )
        if c > 1:
            self._check_context_axis(c)
        if e > 1:
            self._check_expert_axis(e)

    def _check_context_axis(self, c: int) -> None:
        where, m, t = _where(self), self.model, self.mesh.get("model", 1)
        if m.attention == "all_to_all" and t > 0 and (m.heads // t) % c:
            per = f"heads / mesh.model = {m.heads // t}" if t > 1 else f"heads={m.heads}"
            raise ValueError(
                f"{where}model.attention='all_to_all' splits the heads over mesh.context={c}, "
                f"but {per} do not split {c} ways; use model.heads a multiple of {c * t} (e.g. "
                f"model.heads={c * t * math.ceil(m.heads / (c * t))}), or model.attention=ring."
            )
        zigzag = m.attention == "ring" and m.zigzag
        parts = 2 * c if zigzag else c
        if m.seq_len % parts:
            why = (
                f"2 x mesh.context = {parts} chunks (the zigzag layout of a ring)"
                if zigzag
                else f"mesh.context={c} chunks"
            )
            raise ValueError(
                f"{where}model.seq_len={m.seq_len} does not split into {why}; use seq_len a "
                f"multiple of {parts} (e.g. model.seq_len={parts * math.ceil(m.seq_len / parts)})"
                f"{', or model.zigzag=false' if zigzag and m.seq_len % c == 0 else ''}."
            )

    def _check_expert_axis(self, e: int) -> None:
        where, m, k = _where(self), self.model, self.accumulate_steps
        if m.experts % e:
            raise ValueError(
                f"{where}model.experts={m.experts} does not split over mesh.expert={e} (each "
                f"device holds experts / {e} of them); use model.experts a multiple of {e} (e.g. "
                f"model.experts={e * math.ceil(m.experts / e)}), or a smaller expert axis."
            )
        data = [self.mesh.get(axis, 1) for axis in DATA_AXES]
        if min(data) < 1:
            return  # a -1 data axis: the library checks the batch against the devices
        replicas = math.prod(data)
        if self.global_batch % (replicas * k * e):
            over = f"{replicas} data replica{'s' * (replicas > 1)}"
            if k > 1:
                over += f" and accumulate_steps={k} micro-batches"
            unit = replicas * k * e
            raise ValueError(
                f"{where}global_batch={self.global_batch} over {over} gives "
                f"{self.global_batch / replicas / k:g} sequences a step, which do not split over "
                f"mesh.expert={e} (each expert device routes whole sequences); use global_batch "
                f"a multiple of {unit} (e.g. global_batch="
                f"{unit * math.ceil(self.global_batch / unit)}), or a smaller expert axis."
            )


# model: keys that init_from's config.json sets, and where they come from
CHECKPOINT_SIZES = {
    "vocab": "vocab_size",
    "d_model": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "d_ff": "intermediate_size",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "experts": "num_local_experts",
    "top_k": "num_experts_per_tok",
}


def _checkpoint_model(config) -> ModelConfig:
    """``config.model`` with the sizes of ``init_from``'s Llama or Mixtral (kind gpt, family
    llama); a size the config sets to another value than the checkpoint's is refused."""
    from replicator.models import hf

    where = f"{_where(config)}init_from={config.init_from!r}"
    if not isinstance(config.init_from, str) or not config.init_from:
        raise ValueError(f"{where} must be a directory (a Hugging Face Llama checkpoint).")
    try:
        hf_config = hf.read_config(config.init_from)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: {str(e).splitlines()[0]}") from None
    model, defaults = config.model, ModelConfig()
    sizes = {key: hf_config.get(name) for key, name in CHECKPOINT_SIZES.items()}
    sizes = {key: value for key, value in sizes.items() if value is not None}
    for key, value in sizes.items():
        mine = getattr(model, key)
        if mine != getattr(defaults, key) and mine != value:
            raise ValueError(
                f"{where}: model.{key}={mine!r}, but the checkpoint's config.json has "
                f"{CHECKPOINT_SIZES[key]}={value!r}; remove model.{key} (the checkpoint sets it)."
            )
    if model.kind not in ("gpt", "llama"):
        raise ValueError(
            f"{where}: model.kind={model.kind!r}; init_from loads a Llama (kind: llama)."
        )
    if model.experts and "experts" not in sizes:
        raise ValueError(
            f"{where}: model.experts={model.experts}, but the checkpoint is a dense Llama (its "
            f"config.json has no num_local_experts); remove model.experts, or start from a "
            f"Mixtral checkpoint."
        )
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    try:
        return ModelConfig(**(fields | sizes | {"kind": "gpt", "family": "llama"}))
    except ValueError as e:  # e.g. a rope_theta of 0 in config.json
        message = str(e).removeprefix("ModelConfig: ")
        raise ValueError(f"{where}: with the sizes of its config.json, model.{message}") from None


MODEL_KINDS = ("gpt", "llama", "mlp", "cnn")
# The most CPU devices one process emulates: 4096 take about 8 s to start, 100000 minutes.
MAX_CPU_DEVICES = 4096
MAX_STEPS = 2**31 - 1  # the state's step counter is an int32
DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("none", "full", "dots")
BYTE_VOCAB = 256
GPT_ONLY = {  # the gpt-only keys' defaults
    "family": "gpt",
    "vocab": BYTE_VOCAB,
    "d_ff": None,
    "dtype": "float32",
    "remat": False,
    "attention": "ring",
    "zigzag": True,
    "vocab_parallel": True,
    "scan_layers": True,
    "reduce_dtype": None,
    "experts": 0,
    "moe_every": 1,
    "top_k": 1,
    "capacity_factor": 1.25,
    "aux_weight": 0.01,
}
ATTENTIONS = ("ring", "all_to_all", "dot_product", "splash")
FAMILIES = ("gpt", "llama")
LLAMA_ONLY = {"kv_heads": None, "rope_theta": 10000.0, "norm_eps": 1e-5, "tie_embeddings": False}
DATA_AXES = ("dcn_data", "data")  # the replicas: the batch is split over these
RING_IN_ONE_COND = ("1f1b", "interleaved", "zerobubble")  # schedules that cannot run a ring
_OWN_KIND = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved", "zerobubble")
WANDB_MODES = ("offline", "online", "disabled")


def _both_rates(where: str) -> ValueError:
    return ValueError(
        f"{where}learning_rate and optimizer.learning_rate are both set; set one of them (the "
        f"top-level learning_rate is short for optimizer.learning_rate), e.g. "
        f"optimizer: {{name: adam, learning_rate: 3e-3}}."
    )


def load(path: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> TrainConfig:
    """Reads a YAML config and applies ``key=value`` overrides (dotted keys for nested fields).

    An empty ``init_from`` (``init_from=``, ``init_from=null``) is the same as none: the file's
    model sizes stay.

    Raises:
      FileNotFoundError: if there is no file at ``path``.
      ValueError: naming an unknown key (with the valid keys), a value of the wrong type or out
        of range (with the valid ones), or a file that is not a YAML mapping.
    """
    raw = _read(path)
    overridden = set()
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r}: write key=value, e.g. steps=20.")
        if "" in key.split("."):
            raise ValueError(
                f"override {item!r}: {key!r} has an empty part; write key=value with a dotted "
                f"key for a section, e.g. model.layers=2."
            )
        overridden.add(key)
        _set(raw, item, key, value)
    if raw.get("init_from") in ("", None):  # empty or null: as if the key were absent
        raw.pop("init_from", None)
        overridden.discard("init_from")
    if "init_from" in overridden and isinstance(raw.get("model"), dict):
        # The file's sizes describe the model it trains from scratch; the checkpoint's replace
        # them (a size also given on the command line must agree with the checkpoint).
        for key in CHECKPOINT_SIZES:
            if f"model.{key}" not in overridden:
                raw["model"].pop(key, None)
    # An override of the rate replaces it in whichever form the file gives it.
    section = raw.get("optimizer")
    if {"learning_rate", "optimizer.learning_rate"} <= overridden:
        raise _both_rates("overrides: ")
    if "learning_rate" in overridden and isinstance(section, dict):
        section.pop("learning_rate", None)
    elif "optimizer.learning_rate" in overridden:
        raw.pop("learning_rate", None)
    if "learning_rate" in raw and isinstance(section, dict) and "learning_rate" in section:
        raise _both_rates(f"{path}: ")
    return from_dict(TrainConfig, raw, where=str(path))


def from_dict(cls, raw: dict, where: str = "config", prefix: str = ""):
    """A ``cls`` dataclass from ``raw``, checking every key, type and range.

    ``prefix`` is the section's dotted path (``"model."``) in the messages.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in raw.items():
        if key not in fields:
            raise ValueError(
                f"{where}: unknown key {key!r} in {cls.__name__}.{_did_you_mean(key, list(fields))}"
                f" Valid keys: {', '.join(fields)}."
            )
        values[key] = _check(hints[key], value, f"{where}: {prefix}{key}", where, f"{prefix}{key}.")
    try:
        return cls(**values)
    except ValueError as e:
        message, own = str(e), f"{cls.__name__}: "
        if not message.startswith(own):
            raise
        raise ValueError(f"{where}: {prefix}{message[len(own) :]}") from None


def _check(hint, value, where: str, file: str = "config", prefix: str = "") -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check(option, value, where, file, prefix)
            except ValueError as e:
                errors.append(str(e))
        if bool in options and not isinstance(value, dict):  # e.g. wandb: a section or true
            if any(dataclasses.is_dataclass(option) for option in options):
                raise ValueError(
                    f"{where}: expected a section (mapping) or true/false; got {value!r}."
                )
        raise ValueError(errors[0] if errors else f"{where}: unexpected value {value!r}.")
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a section (mapping); got {value!r}.")
        return from_dict(hint, value, file, prefix)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
        try:
            return float(value)
        except ValueError:
            pass
    expected = dict if hint is dict else hint
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ValueError(
            f"{where}: expected {getattr(expected, '__name__', expected)}; got {value!r} "
            f"({type(value).__name__}).{_as_int(value) if expected is int else ''}"
        )
    return value


def _as_int(value) -> str:
    """`` Write it as 1000.`` for a whole number written as a float (``1e3``, ``1000.0``)."""
    if isinstance(value, bool) or not isinstance(value, str | float):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not math.isfinite(number) or number != int(number):
        return ""
    return f" Write it as an integer: {int(number)}."
