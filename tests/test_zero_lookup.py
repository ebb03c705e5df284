"""ZeRO-3's embedding lookup (`sharded_params.take_rows`): a token table stored split over the
replicas, by rows or by columns, is looked up on each replica's part without being gathered,
and three SGD steps equal one device's ``table[tokens]``, JAX's index rules included (negative
tokens count from the end, others are clamped)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from oracle import rel_err

import replicator as rp
from replicator._src.core.sharded_params import take_rows

V, D, S = 48, 16, 5


def loss_fn(params, batch, dtype=None):
    x = take_rows(params["table"], batch["tokens"], dtype).astype(jnp.float32)
    return jnp.mean(jnp.tanh(x @ rp.gather_params(params["w"])) * batch["y"])


def batches(b, n=3):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tokens = rng.integers(-V, V + 8, size=(b, S)).astype(np.int32)  # some out of [0, V)
        out.append({"tokens": tokens, "y": rng.normal(size=(b, S, 4)).astype(np.float32)})
    return out


def init():
    k1, k2 = jax.random.split(jax.random.key(1))
    return {"table": jax.random.normal(k1, (V, D)), "w": jax.random.normal(k2, (D, 4))}


def one_device(dtype, b):
    params, tx = init(), optax.sgd(0.5)
    opt, losses = tx.init(params), []
    for batch in batches(b):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, dtype)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return params, np.array(losses)


# 8 sequences: 10 tokens a replica, 40 in all, fewer than the 48 rows: looked up in the parts;
# 48 sequences: 60 a replica, more than the rows: the table is gathered (that moves less)
@pytest.mark.parametrize("b", [8, 48])
@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
@pytest.mark.parametrize("split", [None, {"table": -1}], ids=["rows", "columns"])
def test_a_table_split_by_rows_or_columns_is_looked_up_as_on_one_device(split, dtype, b):
    repl = rp.Replicator(mesh_shape={"data": 4}, devices=jax.devices()[:4])
    tx = repl.wrap_optimizer(optax.sgd(0.5), zero_stage=3)
    params = tx.shard_params(repl.replicate(init()), split=split)
    assert params["table"].dim == (-2 if split is None else -1)

    def step(state, batch):
        p, opt, metrics = tx.step(lambda p, b: loss_fn(p, b, dtype), state["p"], state["o"], batch)
        return {"p": p, "o": opt}, {"loss": metrics["loss"]}

    state, losses = {"p": params, "o": tx.init(params)}, []
    for batch in batches(b):
        state, out = repl.run(step, state, batch)
        losses.append(float(np.asarray(out["loss"])[0]))
    want, want_losses = one_device(dtype, b)
    got = jax.tree.map(
        lambda p: np.asarray(p.value if isinstance(p, rp.ShardedParam) else p),
        state["p"], is_leaf=lambda x: isinstance(x, rp.ShardedParam),
    )  # fmt: skip
    tol = 1e-5 if dtype is None else 1e-2
    for name in ("table", "w"):
        assert rel_err(got[name], np.asarray(want[name])) <= tol, name
    assert rel_err(np.array(losses), want_losses) <= tol, (losses, want_losses)
    assert rel_err(got["table"], init()["table"]) > 1e-3  # the lookup's gradient reached it


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
@pytest.mark.parametrize("limit, chunks", [(4 * 2 * 128 * 4, 5), (1, 10)])
def test_a_large_lookup_by_columns_in_chunks_is_exact(monkeypatch, limit, chunks, dtype):
    """Over `LOOKUP_CHUNK_BYTES` a column-split lookup scans chunks of every replica's rows
    (here 4 replicas' 10 rows of 4 columns, 20 KiB padded to 128 lanes in fp32: in 5 chunks of
    8 rows, or 10 of 4)."""
    from replicator._src.core import sharded_params

    monkeypatch.setattr(sharded_params, "LOOKUP_CHUNK_BYTES", limit)
    assert sharded_params.lookup_chunks(rows=40, columns=D // 4, n=10) == chunks
    test_a_table_split_by_rows_or_columns_is_looked_up_as_on_one_device({"table": -1}, dtype, 8)


def test_on_one_device_it_is_indexing():
    table = jnp.arange(12.0).reshape(6, 2)
    tokens = jnp.array([[0, 5, -1, -7, 9]])
    np.testing.assert_array_equal(take_rows(table, tokens), table[tokens])
    assert take_rows(table, tokens, jnp.bfloat16).dtype == jnp.bfloat16
