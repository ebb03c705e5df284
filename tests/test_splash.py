"""attention='splash': the TPU's splash-attention kernel, exact against the reference.

Off a TPU the kernel runs in Pallas's interpreter: the same tiles and online softmax, so the
oracle (`attention.reference`, causal) checks the very code a TPU compiles. The GPT with it
trains on data x ZeRO-3, model and expert meshes exactly as on one device (the kernel mapped by
hand over the heads and sequences); a mesh that splits sequences (context), or heads or batches
an axis does not divide, is refused before a step runs; and the kernel compiles for a TPU on
model, expert and context axes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator._src.sharded import attention, splash
from replicator.models import gpt


def _qkv(kv_heads: int, seq: int = 256):
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (2, seq, 4, 128))
    k = jax.random.normal(keys[1], (2, seq, kv_heads, 128))
    v = jax.random.normal(keys[2], (2, seq, kv_heads, 128))
    return q, k, v


def _rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # multi-head, grouped, multi-query
def test_values_and_gradients_equal_the_reference(kv_heads):
    q, k, v = _qkv(kv_heads)
    assert _rel(splash.splash_attention(q, k, v), attention.reference(q, k, v, causal=True)) < 2e-6

    def grads(f):
        return jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2))(q, k, v)

    ours = grads(splash.splash_attention)
    ref = grads(lambda q, k, v: attention.reference(q, k, v, causal=True))
    for a, b in zip(ours, ref, strict=True):
        assert _rel(a, b) < 2e-6


def test_a_sequence_the_tiles_do_not_divide_is_refused():
    q, k, v = _qkv(4, seq=192)
    with pytest.raises(ValueError, match="multiple of 128"):
        splash.splash_attention(q, k, v)


def test_live_pairs_are_the_causal_tiles():
    assert splash.live_pairs(256) == 256 * 256  # one tile
    assert splash.live_pairs(2048) == 10 * 512 * 512  # 4 tiles a side: 10 on or below


def _model(attention_impl: str, d_model: int = 256, heads: int = 2) -> gpt.GPTConfig:
    return gpt.GPTConfig(d_model=d_model, num_heads=heads, num_kv_heads=heads // 2, num_layers=2,
                         seq_len=128, vocab_size=64, attention=attention_impl, norm="rms",
                         position="rope", mlp="swiglu", bias=False)  # fmt: skip


def _train(repl, config, zero_stage, steps=3, split=None):
    params = gpt.init(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, config.seq_len + 1), 0, 64)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    with repl.context():
        opt = repl.wrap_optimizer(optax.sgd(0.5), zero_stage=zero_stage)
        placed = repl.replicate(params)
        if zero_stage == 3:
            placed = opt.shard_params(placed, stacked=gpt.zero_stacked(config), split=split)
        state = {"params": placed, "opt": opt.init(placed)}
    loss_fn = lambda p, b: gpt.loss(p, b["tokens"], b["targets"], config=config)

    def step(state, batch):
        p, o, metrics = opt.step(loss_fn, state["params"], state["opt"], batch)
        return {"params": p, "opt": o}, metrics

    losses = []
    for _ in range(steps):
        state, out = repl.run(step, state, batch)
        losses.append(float(rp.local_row(out)["loss"]))
    return losses, jax.tree.map(np.asarray, rp.gather_params(state["params"]))


@functools.cache
def _one_device(attention_impl: str, d_model: int = 256, heads: int = 2):
    """Three SGD steps on one device, computed once a process: the oracle several tests share."""
    return _train(
        rp.Replicator(devices=jax.devices()[:1]), _model(attention_impl, d_model, heads), 0
    )


@pytest.mark.slow
@pytest.mark.parametrize("split", ["rows", "columns"])
def test_gpt_with_splash_on_data_x_zero3_equals_one_device_with_dot_product(split):
    """Splash attends heads first: the attention's ZeRO-3 parts are laid out ``[heads, head_dim,
    D]`` before their gather. By rows (256 wide, 2 heads of 128), each part is a quarter of
    ``D`` (q, k, v) or of a head (out: gathered first); by columns (512 wide, 4 heads), each
    part of q and out holds a head or a quarter of ``D``, and k's and v's half a head (gathered
    first). Every way equals one device."""
    sizes = (256, 2) if split == "rows" else (512, 4)
    one, _ = _one_device("dot_product", *sizes)
    many, params = _train(
        rp.Replicator(mesh_shape={"data": 4}, devices=jax.devices()[:4]), _model("splash", *sizes),
        3, split=None if split == "rows" else {"blocks": -1},
    )  # fmt: skip
    ref_losses, ref_params = _one_device("splash", *sizes)
    np.testing.assert_allclose(many, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(many, one, rtol=1e-5)  # the kernel is the reference's numbers
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_gpt_with_splash_on_a_mesh_naming_model_of_size_1_equals_one_device():
    """A ``model`` axis of size 1 is left to XLA: the kernel's call is mapped by hand over it
    (as the TPU needs, `splash._by_hand`), whole, and the steps equal one device's."""
    _trains_as_one_device({"data": 4, "model": 1})


def _trains_as_one_device(mesh_shape):
    """Three SGD steps of the splash GPT on 4 devices of ``mesh_shape`` equal one device's."""
    one, ref = _one_device("splash")
    repl = rp.Replicator(mesh_shape=mesh_shape, devices=jax.devices()[:4])
    many, params = _train(repl, _model("splash"), 0)
    np.testing.assert_allclose(many, one, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "mesh_shape",
    [
        {"data": 1, "model": 2, "expert": 2},
        pytest.param({"data": 2, "model": 4}, marks=pytest.mark.slow),
    ],
    ids=lambda m: "x".join(f"{a}{n}" for a, n in m.items()),
)
def test_splash_on_model_and_expert_axes_equals_one_device(mesh_shape):
    """The kernel's call mapped by hand: each device's heads (``model``; K/V heads that do not
    split are repeated for theirs first) and sequences (``expert``). Values and gradients equal
    the reference, GQA with 4 query heads and 2 key/value heads."""
    import math

    n = math.prod(mesh_shape.values())
    repl = rp.Replicator(mesh_shape=mesh_shape, devices=jax.devices()[:n])
    q, k, v = _qkv(2, seq=128)
    q, k, v = (jnp.concatenate([a, -a]) for a in (q, k, v))  # 4 sequences: 2 per expert
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    grad = lambda f: jax.value_and_grad(loss(f), argnums=(0, 1, 2))

    def step(state, q, k, v):
        return state, {
            "out": splash.splash_attention(q, k, v),
            "grads": grad(splash.splash_attention)(q, k, v)[1],
        }

    _, out = repl.run(step, {}, q, k, v)
    want = attention.reference(q, k, v, causal=True)
    ref = grad(lambda q, k, v: attention.reference(q, k, v, causal=True))(q, k, v)[1]
    rows = lambda x: np.concatenate(list(np.asarray(x)), 0)  # the replicas' rows, in order
    assert _rel(rows(out["out"]), want) < 2e-6
    for a, b in zip(out["grads"], ref, strict=True):
        assert _rel(rows(a), b) < 2e-6


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [{"data": 2, "model": 2}, {"data": 2, "expert": 2}])
def test_gpt_with_splash_on_model_or_expert_axes_equals_one_device(mesh_shape):
    """Three SGD steps of the GPT with splash (heads first) on a mesh that splits its heads
    (``model``) or its sequences (``expert``) equal one device's."""
    _trains_as_one_device(mesh_shape)


@pytest.mark.parametrize(
    "mesh_shape, match",
    [
        ({"data": 2, "context": 2}, "the mesh's 'context' axis of 2 devices splits them"),
        ({"data": 1, "model": 4}, "the mesh's 'model' axis of 4 devices does not divide 2 heads"),
        (
            {"data": 1, "expert": 4},
            "the mesh's 'expert' axis of 4 devices does not divide a batch of 2",
        ),
    ],
)
def test_splits_the_kernel_cannot_run_on_are_refused_before_a_step(mesh_shape, match):
    """Whole sequences on each device (no ``context``), and heads or batches the ``model`` or
    ``expert`` axis divides: anything else would gather the batch to every device (the TPU
    compiler refuses it)."""
    import math

    n = math.prod(mesh_shape.values())
    repl = rp.Replicator(mesh_shape=mesh_shape, devices=jax.devices()[:n])
    q, k, v = (a[:, :, :2] for a in _qkv(2, seq=128))  # 2 heads
    q, k, v = (jnp.concatenate([a] * mesh_shape["data"]) for a in (q, k, v))
    step = lambda s, q, k, v: (s, {"o": rp.all_reduce(jnp.sum(splash.splash_attention(q, k, v)))})
    with pytest.raises(ValueError, match=match):
        repl.run(step, repl.replicate(jnp.zeros(())), q, k, v)


@pytest.mark.slow  # one TPU compile each, 15-40 s
@pytest.mark.parametrize(
    "config, overrides, target",
    [  # splash over model x expert; ring blocks (heads of 128) over context
        ("mixtral_tiny", ["model.attention=splash", "model.seq_len=128"], "v5p-16"),
        (
            "llama_tiny",
            [
                "model.attention=ring",
                "model.d_model=256",
                "model.heads=2",
                "model.kv_heads=1",
                "model.seq_len=512",
                "mesh.data=2",
                "mesh.model=1",
                "mesh.context=2",
            ],
            "v5p-8",
        ),
    ],
    ids=["splash-model-expert", "ring-context"],
)
def test_the_kernel_compiles_for_a_tpu_on_model_expert_and_context_axes(
    config, overrides, target, monkeypatch
):
    """The TPU compiles a Pallas kernel only where every mesh axis is manual: the kernel's calls
    are mapped by hand over ``model``, ``expert`` and ``context``, and the program carries their
    FLOPs (`splash.KERNEL_FLOPS`). Read without those names, as another library's program
    would be, the kernels' FLOPs from their shapes (`pallas_kernels.untagged_flops`) are the
    same."""
    import pathlib
    import re

    from replicator._src.report import hlo
    from replicator.cli import config as config_lib
    from replicator.cli import jobs

    root = pathlib.Path(__file__).resolve().parents[1]
    cfg = config_lib.load(root / "configs" / f"{config}.yaml", overrides)
    repl, step_fn, state, batch = jobs.abstract_job(cfg, devices=rp.tpu_devices(target))
    texts, analyze = [], hlo.analyze
    monkeypatch.setattr(
        hlo, "analyze", lambda text, *a, **k: texts.append(text) or analyze(text, *a, **k)
    )
    report = repl.explain(step_fn, state, batch)
    assert report.platform == "tpu" and report.kernel_flops > 0
    unnamed = analyze(re.sub(r"replicator_kernel_flops_\d+", "kernel", texts[-1]), report.mesh)
    # the same but for the experts' weight gradient (megablox's tgmm), whose rows the kernel
    # pads to its tile: 2,560 of 2,152 here
    same = 1.05 if config == "mixtral_tiny" else 1.0
    assert report.kernel_flops <= unnamed.kernel_flops <= same * report.kernel_flops
