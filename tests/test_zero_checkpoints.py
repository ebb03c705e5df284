"""ZeRO checkpoints hold logical arrays: a state saved on one mesh restores onto any other mesh
and ZeRO stage, and training goes on equal to one device. A checkpoint in ZeRO's earlier flat
layout is converted on restore."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from oracle import rel_err
from test_pipeline import init_params, layer_fn, loss_fn, make_batch, oracle_loss
from test_tensor_parallel import TOL, tp_stage_specs, train_oracle

import replicator as rp
from replicator import pipeline

K = 2  # the model's stages: its layers stacked [K, L/K, ...], run in order where no `stage` axis
MESHES = {
    "3d": {"data": 2, "stage": 2, "model": 2},
    "dp": {"data": 8},
    "tp": {"data": 4, "model": 2},
}
BATCHES = [make_batch(32, seed=20 + i) for i in range(6)]

pytestmark = pytest.mark.slow


class Run:
    """The pipelined model with Adam under ``zero_stage`` on one mesh."""

    def __init__(self, mesh: str, zero_stage: int) -> None:
        shape = MESHES[mesh]
        self.repl = rp.Replicator(
            mesh_shape=shape, devices=jax.devices()[: math.prod(shape.values())]
        )
        self.zero3 = zero_stage == 3
        self.opt = self.repl.wrap_optimizer(optax.adam(1e-2), zero_stage=zero_stage)
        layer = (lambda p, h: layer_fn(rp.gather_params(p), h)) if self.zero3 else layer_fn
        self.f = pipeline.value_and_grad(
            pipeline.scan_layers(layer), loss_fn, num_microbatches=4, schedule=pipeline.OneFOneB()
        )

    def init(self) -> dict:
        params = init_params()
        stacked = pipeline.stack_stages(params["layers"], num_stages=K)
        placed = {
            "embed": self.repl.replicate(params["embed"]),
            "stages": self.repl.place(stacked, tp_stage_specs(stacked, 1)),
            "head": self.repl.replicate(params["head"]),
        }
        if self.zero3:  # the stage and layer axes are never split, with or without `stage`
            placed = self.opt.shard_params(placed, stacked={"stages": 2})
        return {"params": placed, "opt": self.opt.init(placed)}

    def train(self, state: dict, batches) -> dict:
        f, opt = self.f, self.opt

        def step(state, x, t):
            params = state["params"]
            h, embed_vjp = jax.vjp(lambda e: x @ rp.gather_params(e)["w"], params["embed"])
            head, head_vjp = jax.vjp(rp.gather_params, params["head"])
            _, (g_stages, g_h, g_head) = f(params["stages"], h, t, head)
            grads = {"embed": embed_vjp(g_h)[0], "stages": g_stages, "head": head_vjp(g_head)[0]}
            updates, opt_state = opt.update(grads, state["opt"], params)
            return {"params": optax.apply_updates(params, updates), "opt": opt_state}, {}

        for x, t in batches:
            state, _ = self.repl.run(step, state, x, t)
        return state


def host_params(state: dict) -> dict:
    """The trained parameters in `init_params`' layout, on the host."""
    params = jax.tree.map(
        lambda x: np.asarray(x.value if isinstance(x, rp.ShardedParam) else x),
        state["params"],
        is_leaf=lambda x: isinstance(x, rp.ShardedParam),
    )
    layers = pipeline.unstack_stages(params.pop("stages"))
    return {**params, "layers": layers}


@pytest.fixture(scope="module")
def oracle():
    return train_oracle(oracle_loss, init_params(), optax.adam(1e-2), BATCHES)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Three Adam steps on each mesh under ZeRO-1 and ZeRO-3, checkpointed."""
    root = tmp_path_factory.mktemp("zero_checkpoints")
    out = {}
    for zero_stage in (1, 3):
        for mesh in MESHES:
            run = Run(mesh, zero_stage)
            state = run.train(run.init(), BATCHES[:3])
            ckpt = rp.Checkpoints(root / f"z{zero_stage}-{mesh}")
            ckpt.save(3, state)
            ckpt.close()
            out[zero_stage, mesh] = root / f"z{zero_stage}-{mesh}"
    return out


CASES = [(z, src, dst) for z in (1, 3) for src in MESHES for dst in MESHES if src != dst] + [
    (1, "3d", ("dp", 3)),
    (3, "dp", ("3d", 1)),
]  # and onto another ZeRO stage


@pytest.mark.parametrize("zero_stage, src, dst", CASES)
def test_a_zero_state_restores_onto_another_mesh_and_trains_as_one_device(
    saved, oracle, zero_stage, src, dst
):
    """Saved after 3 steps on ``src``, restored on ``dst`` (a mesh, or a mesh and another ZeRO
    stage), 3 more steps: the parameters equal 6 steps on one device."""
    mesh, to_stage = dst if isinstance(dst, tuple) else (dst, zero_stage)
    run = Run(mesh, to_stage)
    like = run.init()
    ckpt = rp.Checkpoints(saved[zero_stage, src])
    state, record = ckpt.restore(like)
    ckpt.close()
    assert record["step"] == 3
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(like), strict=True):
        assert got.sharding == want.sharding and got.shape == want.shape
    state = run.train(state, BATCHES[3:])
    err = rel_err(host_params(state), oracle)
    print(f"rel_err {err:.2e}")  # shown with pytest -s
    assert err <= TOL, err


def test_a_checkpoint_in_the_flat_layout_is_converted_on_restore(tmp_path, oracle):
    """The flat layout of earlier ZeRO: ZeRO-1's Adam moments as [N * c] (a stage-split leaf
    by stage blocks, [K * N * c]), written here as it wrote them; restored into today's state,
    each leaf in its own shape, and training goes on as one device."""
    run = Run("3d", 1)
    state = run.train(run.init(), BATCHES[:3])
    n, k = 2, 2

    def flat(x, stage_split: bool):
        x = np.asarray(x)
        if not stage_split:
            c = math.ceil(x.size / n)
            return np.pad(x.ravel(), (0, n * c - x.size))
        blocks = np.split(x, k, axis=0)
        c = math.ceil(blocks[0].size / n)
        return np.concatenate([np.pad(b.ravel(), (0, n * c - b.size)) for b in blocks])

    mesh = run.repl.mesh
    legacy = {}
    for name in ("mu", "nu"):
        tree = getattr(state["opt"].inner[0], name)
        legacy[name] = {
            key: jax.tree.map(
                lambda x, key=key: jax.device_put(
                    flat(x, key == "stages"),
                    jax.sharding.NamedSharding(
                        mesh, P(("stage", "data")) if key == "stages" else P("data")
                    ),
                ),
                sub,
            )
            for key, sub in tree.items()
        }
    adam = state["opt"].inner[0]._replace(mu=legacy["mu"], nu=legacy["nu"])
    old = {
        "params": state["params"],
        "opt": state["opt"]._replace(inner=(adam, *state["opt"].inner[1:])),
    }
    ckpt = rp.Checkpoints(tmp_path)
    ckpt.save(3, old)
    restored, _ = ckpt.restore(run.init())
    ckpt.close()
    for got, want in zip(
        jax.tree.leaves(restored["opt"]), jax.tree.leaves(state["opt"]), strict=True
    ):
        assert got.shape == want.shape and got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    state = run.train(restored, BATCHES[3:])
    assert rel_err(host_params(state), oracle) <= TOL


def test_a_zero3_checkpoint_in_the_flat_layout_is_converted_on_restore(tmp_path):
    """ZeRO-3's flat parameters, a ShardedParam node holding [*lead, N * c] (saved under
    ``<path>.0``), restore into today's ShardedParams of their own shape."""
    run = Run("dp", 3)
    state = run.init()
    n = 8

    def flat(x, lead):
        x = np.asarray(x.value)
        rest = math.prod(x.shape[lead:])
        c = math.ceil(rest / n)
        y = np.pad(x.reshape((*x.shape[:lead], rest)), [(0, 0)] * lead + [(0, n * c - rest)])
        sharding = jax.sharding.NamedSharding(run.repl.mesh, P(*[None] * lead, "data"))
        return (jax.device_put(y, sharding),)  # a node with one child, saved as <path>.0

    leads = {"embed": 0, "stages": 2, "head": 0}
    old = {
        key: jax.tree.map(
            lambda x, lead=lead: flat(x, lead), state["params"][key],
            is_leaf=lambda x: isinstance(x, rp.ShardedParam),
        )
        for key, lead in leads.items()
    }  # fmt: skip
    ckpt = rp.Checkpoints(tmp_path)
    ckpt.save(1, {"params": old})
    restored, _ = ckpt.restore({"params": state["params"]})
    ckpt.close()
    for got, want in zip(
        jax.tree.leaves(restored["params"], is_leaf=lambda x: isinstance(x, rp.ShardedParam)),
        jax.tree.leaves(state["params"], is_leaf=lambda x: isinstance(x, rp.ShardedParam)),
        strict=True,
    ):
        assert isinstance(got, rp.ShardedParam) and got.dim == want.dim
        assert got.value.sharding == want.value.sharding
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value))


def test_a_leaf_of_another_shape_is_still_refused(tmp_path):
    ckpt = rp.Checkpoints(tmp_path)
    ckpt.save(1, {"w": jnp.ones((4, 6))})
    with pytest.raises(rp.StateMismatchError, match=r"\['w'\].*shape \(4, 6\).*\(4, 5\)"):
        ckpt.restore({"w": jnp.zeros((4, 5))})
    ckpt.close()
