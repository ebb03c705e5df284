"""Helpers shared by the oracle tests: random data, models, and relative comparison."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import replicator as rp
from replicator.models import MLP

GLOBAL_BATCH = 64
STEPS = 10
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}


def batches(n=STEPS, batch=GLOBAL_BATCH, seed=0, din=16, dout=4):
    """Random non-zero regression batches: y = tanh(x @ w) + noise."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(din, dout)).astype(np.float32)
    out = []
    for _ in range(n):
        x = rng.normal(size=(batch, din)).astype(np.float32)
        y = np.tanh(x @ w) + 0.1 * rng.normal(size=(batch, dout)).astype(np.float32)
        out.append({"x": x, "y": y.astype(np.float32)})
    return out


def rel_err(a, b) -> float:
    """The largest per-leaf ``max|a - b| / max|b|`` over two pytrees of the same structure."""
    errs = jax.tree.map(
        lambda x, y: float(
            np.max(np.abs(np.asarray(x) - np.asarray(y))) / (np.max(np.abs(np.asarray(y))) + 1e-30)
        ),
        a,
        b,
    )
    return max(jax.tree.leaves(errs))


# -- a plain-JAX MLP in a Flax TrainState ------------------------------------------------------


def torch_loss_and_grads(model, tokens, targets) -> tuple[float, dict]:
    """A transformers causal LM's mean next-token cross-entropy on ``tokens`` and the gradient
    of each of its parameters by name (torch's autograd): the reference for our models'."""
    import torch

    model.zero_grad()
    logits = model(input_ids=torch.from_numpy(tokens).long()).logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.from_numpy(targets).long().reshape(-1)
    )
    loss.backward()
    return loss.detach().item(), {name: p.grad for name, p in model.named_parameters()}


def decoder_sgd_steps(params, config, zero_stage: int, data, mesh_shape=None):
    """The decoder's parameters after SGD (lr 0.1) on each batch of ``data`` (``{"tokens",
    "targets"}``): ``(on the mesh, on one device)``, the mesh's ``{data: 2, model: 2}`` by
    default, its parameters placed as `gpt.place` places them (and ZeRO-3's split with
    ``zero_stage=3``); both as host arrays."""
    from replicator.models import gpt

    data = list(data)
    loss_fn = lambda p, b: gpt.loss(p, b["tokens"], b["targets"], config=config)
    p, tx = params, optax.sgd(0.1)
    opt, grad = tx.init(p), jax.jit(jax.value_and_grad(loss_fn))
    for batch in data:
        updates, opt = tx.update(grad(p, batch)[1], opt, p)
        p = optax.apply_updates(p, updates)
    mesh_shape = mesh_shape or {"data": 2, "model": 2}
    n = int(np.prod(list(mesh_shape.values())))
    repl = rp.Replicator(mesh_shape=mesh_shape, devices=jax.devices()[:n])
    mesh_tx = repl.wrap_optimizer(optax.sgd(0.1), zero_stage=zero_stage)
    placed = gpt.place(repl, params, config=config)
    if zero_stage == 3:
        placed = mesh_tx.shard_params(placed, stacked=gpt.zero_stacked(config))

    def step(state, batch):
        new, opt, _ = mesh_tx.step(loss_fn, state["params"], state["opt"], batch)
        return {"params": new, "opt": opt}, {}

    state = {"params": placed, "opt": mesh_tx.init(placed)}
    for batch in data:
        state, _ = repl.run(step, state, batch)
    is_sharded = lambda x: isinstance(x, rp.ShardedParam)
    host = lambda x: np.asarray(x.value if is_sharded(x) else x)
    return jax.tree.map(host, state["params"], is_leaf=is_sharded), jax.tree.map(np.asarray, p)


def mlp_params(seed=1, sizes=(16, 32, 4)):
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.full((b,), 0.1)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:])
    ]


def mlp_apply(params, x):
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def mlp_state(tx):
    return train_state.TrainState.create(apply_fn=mlp_apply, params=mlp_params(), tx=tx)


def mlp_step(state, batch):
    def loss_fn(params):
        return jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": rp.all_reduce(loss, "mean")}


# -- a Flax nnx model, split into a pytree state ------------------------------------------------


def nnx_parts(tx):
    model = MLP([16, 32, 32, 4], rngs=nnx.Rngs(3))
    graphdef, params = nnx.split(model, nnx.Param)
    state = {"params": params, "opt": tx.init(params)}

    def step(state, batch):
        def loss_fn(params):
            return jnp.mean((nnx.merge(graphdef, params)(batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt": opt}
        return new, {"loss": rp.all_reduce(loss, "mean")}

    return state, step


def make(model: str, tx):
    """``(initial_state, step_fn)`` for ``model`` in {"mlp", "nnx"}."""
    if model == "mlp":
        return mlp_state(tx), mlp_step
    return nnx_parts(tx)


def params_of(state):
    return state.params if hasattr(state, "params") else state["params"]


def single_device(model: str, tx, data):
    """The oracle: ``step_fn`` on one device with the full global batch, no replicator."""
    state, step = make(model, tx)
    step = jax.jit(step)
    losses = []
    for batch in data:
        state, out = step(state, batch)
        losses.append(float(out["loss"]))
    return state, losses


# -- a model for ZeRO-3: embedding, scanned layers, head -------------------------------------

D3 = 8  # per-layer leaves [8, 8] and [8] split over 8 replicas; the head's bias [4] kept whole


def zero3_params(seed=2):
    rng = np.random.default_rng(seed)
    return {
        "embed": {"w": (rng.normal(size=(16, D3)) / 4).astype(np.float32)},
        "layers": {
            "w": (rng.normal(size=(3, D3, D3)) / np.sqrt(D3)).astype(np.float32),
            "b": (0.1 * rng.normal(size=(3, D3))).astype(np.float32),
        },
        "head": {
            "w": (rng.normal(size=(D3, 4)) / np.sqrt(D3)).astype(np.float32),
            "b": (0.1 * rng.normal(size=(4,))).astype(np.float32),
        },
    }


def zero_split(shape, n=8, lead=0, taken=()):
    """ZeRO's documented rule, written out apart from the library: the first axis past
    ``lead`` and not in ``taken`` that divides by ``n``, or None."""
    free = [d for d in range(lead, len(shape)) if d not in taken and shape[d] % n == 0]
    return free[0] if free and n > 1 else None


def zero_spec(shape, n=8, lead=0, axis="data"):
    """The ``PartitionSpec`` of a leaf that ZeRO splits by `zero_split` (trailing Nones off)."""
    from jax.sharding import PartitionSpec

    d = zero_split(shape, n, lead)
    return PartitionSpec() if d is None else PartitionSpec(*([None] * d), axis)


def zero3_loss(params, batch):
    """The model, written once for plain and for ZeRO-3 parameters: gather_params passes plain
    arrays through, and all-gathers sharded ones, here one layer per scan iteration."""
    x = batch["x"] @ rp.gather_params(params["embed"])["w"]

    def layer(h, p):
        p = rp.gather_params(p)
        return jnp.tanh(h @ p["w"] + p["b"]), None

    h, _ = jax.lax.scan(layer, x, params["layers"])
    head = rp.gather_params(params["head"])
    return jnp.mean((h @ head["w"] + head["b"] - batch["y"]) ** 2)
