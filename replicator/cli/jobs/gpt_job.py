"""The GPT job (``model.kind: gpt`` of any ``model.family``: gpt, llama, mixtral, qwen2; dense
or a mixture of experts): the model's `gpt.GPTConfig` from the ``model:`` section, its step and
its placed state on any mesh a config can give, the parameters of an ``init_from`` checkpoint,
and the ``pipeline:`` section's schedule."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import replicator as rp
from replicator.cli.config import ModelConfig, TrainConfig
from replicator.cli.jobs.base import Job, grad_dtype, local_sgd, sliced, zero_axes
from replicator.models import gpt, hf, llama
from replicator.models.families import FAMILIES


def pipeline_schedule(config: TrainConfig):
    """The ``pipeline:`` section's schedule; ``repeats`` is read by circular and interleaved."""
    p = config.pipeline
    if p.schedule == "circular":
        return rp.pipeline.Circular(repeats=p.repeats)
    if p.schedule == "interleaved":
        return rp.pipeline.Interleaved1F1B(repeats=p.repeats)
    return {
        "gpipe": rp.pipeline.GPipe(),
        "1f1b": rp.pipeline.OneFOneB(),
        "zerobubble": rp.pipeline.ZeroBubble(),
    }[p.schedule]


def check_schedule(config: TrainConfig, schedule, num_stages: int) -> None:
    """Refuses, before anything is traced, micro-batches that the schedule cannot run on
    ``num_stages`` stages (1F1B, ZeroBubble, circular: M >= K; interleaved: M a multiple of K):
    the library's message, then the config keys to change."""
    p = config.pipeline
    try:
        schedule.timetable(
            num_stages, p.microbatches
        )  # NumPy tick tables: the schedule's own rules
    except ValueError as e:
        raise ValueError(
            f"{e} In the config: pipeline.microbatches={p.microbatches} with mesh.stage="
            f"{num_stages} and pipeline.schedule={p.schedule}."
        ) from e


def model_flops(cfg: TrainConfig) -> float | None:
    """The model's training FLOPs per step (for the MFU), for the GPT; None for the others."""
    if cfg.model.kind != "gpt":
        return None
    return gpt.flops_per_token(gpt_config(cfg)) * cfg.global_batch * cfg.model.seq_len


def gpt_config(config: TrainConfig) -> gpt.GPTConfig:
    """The `gpt.GPTConfig` of a ``kind: gpt`` config's ``model:`` section: the GPT's own, or
    Llama's block with what its ``family`` adds (`replicator.models.families`: Qwen2's
    query/key/value biases, Mixtral's experts), from scratch or from ``init_from``."""
    m = config.model
    options = dict(
        seq_len=m.seq_len,
        dtype=jnp.dtype(m.dtype),
        remat=m.remat,
        attention=m.attention,
        zigzag=m.zigzag,
        scan_layers=m.scan_layers,
        # ZeRO-3's gathers and scatters (below it, the optimizer's: `base.grad_dtype`)
        reduce_dtype=m.reduce_dtype if config.zero_stage == 3 else None,
        residual_split=m.residual_split,
        loss_chunks=m.loss_chunks,
        moe_chunks=m.moe_chunks,
        num_experts=m.experts,
        moe_every=m.moe_every,
        top_k=m.top_k,
        capacity_factor=m.capacity_factor,
        aux_weight=m.aux_weight,
    )
    if m.normalize_top_k is not None:
        options["normalize_top_k"] = bool(m.normalize_top_k)
    if config.init_from is not None:  # the checkpoint's sizes, rotary scaling and experts
        return hf.decoder_config(hf.read_config(config.init_from), **_own(m, options))
    if m.family != "gpt":  # Llama's block, and the family's options (its biases, its experts)
        family = _family_options(m)
        return llama.config(
            vocab_size=m.vocab,
            d_model=m.d_model,
            num_layers=m.layers,
            num_heads=m.heads,
            d_ff=m.d_ff or 4 * m.d_model,
            num_kv_heads=m.kv_heads,
            rope_theta=m.rope_theta,
            norm_eps=m.norm_eps,
            tie_embeddings=m.tie_embeddings,
            head_width=None if m.head_dim in (None, m.d_model // m.heads) else m.head_dim,
            **(family | options),
        )
    sizes = dict(vocab_size=m.vocab, d_model=m.d_model, num_heads=m.heads, num_layers=m.layers)
    return gpt.GPTConfig(**sizes, d_ff=m.d_ff, **options)


def _family_options(m) -> dict:
    """The `gpt.GPTConfig` options ``m.family`` adds to Llama's block for a model of ``m``'s
    sizes: its ``options`` of a ``config.json`` of those sizes with its defaults (its queries
    scaled by ``1 / sqrt(head_dim)``, its sliding window and experts as the section sets)."""
    found = FAMILIES[m.family]
    hf_config = dict(found.defaults) | {
        "num_hidden_layers": m.layers,
        "hidden_size": m.d_model,
        "intermediate_size": m.d_ff or 4 * m.d_model,
        found.size_key("intermediate_size"): m.d_ff or 4 * m.d_model,
        found.experts_key: m.experts,
        "num_experts_per_tok": m.top_k,
        "head_dim": m.head_dim or m.d_model // m.heads,
        "query_pre_attn_scalar": m.head_dim or m.d_model // m.heads,
    }
    if m.sliding_window is not None:
        hf_config |= {"sliding_window": m.sliding_window, "use_sliding_window": True}
    options = found.options(hf_config, m.seq_len)
    options.pop("d_ff", None)  # the section's (Qwen3-MoE's experts' width)
    return options


def _own(m, options: dict) -> dict:
    """``options`` without what a checkpoint sets: its experts, and a Mixtral's dropless
    routing without load-balancing loss unless the config sets ``capacity_factor`` or
    ``aux_weight``."""
    defaults, out = ModelConfig(), dict(options)
    for key in ("num_experts", "top_k"):
        out.pop(key)
    for key in ("capacity_factor", "aux_weight"):
        if getattr(m, key) == getattr(defaults, key):
            out.pop(key)
    return out


def gpt_job(config: TrainConfig, repl, make_tx) -> Job:
    """The GPT on any mesh a config can give: data parallel (ZeRO 0-3, accumulation), tensor
    parallel over ``model``, the sequence over ``context``, the experts of a mixture of experts
    over ``expert``, and pipelined over ``stage`` (ZeRO 0-3, with ``model`` and ``context``)."""
    m, model = config.model, gpt_config(config)
    init_params = lambda: gpt.init(model, jax.random.key(0))
    text = functools.cache(lambda: gpt.stdlib_text(2_000_000))  # read when first iterated

    def input_fn(ctx):
        make = lambda n: gpt.token_batches(text(), batch_size=n, seq_len=m.seq_len, seed=0)
        yield from sliced(make, ctx, config.global_batch)

    def batch():
        shape = jax.ShapeDtypeStruct((config.global_batch, m.seq_len), jnp.int32)
        return {"tokens": shape, "targets": shape}

    tokens = config.global_batch * m.seq_len
    if "stage" not in repl.mesh.shape:
        step_fn, init = _unpipelined(config, repl, make_tx, model, init_params)
    else:  # the config has a pipeline: section with a stage axis
        step_fn, init = _pipelined(config, repl, make_tx, model, init_params)
    return Job(step_fn, init, input_fn, batch, tokens, m.vocab)


def _unpipelined(config: TrainConfig, repl, make_tx, model: gpt.GPTConfig, init_params):
    """`gpt_job`'s ``(step_fn, init)`` on a mesh without ``stage``: `DistributedOptimizer.step`
    (`_moe_step` for a mixture of experts), the parameters placed by `_rules`."""
    zero3 = config.zero_stage == 3
    opt = repl.wrap_optimizer(
        make_tx(jax.eval_shape(init_params)),
        zero_stage=config.zero_stage,
        accumulate_steps=config.accumulate_steps,
        clip_global_norm=config.clip_global_norm,
        grad_dtype=grad_dtype(config),
        **local_sgd(config),
        **zero_axes(config),
    )
    loss_fn = lambda p, b: gpt.loss(p, b["tokens"], b["targets"], config=model)

    def step_fn(state, batch):
        p, o, metrics = opt.step(loss_fn, state["params"], state["opt"], batch)
        return {"params": p, "opt": o}, metrics

    if model.num_experts:
        step_fn = _moe_step(model, opt, config.accumulate_steps, config.offload_params)

    def init():
        rules = _rules(config, repl, model)  # heads, MLP (and the vocabulary): "model"

        def place():  # ZeRO-3: split over the replicas, each block's layer gathered alone
            placed = gpt.place(repl, init_params(), config=model, rules=rules)
            stacked, split = gpt.zero_stacked(model), gpt.zero_split(model)
            return opt.shard_params(placed, stacked=stacked, split=split) if zero3 else placed

        placed = _from_checkpoint(config, repl, place) if config.init_from else place()
        state = {"params": placed, "opt": opt.init(placed)}  # initialised on the device
        kept = {"params": config.offload_params, "opt": config.offload_optimizer}
        return {k: rp.to_host(v) if kept[k] else v for k, v in state.items()}

    return step_fn, init


def _pipelined(config: TrainConfig, repl, make_tx, model: gpt.GPTConfig, init_params):
    """`gpt_job`'s ``(step_fn, init)`` pipelined over ``stage`` with the ``pipeline:`` section's
    schedule (its rules checked first), the stage blocks placed by `_rules`."""
    zero3 = config.zero_stage == 3
    schedule = pipeline_schedule(config)
    k, v = repl.mesh.shape["stage"], schedule.repeats
    check_schedule(config, schedule, k)
    grad_fn = gpt.pipeline_value_and_grad(
        model,
        num_microbatches=config.pipeline.microbatches,
        schedule=schedule,
        remat=config.model.remat,
        scatter_grads=config.pipeline.scatter_grads,
    )
    staged = lambda: gpt.pipeline_params(init_params(), num_stages=k, repeats=v)
    # The stage blocks [V, K, L/(V K), ...] are split over "stage"; ZeRO shards their state
    # (and with zero_stage=3 the blocks themselves, layer by layer) over the replicas too.
    tx = repl.wrap_optimizer(
        make_tx(jax.eval_shape(staged)),
        zero_stage=config.zero_stage,
        clip_global_norm=config.clip_global_norm,
        grad_dtype=grad_dtype(config),
        **zero_axes(config),
    )

    def pipeline_step_fn(state, batch):
        loss, grads = grad_fn(state["params"], batch)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, {"loss": rp.all_reduce(loss, "mean")}

    def pipeline_init():
        def place():
            placed = gpt.place_pipeline(
                repl, init_params(), num_stages=k, repeats=v, config=model,
                rules=_rules(config, repl, model),
            )  # fmt: skip
            return tx.shard_params(placed) if zero3 else placed

        placed = _from_checkpoint(config, repl, place) if config.init_from else place()
        return {"params": placed, "opt": tx.init(placed)}

    return pipeline_step_fn, pipeline_init


def _rules(config: TrainConfig, repl, model: gpt.GPTConfig) -> dict:
    """Megatron's layout (`gpt.MEGATRON_RULES`), with the vocabulary over ``model`` too when
    ``model.vocab_parallel`` and it divides by the axis (on a mesh without ``context`` and
    ``expert`` axes):
    each device then computes its share of the logits rather than all of them."""
    shape = dict(repl.mesh.shape)
    t = shape.get("model", 1)
    split = config.model.vocab_parallel and t > 1 and model.vocab_size % t == 0
    # XLA's SPMD partitioner aborts (a check failure: ExpandDeviceGroupsWithIota with jax
    # 0.10.2, spmd_partitioner_util.cc with jax 0.12) on the vocabulary over `model` with the
    # tokens over `data` and `context` (or `expert`).
    split = split and shape.get("expert", 1) == shape.get("context", 1) == 1
    return {**gpt.MEGATRON_RULES, "vocab": "model"} if split else dict(gpt.MEGATRON_RULES)


def _from_checkpoint(config: TrainConfig, repl, place: Callable[[], dict]) -> dict:
    """The parameters of ``config.init_from`` (a Hugging Face Llama), placed as ``place()``
    places fresh ones (under ZeRO-3, its parts: no device ever holds a whole weight it does
    not keep): each process reads only the slices its devices hold. Under
    ``repl.abstract`` (explain, plan) nothing is read: the shapes are those of ``place``."""
    if isinstance(jnp.zeros(()), jax.core.Tracer):  # under repl.abstract: shapes only
        return place()
    return hf.load(config.init_from, repl.abstract(place))


def _moe_step(
    model: gpt.GPTConfig, opt, accumulate_steps: int, offload_params: bool = False
) -> Callable:
    """The mixture-of-experts GPT's ``step_fn``: `DistributedOptimizer.step`'s update, and
    what the routing did: ``loss`` (the mean over replicas of the loss optimized, cross-entropy
    plus ``aux_weight`` x ``aux_loss``, as ``opt.step`` logs it), ``cross_entropy``,
    ``aux_loss`` (the load-balancing loss, mean over sequences and MoE blocks) and
    ``dropped_fraction`` (token-choices over capacity / all token-choices, over the whole
    global batch). ``opt.step`` takes a scalar loss only, so the gradients are taken here
    (``has_aux``), with ``accumulate_steps`` micro-batches summed in a ``lax.scan`` as
    ``opt.step`` does, and reduced by ``opt.update``; ``grad_norm`` is not reported. With
    ``offload_params`` the new parameters go back to host memory."""

    def loss_and_stats(params, batch):
        return gpt.loss_and_stats(params, batch["tokens"], batch["targets"], config=model)

    grad_fn = jax.value_and_grad(loss_and_stats, has_aux=True)

    def step_fn(state, batch):
        params = state["params"]
        if accumulate_steps == 1:  # (gradients of parameters in host memory: on the device)
            (loss, stats), grads = rp.to_device(grad_fn(params, batch))
        else:  # the mean of the micro-batches' losses and gradients, the sums of their counts
            micro = jax.tree.map(lambda a: a.reshape(accumulate_steps, -1, *a.shape[1:]), batch)

            def add(total, mb):
                return jax.tree.map(jnp.add, total, rp.to_device(grad_fn(params, mb))), None

            zeros = jax.tree.map(
                jnp.zeros_like,
                jax.eval_shape(grad_fn, params, jax.tree.map(lambda a: a[0], micro)),
            )
            (loss, stats), grads = jax.lax.scan(add, zeros, micro)[0]
            mean = lambda a: a / accumulate_steps
            loss, grads = mean(loss), jax.tree.map(mean, grads)
            stats |= {k: mean(stats[k]) for k in ("cross_entropy", "aux_loss")}  # counts: sums
        updates, opt_state = opt.update(grads, state["opt"], params)
        params = optax.apply_updates(rp.to_device(params), updates)
        params = rp.to_host(params) if offload_params else params
        means = {"loss": loss} | {k: stats[k] for k in ("cross_entropy", "aux_loss")}
        counts = rp.all_reduce({k: stats[k] for k in ("dropped", "routed")}, "sum")
        metrics = rp.all_reduce(means, "mean") | {
            "dropped_fraction": counts["dropped"] / jnp.maximum(counts["routed"], 1)
        }
        return {"params": params, "opt": opt_state}, metrics

    return step_fn
