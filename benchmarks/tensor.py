"""Tensor parallelism on the ``model`` axis, 8 emulated devices: memory, collectives, step time,
and GSPMD against hand-written Megatron collectives, for ``replicator.models.gpt``.

The model is the library's GPT (``gpt.init``, ``gpt.loss``: token and position embeddings,
``--layers`` pre-LayerNorm blocks of causal self-attention and a GELU MLP run as a ``lax.scan``,
a final LayerNorm and an output matrix, mean cross-entropy), with random non-zero biases and
LayerNorms, Adam in fp32. It is placed by ``gpt.place`` with ``gpt.MEGATRON_RULES``: the fused
``qkv`` weight (columns grouped by head) and the MLP's ``up`` split by columns over ``model``,
the attention ``out`` and ``down`` by rows; LayerNorms, the biases after the row-split products,
the embeddings and the head replicated. The global batch is fixed (``--batch``), so a replica of
``{"data": 8/T, "model": T}`` holds ``T/8`` of it.

1. **Memory per device** for T = 1, 2, 4: parameters and Adam state are the bytes of each
   array's shard on one device; gradients are the shards of the gradients a ``jax.grad`` mapped
   over ``data`` returns with no output sharding given (XLA's choice). Formulas, with
   ``P_split`` the parameters split over ``model`` and ``P_rep`` the others, 4 bytes each:
   parameters and gradients ``4 (P_split/T + P_rep)``, Adam ``2x`` that plus its step count.
2. **``model``-axis collectives** of ``repl.explain`` (``axes == ("model",)``), per layer,
   against Megatron's count: two all-reduces of the activations ``[B, S, d_model]`` (B the
   replica's batch) per layer forward, two backward. Also with the ``qkv`` weight split into
   three ``wq``, ``wk``, ``wv``, for GSPMD and for Megatron by hand (the benchmark's copy of the
   block, `make_loss`).
3. **Step time** of ``repl.run`` against the same step written by hand:
   ``jax.jit(jax.shard_map(..., axis_names={"data"}, check_vma=False))`` of ``gpt.loss``'s
   step, the state placed with the same ``gpt.partition_specs`` and held to them
   (``out_shardings``), donated; target ratio of medians <= 1.05.
4. **GSPMD against hand-written Megatron**: a fully manual ``jax.shard_map`` over ``data`` and
   ``model`` of the GPT's block written out again here (``gpt.block`` has no place for
   Megatron's operators without a change to the library), on the same parameters and specs,
   calling ``f`` (identity forward, ``psum`` over ``model`` backward) before each column-split
   product and ``g`` (``psum`` forward, identity backward) after each row-split one, with
   ``jax.custom_vjp``. Each program's collectives and temporary bytes are read from its
   optimized HLO (``replicator._src.report.hlo.analyze``, as ``explain`` does).

Parts 3 and 4 run on ``{"data": 8/T, "model": T}`` with ``T = --tp``. Exactness first, with
errors the largest over parameters of ``max|x - y| / max|y|`` after 3 steps against one device
with the whole batch: the three programs built with ``optax.sgd`` must be within 1e-5 of one
device in fp32; the timed programs (Adam) are compared with one device in fp32 and in fp64 (the
benchmark's copy of the model, which computes in the parameters' dtype). Adam divides each
gradient element by its own size, so an element whose gradient is at rounding level moves by
rounding noise: the key bias (its gradient is zero in exact arithmetic) is left out of the Adam
errors, the fp32 one-device run's own distance to fp64 is printed as the yardstick, and each
program must be within twice it (+1e-5) of fp64. Then the three are timed side by side in one
process: R rounds of K steps each, the order rotated every round, the median per-step time of
each, and paired bootstrap 95% intervals of the ratios. Every side keeps at most 2 steps in
flight, as ``Replicator.run`` does on CPU (see ``dp_overhead.py``). About 4 minutes on a 2-core
machine, most of it compiling.

    python benchmarks/tensor.py
    python benchmarks/tensor.py --tp 2 --rounds 20 --json /tmp/tensor.json
"""

# ruff: noqa: E402  (the device count must be set before JAX starts its backend)
import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import argparse
import collections
import datetime
import functools
import json
import math
import shlex
import sys
import time

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator._src.report import hlo
from replicator.models import gpt

TARGET = 1.05
IN_FLIGHT = 2  # steps dispatched but unfinished, at most (as Replicator.run on CPU)
NUM_BATCHES = 4
OPTIMIZERS = {"adam": lambda: optax.adam(1e-3), "sgd": lambda: optax.sgd(0.1)}
TOL = 1e-5
HAND = ("GSPMD by hand", "Megatron by hand")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--tp", type=int, default=4, help="T of the timed mesh (parts 3 and 4)")
    p.add_argument("--rounds", type=int, default=20, help="rotated rounds (R)")
    p.add_argument("--steps", type=int, default=5, help="steps per side per round (K)")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    return p.parse_args()


# ---------------------------------------------------------------------------------------------
# The model: one code path, with Megatron's f and g as identities (GSPMD) or as collectives.


def identity(x):
    return x


@jax.custom_vjp
def megatron_f(x):
    """Megatron's f: identity forward, all-reduce over `model` backward."""
    return x


megatron_f.defvjp(lambda x: (x, None), lambda _, dy: (jax.lax.psum(dy, "model"),))


@jax.custom_vjp
def megatron_g(x):
    """Megatron's g: all-reduce over `model` forward, identity backward."""
    return jax.lax.psum(x, "model")


megatron_g.defvjp(lambda x: (jax.lax.psum(x, "model"), None), lambda _, dy: (dy,))


def make_config(a: argparse.Namespace) -> gpt.GPTConfig:
    return gpt.GPTConfig(
        vocab_size=a.vocab, seq_len=a.seq, d_model=a.d_model, num_heads=a.heads,
        num_layers=a.layers,
    )  # fmt: skip


def init_params(config: gpt.GPTConfig, *, seed: int = 0) -> dict:
    """``gpt.init``'s parameters (host arrays), with random non-zero biases and LayerNorm scales
    and shifts (``gpt.init`` makes them 0 and 1): a real test of their gradients."""
    rng = np.random.default_rng(seed)

    def perturb(path, x):
        name = path[-1].key
        x = np.asarray(x, np.float32)
        if name in ("scale", "bias") or name.endswith("_bias"):
            x = x + (0.1 * rng.normal(size=x.shape)).astype(np.float32)
        return x

    return jax.tree_util.tree_map_with_path(perturb, gpt.init(config, jax.random.key(seed)))


def separate_qkv(params: dict, config: gpt.GPTConfig) -> dict:
    """``params`` with the fused ``qkv`` (columns grouped by head) split into three ``[d, d]``
    weights ``wq``, ``wk``, ``wv`` and biases ``bq``, ``bk``, ``bv``: the same model."""
    attn = dict(params["blocks"]["attn"])
    n, d = attn["qkv"].shape[:2]
    nh, hd = config.num_heads, d // config.num_heads
    w = attn.pop("qkv").reshape(n, d, nh, 3, hd)
    b = attn.pop("qkv_bias").reshape(n, nh, 3, hd)
    for i, z in enumerate("qkv"):
        attn[f"w{z}"] = np.ascontiguousarray(w[..., i, :].reshape(n, d, d))
        attn[f"b{z}"] = np.ascontiguousarray(b[..., i, :].reshape(n, d))
    return params | {"blocks": params["blocks"] | {"attn": attn}}


def param_specs(params: dict) -> dict:
    """``gpt.partition_specs()`` (Megatron's layout), extended to `separate_qkv`'s weights."""
    specs = gpt.partition_specs()
    if "qkv" in params["blocks"]["attn"]:
        return specs
    attn = dict(specs["blocks"]["attn"])
    col, colb = attn.pop("qkv"), attn.pop("qkv_bias")
    attn |= {f"w{z}": col for z in "qkv"} | {f"b{z}": colb for z in "qkv"}
    return specs | {"blocks": specs["blocks"] | {"attn": attn}}


def layer_norm(p, x):
    mean = x.mean(-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def make_loss(config: gpt.GPTConfig, f=identity, g=identity):
    """``gpt.loss`` with its block written out again here, so that Megatron's ``f`` can go before
    each column-split product and ``g`` after each row-split one (``gpt.block`` has no place for
    them); also takes `separate_qkv`'s parameters. With identities, the GPT as written for one
    device, in the parameters' dtype (``gpt.loss`` computes in fp32: this is the fp64 one)."""
    head_dim = config.d_model // config.num_heads

    def block(x, p):
        b, s, _ = x.shape
        attn = p["attn"]
        y = f(layer_norm(p["ln1"], x))
        if "qkv" in attn:  # columns grouped by head: [head, (q, k, v), head_dim]
            qkv = y @ attn["qkv"] + attn["qkv_bias"]
            q, k, v = jnp.moveaxis(qkv.reshape(b, s, -1, 3, head_dim), 3, 0)
        else:
            q, k, v = (
                (y @ attn[f"w{z}"] + attn[f"b{z}"]).reshape(b, s, -1, head_dim) for z in "qkv"
            )  # this device's heads (all of them under GSPMD)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
        logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, jnp.finfo(jnp.float32).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v).reshape(b, s, -1)
        x = x + g(out @ attn["out"]) + attn["out_bias"]
        mlp = p["mlp"]
        h = jax.nn.gelu(f(layer_norm(p["ln2"], x)) @ mlp["up"] + mlp["up_bias"])
        return x + g(h @ mlp["down"]) + mlp["down_bias"], None

    def loss(params, tokens, targets):
        x, _ = jax.lax.scan(block, gpt.embed(params["embed"], tokens), params["blocks"])
        logits = layer_norm(params["head"]["norm"], x) @ params["head"]["w"]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    return loss


def make_batches(a: argparse.Namespace) -> list[dict]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(NUM_BATCHES):
        tokens = rng.integers(0, a.vocab, size=(a.batch, a.seq + 1)).astype(np.int32)
        out.append({"tokens": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


# ---------------------------------------------------------------------------------------------
# The three programs.


def make_programs(
    repl: rp.Replicator, config: gpt.GPTConfig, opt: str = "adam", *, fused: bool = True
):
    """``repl.run``'s step_fn, and a builder of the hand-written GSPMD and Megatron programs,
    with the optimizer ``OPTIMIZERS[opt]``. ``repl.run`` and GSPMD by hand differentiate
    ``gpt.loss`` (``fused=False``: `make_loss`, which takes `separate_qkv`'s parameters);
    Megatron by hand, `make_loss` with ``f`` and ``g``."""
    loss_fn = functools.partial(gpt.loss, config=config) if fused else make_loss(config)
    wrapped = repl.wrap_optimizer(OPTIMIZERS[opt]())
    inner = OPTIMIZERS[opt]()

    def step_fn(state, batch):  # one replica's view, parameters whole along `model`
        loss, grads = jax.value_and_grad(loss_fn)(
            state["params"], batch["tokens"], batch["targets"]
        )
        updates, opt = wrapped.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, {"loss": rp.all_reduce(loss, "mean")}

    def body(loss):
        def run(state, batch):
            value, grads = jax.value_and_grad(loss)(
                state["params"], batch["tokens"], batch["targets"]
            )
            grads = jax.lax.pmean(grads, "data")
            updates, opt = inner.update(grads, state["opt"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            return {"params": params, "opt": opt}, jax.lax.pmean(value, "data")[None]

        return run

    def by_hand(state):
        shardings = jax.tree.map(lambda x: x.sharding, state)
        specs = jax.tree.map(lambda s: s.spec, shardings)
        gspmd = jax.jit(
            jax.shard_map(
                body(loss_fn),
                mesh=repl.mesh,
                in_specs=(P(), P("data")),  # `model` left to XLA: the state whole over it
                out_specs=(P(), P("data")),
                axis_names={"data"},
                check_vma=False,
            ),
            out_shardings=(shardings, NamedSharding(repl.mesh, P("data"))),
            donate_argnums=(0,),
        )
        megatron = jax.jit(
            jax.shard_map(
                body(make_loss(config, megatron_f, megatron_g)),
                mesh=repl.mesh,
                in_specs=(specs, P("data")),  # every axis by hand: the local shards
                out_specs=(specs, P("data")),
                check_vma=False,
            ),
            donate_argnums=(0,),
        )
        return gspmd, megatron

    return wrapped, step_fn, by_hand, loss_fn


def make_repl(t: int) -> rp.Replicator:
    return rp.Replicator(mesh_shape={"data": 8 // t, "model": t}, devices=jax.devices()[:8])


def place_state(repl, wrapped, host_params, config):
    if "qkv" in host_params["blocks"]["attn"]:
        params = gpt.place(repl, host_params, config=config)
    else:
        params = repl.place(host_params, param_specs(host_params))
    return {"params": params, "opt": wrapped.init(params)}


def shard_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def split_counts(host_params) -> tuple[int, int]:
    """(P_split, P_rep): the parameters split over `model`, and the others."""
    is_spec = lambda s: isinstance(s, P)
    specs = param_specs(host_params)
    per_leaf = jax.tree.map(
        lambda s, x: jax.tree.map(lambda _: s, x), specs, host_params, is_leaf=is_spec
    )
    split = rep = 0
    for spec, x in zip(
        jax.tree.leaves(per_leaf, is_leaf=is_spec), jax.tree.leaves(host_params), strict=True
    ):
        if "model" in tuple(spec):
            split += x.size
        else:
            rep += x.size
    return split, rep


def gradient_bytes(repl, loss_fn, params, batch) -> int:
    """Per-device bytes of the gradients a ``jax.grad`` mapped over ``data`` returns, with no
    output sharding given: how XLA lays them out (compiled, not run)."""
    grad = jax.jit(
        jax.shard_map(
            lambda p, b: jax.lax.pmean(jax.grad(loss_fn)(p, b["tokens"], b["targets"]), "data"),
            mesh=repl.mesh,
            in_specs=(P(), P("data")),
            out_specs=P(),
            axis_names={"data"},
            check_vma=False,
        )
    )
    compiled = grad.lower(params, batch).compile()
    shapes = jax.eval_shape(grad, params, batch)
    return sum(
        math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
        for s, x in zip(
            jax.tree.leaves(compiled.output_shardings), jax.tree.leaves(shapes), strict=True
        )
    )


def model_collectives(collectives) -> dict:
    on_model = [c for c in collectives if c.axes == ("model",)]
    kinds = collections.Counter()
    for c in on_model:
        kinds[c.kind] += c.count
    return {
        "count": float(sum(c.count for c in on_model)),
        "bytes": float(sum(c.total_bytes for c in on_model)),
        "kinds": dict(kinds),
    }


def by_axes(collectives) -> dict:
    out: dict[str, float] = collections.defaultdict(float)
    for c in collectives:
        out[",".join(c.axes) or "-"] += c.total_bytes
    return dict(out)


def without_key_bias(params: dict, config: gpt.GPTConfig) -> dict:
    """``params`` with the key columns of ``qkv_bias`` left out. Their gradient is zero in exact
    arithmetic (the softmax ignores a shift shared by all keys), so Adam, which divides each
    gradient element by its own size, moves them by rounding noise alone."""
    params = jax.tree.map(np.asarray, params)  # new containers
    attn = params["blocks"]["attn"]
    b = attn["qkv_bias"]
    attn["qkv_bias"] = np.delete(b.reshape(b.shape[0], config.num_heads, 3, -1), 1, axis=2)
    return params


def rel_err(got, want) -> float:
    """The largest over leaves of max |got - want| / max |want|."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)))
    return worst


def one_device(loss_fn, host_params, batches, steps: int, dtype, opt: str = "adam") -> dict:
    """``steps`` steps of ``OPTIMIZERS[opt]`` on one device with the whole batch, in ``dtype``."""
    tx = OPTIMIZERS[opt]()
    with jax.enable_x64(dtype == np.float64):
        params = jax.device_put(
            jax.tree.map(lambda x: x.astype(dtype), host_params), jax.devices()[0]
        )

        @jax.jit
        def step(params, opt, batch):
            grads = jax.grad(loss_fn)(params, batch["tokens"], batch["targets"])
            updates, opt = tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt

        opt = tx.init(params)
        for i in range(steps):
            params, opt = step(params, opt, batches[i % NUM_BATCHES])
        return jax.tree.map(np.asarray, params)


# ---------------------------------------------------------------------------------------------


def memory_and_collectives(a, host_params, batches) -> tuple[list[dict], dict]:
    """Parts 1 and 2 for T = 1, 2, 4 (``repl.explain``; nothing is run): rows, and the
    reports by T."""
    config = make_config(a)
    p_split, p_rep = split_counts(host_params)
    rows, reports = [], {}
    for t in (1, 2, 4):
        repl = make_repl(t)
        wrapped, step_fn, _, loss_fn = make_programs(repl, config)
        state = place_state(repl, wrapped, host_params, config)
        batch = jax.device_put(batches[0], NamedSharding(repl.mesh, P("data")))
        report = reports[t] = repl.explain(step_fn, state, batch)
        b = a.batch // repl.num_replicas
        act = 4 * b * a.seq * a.d_model  # one all-reduce of [B, S, d_model] fp32
        params_formula = 4 * (p_split / t + p_rep)
        count = sum(  # Adam's step count (its integer leaves)
            x.addressable_shards[0].data.nbytes
            for x in jax.tree.leaves(state["opt"])
            if not jnp.issubdtype(x.dtype, jnp.floating)
        )
        rows.append({
            "t": t, "mesh": dict(repl.mesh.shape), "replica_batch": b,
            "params": shard_bytes(state["params"]), "params_formula": params_formula,
            "grads": gradient_bytes(repl, loss_fn, state["params"], batch),
            "opt": shard_bytes(state["opt"]), "opt_formula": 2 * params_formula + count,
            "arguments": report.memory.arguments, "temporaries": report.memory.temporaries,
            "model": model_collectives(report.collectives),
            "megatron_count": 4 * a.layers if t > 1 else 0,
            "megatron_bytes": 4 * a.layers * act if t > 1 else 0,
            "data_bytes": report.bytes_by(axes=("data",)),
        })  # fmt: skip
    return rows, reports


def qkv_apart(a, host_params, batches) -> dict:
    """Part 2 with three q, k, v weights instead of one fused: GSPMD (``repl.explain``) and
    Megatron by hand (its optimized HLO), on the timed mesh."""
    config = make_config(a)
    host_params = separate_qkv(host_params, config)
    repl = make_repl(a.tp)
    wrapped, step_fn, by_hand, _ = make_programs(repl, config, fused=False)
    state = place_state(repl, wrapped, host_params, config)
    batch = jax.device_put(batches[0], NamedSharding(repl.mesh, P("data")))
    gspmd = model_collectives(repl.explain(step_fn, state, batch).collectives)
    text = by_hand(state)[1].lower(state, batch).compile().as_text()
    megatron = model_collectives(hlo.analyze(text, dict(repl.mesh.shape)).collectives)
    act = 4 * (a.batch // repl.num_replicas) * a.seq * a.d_model
    return {"GSPMD": gspmd, "Megatron by hand": megatron, "megatron_bytes": 4 * a.layers * act}


def runners(repl, step_fn, hand_programs: dict, placed: list) -> dict:
    """``{name: run(state, k, start=0) -> (state, loss)}``: k steps of ``repl.run`` or of each
    hand-written program, at most ``IN_FLIGHT`` in flight, waited for at the end."""

    def run_repl(state, k, start=0):
        for i in range(start, start + k):
            state, out = repl.run(step_fn, state, placed[i % NUM_BATCHES])
        return jax.block_until_ready((state, out["loss"]))

    def hand(fn):
        def run(state, k, start=0):
            in_flight = collections.deque()
            for i in range(start, start + k):
                while len(in_flight) >= IN_FLIGHT:
                    in_flight.popleft().block_until_ready()
                state, loss = fn(state, placed[i % NUM_BATCHES])
                in_flight.append(loss)
            return jax.block_until_ready((state, loss))

        return run

    return {"repl.run": run_repl, **{n: hand(p) for n, p in hand_programs.items()}}


def compare(a, host_params, batches, report) -> dict:
    """Parts 3 and 4 on ``{"data": 8/T, "model": T}``: errors, collectives, step times;
    ``report`` is ``repl.explain``'s for ``repl.run``'s step on that mesh."""
    config = make_config(a)
    repl = make_repl(a.tp)
    wrapped, step_fn, by_hand, loss_fn = make_programs(repl, config)
    placed = [jax.device_put(b, NamedSharding(repl.mesh, P("data"))) for b in batches]
    mesh_shape = dict(repl.mesh.shape)
    state = place_state(repl, wrapped, host_params, config)
    compiled = {n: p.lower(state, placed[0]).compile() for n, p in zip(HAND, by_hand(state))}
    info = {"repl.run": (report.collectives, report.memory.temporaries)}
    for name, c in compiled.items():
        colls = hlo.analyze(c.as_text(), mesh_shape).collectives
        info[name] = (colls, int(c.memory_analysis().temp_size_in_bytes))
    programs = {
        n: {"model": model_collectives(colls), "by_axes": by_axes(colls), "temporaries": temps}
        for n, (colls, temps) in info.items()
    }

    fns = runners(repl, step_fn, compiled, placed)

    # Exactness: 3 SGD steps (the same programs with optax.sgd) against one device with the
    # whole batch, within TOL.
    sgd_wrapped, sgd_step, sgd_by_hand, _ = make_programs(repl, config, "sgd")
    sgd_state = lambda: place_state(repl, sgd_wrapped, host_params, config)
    sgd_fns = runners(repl, sgd_step, dict(zip(HAND, sgd_by_hand(sgd_state()))), placed)
    want = one_device(loss_fn, host_params, batches, 3, np.float32, "sgd")
    errors = {}
    for name, fn in sgd_fns.items():
        errors[name] = {"sgd": rel_err(fn(sgd_state(), 3)[0]["params"], want)}
        if not errors[name]["sgd"] <= TOL:  # also catches NaN
            sys.exit(f"tensor: ABORT, {name} differs from one device (SGD): {errors[name]}")

    # Adam, the timed programs: 3 steps against one device in fp32 and in fp64. Adam divides
    # each gradient by its own size, so elements whose gradient is near rounding level move by
    # rounding noise; the fp32 one-device run's own distance to fp64 is the yardstick. The key
    # bias, whose gradient is zero in exact arithmetic, is left out (its whole-leaf figure is
    # kept as "adam_with_key_bias").
    drop = functools.partial(without_key_bias, config=config)
    fp64 = drop(one_device(make_loss(config), host_params, batches, 3, np.float64))
    fp32_all = one_device(loss_fn, host_params, batches, 3, np.float32)
    fp32 = drop(fp32_all)
    floor = rel_err(fp32, fp64)
    errors["one device fp32"] = {"sgd": 0.0, "adam": 0.0, "adam_fp64": floor}
    states = {}
    for name, fn in fns.items():
        states[name], _ = fn(place_state(repl, wrapped, host_params, config), 3)
        got = drop(states[name]["params"])
        errors[name] |= {"adam": rel_err(got, fp32), "adam_fp64": rel_err(got, fp64)}
        errors[name]["adam_with_key_bias"] = rel_err(states[name]["params"], fp32_all)
        if not errors[name]["adam_fp64"] <= 2 * floor + TOL:  # also catches NaN
            sys.exit(f"tensor: ABORT, {name} differs from one device (Adam): {errors[name]}")
    specs = {n: [x.sharding.spec for x in jax.tree.leaves(s["params"])] for n, s in states.items()}
    same_layout = specs["repl.run"] == specs["GSPMD by hand"] == specs["Megatron by hand"]

    # Timing: the order rotated every round (and reversed every other).
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for n in names:  # warm-up
        states[n] = fns[n](states[n], a.steps)[0]
    for r in range(a.rounds):
        order = names[r % 3 :] + names[: r % 3]
        for n in order[:: 1 if r % 2 == 0 else -1]:
            t0 = time.perf_counter()
            states[n] = fns[n](states[n], a.steps, start=r)[0]
            times[n].append((time.perf_counter() - t0) / a.steps)
    return {
        "mesh": mesh_shape, "errors": errors, "same_layout": same_layout, "programs": programs,
        "median_s": {n: float(np.median(v)) for n, v in times.items()}, "per_step_s": times,
        "replica_batch": a.batch // repl.num_replicas,
    }  # fmt: skip


def boot_ratio(a: list[float], b: list[float]) -> tuple[float, float]:
    """A paired bootstrap 95% interval of median(a) / median(b) over rounds."""
    a, b = np.array(a), np.array(b)
    idx = np.random.default_rng(0).integers(0, len(a), size=(2000, len(a)))
    boot = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(lo), float(hi)


def kinds_text(m: dict) -> str:
    return ", ".join(f"{k} x{v:g}" for k, v in m["kinds"].items()) or "none"


def main() -> None:
    a = parse_args()
    if len(jax.devices()) != 8:
        sys.exit(f"tensor: expected 8 CPU devices, got {jax.devices()}")
    if a.d_model % a.heads or a.heads % 4 or a.batch % 8 or a.tp not in (2, 4):
        sys.exit("tensor: --heads must divide --d-model and divide by 4; --batch by 8; --tp 2 or 4")
    host_params = init_params(make_config(a))
    batches = make_batches(a)
    p_split, p_rep = split_counts(host_params)
    command = shlex.join(["python", *sys.argv])
    today = datetime.date.today().isoformat()
    t0 = time.perf_counter()
    print(
        f"{today}, jax {jax.__version__}, 8 CPU devices: `{command}`\n"
        f"`replicator.models.gpt`: {a.layers} layers, d_model {a.d_model}, {a.heads} heads, "
        f"d_ff {4 * a.d_model}, seq {a.seq}, vocab {a.vocab}, global batch {a.batch}, Adam fp32, "
        f"placed by `gpt.place` (`gpt.MEGATRON_RULES`); P_split = {p_split:,} parameters split "
        f"over `model`, P_rep = {p_rep:,} replicated\n"
    )
    kib = lambda n: f"{n / 2**10:.1f}"
    rows, reports = memory_and_collectives(a, host_params, batches)
    print(
        "**1. Memory per device** (KiB; params = grads = 4 (P_split/T + P_rep), "
        "Adam = 2 x params + its step count)\n"
    )
    print("| T | mesh | params | formula | grads | formula | Adam | formula | measured/formula |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        total = r["params"] + r["grads"] + r["opt"]
        r["ratio"] = total / (2 * r["params_formula"] + r["opt_formula"])
        mesh = ", ".join(f"{k}={v}" for k, v in r["mesh"].items())
        print(
            f"| {r['t']} | {mesh} | {kib(r['params'])} | {kib(r['params_formula'])} | "
            f"{kib(r['grads'])} | {kib(r['params_formula'])} | {kib(r['opt'])} | "
            f"{kib(r['opt_formula'])} | {r['ratio']:.4f} |"
        )
    sep = qkv_apart(a, host_params, batches)
    n = a.layers
    print(
        '\n**2. `model`-axis collectives per layer** (`repl.explain`, axes == ("model",); '
        "Megatron: 4 all-reduces of [B, S, d_model] per layer, 2 forward and 2 backward; "
        "'q, k, v apart': the GPT's qkv split into three weights, run by the benchmark's copy "
        "of the block)\n"
    )
    print(
        "| layout | T | B per replica | collectives per step | per layer | Megatron | "
        "KiB per layer | Megatron KiB | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = r["model"]
        ratio = f"{m['bytes'] / r['megatron_bytes']:.3f}" if r["t"] > 1 else "-"
        print(
            f"| GPT (fused qkv) | {r['t']} | {r['replica_batch']} | {kinds_text(m)} | "
            f"{m['count'] / n:g} | {r['megatron_count'] // n} | {kib(m['bytes'] / n)} | "
            f"{kib(r['megatron_bytes'] / n)} | {ratio} |"
        )
    b = a.batch // (8 // a.tp)
    for name in ("GSPMD", "Megatron by hand"):
        m = sep[name]
        print(
            f"| GPT, q, k, v apart: {name} | {a.tp} | {b} | {kinds_text(m)} | {m['count'] / n:g} | 4 | "
            f"{kib(m['bytes'] / n)} | {kib(sep['megatron_bytes'] / n)} | "
            f"{m['bytes'] / sep['megatron_bytes']:.3f} |"
        )

    c = compare(a, host_params, batches, reports[a.tp])
    med = {k: 1e3 * v for k, v in c["median_s"].items()}
    times = c["per_step_s"]
    cis = {
        n: boot_ratio(times[n], times["GSPMD by hand"]) for n in ("repl.run", "Megatron by hand")
    }
    mesh = ", ".join(f"{k}={v}" for k, v in c["mesh"].items())
    print(
        f"\n**3-4. The three programs on {{{mesh}}}** (the GPT's parameters placed by "
        f"`gpt.place`, B = {c['replica_batch']} per replica; `repl.run` and GSPMD by hand "
        "differentiate `gpt.loss`; Megatron by hand, the GPT's block written out again in the "
        "benchmark with f and g, since `gpt.block` has no place for them without a change to the "
        f"library; {a.rounds} rotated rounds x {a.steps} steps each; errors: the largest over "
        "parameters of max|x - y| / max|y| after 3 steps, against one device with the whole "
        "batch, the Adam ones without the key bias (its gradient is zero in exact arithmetic))\n"
    )
    print(
        "| program | ms/step (median) | / GSPMD by hand (95% CI) | SGD error vs 1 device | "
        "Adam error vs 1 device fp32 | vs fp64 | `model` collectives | `model` KiB | "
        "`data` KiB | temp KiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in times:
        p, e = c["programs"][name], c["errors"][name]
        ci = f" [{cis[name][0]:.3f}, {cis[name][1]:.3f}]" if name in cis else ""
        print(
            f"| {name} | {med[name]:.2f} | {med[name] / med['GSPMD by hand']:.3f}{ci} | "
            f"{e['sgd']:.1e} | {e['adam']:.1e} | {e['adam_fp64']:.1e} | "
            f"{kinds_text(p['model'])} | {kib(p['model']['bytes'])} | "
            f"{kib(p['by_axes'].get('data', 0))} | {kib(p['temporaries'])} |"
        )
    e = c["errors"]["one device fp32"]["adam_fp64"]
    print(f"| one device, fp32 (reference) | | | 0 | 0 | {e:.1e} | | | | |")
    r_run = med["repl.run"] / med["GSPMD by hand"]
    r_meg = med["Megatron by hand"] / med["GSPMD by hand"]
    verdict = "meets" if r_run <= TARGET else "MISSES"
    print(
        f"\nrepl.run / hand-written jit(shard_map(axis_names={{'data'}})): {r_run:.3f}; "
        f"{verdict} the target <= {TARGET}. Megatron by hand / GSPMD by hand: {r_meg:.3f}. "
        f"Same parameter shardings after training: {c['same_layout']}. "
        f"Total {time.perf_counter() - t0:.0f} s."
    )
    if a.json:
        results = dict(date=today, jax=jax.__version__, command=command, config=vars(a))
        results |= dict(p_split=p_split, p_rep=p_rep, memory_and_model=rows, separate_qkv=sep)
        results |= dict(compare=c, ratio_run=r_run, ratio_megatron=r_meg, cis=cis)
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
