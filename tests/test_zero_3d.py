"""ZeRO on 3-D meshes: the optimizer state of pipeline stage blocks and of `model`-split
parameters sharded over `data` as well, each against one device with the full batch; per-device
bytes against the ZeRO formulas divided by K (stage) and T (model); what is still refused."""

import math

import jax
import numpy as np
import optax
import pytest
from cases import pairwise
from jax.sharding import PartitionSpec as P
from oracle import rel_err, zero_split
from test_pipeline import (
    D_IN,
    D_OUT,
    SCHEDULES,
    D,
    from_pipeline,
    init_params,
    layer_fn,
    loss_fn,
    make_batch,
    oracle_loss,
    pipelined_grads,
)
from test_tensor_parallel import (
    MLP_SPECS,
    OPTIMIZERS,
    TOL,
    make_repl,
    mlp_batch,
    mlp_loss,
    mlp_params,
    tp_stage_specs,
    train_mlp,
    train_oracle,
)

import replicator as rp
from replicator import pipeline


def flat_with_path(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def device_bytes(x) -> int:
    return x.addressable_shards[0].data.nbytes


def state_leaves(opt_state):
    """The non-scalar leaves of a ZeRO optimizer state, with their paths."""
    flat = flat_with_path(opt_state.inner)
    return [(jax.tree_util.keystr(k), x) for k, x in flat if x.ndim and x.size > 1]


def pipeline_step(wrapped, grads):
    def step(state, x, t):
        loss, g = grads(state["params"], x, t)
        updates, opt = wrapped.update(g, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, {"loss": rp.all_reduce(loss, "mean")}

    return step


def placed_pipeline(repl, params, v, *, k=4, model=False):
    """The stage layers split over `stage` (and, with ``model``, their last dimension over
    `model`); the embedding and the head replicated."""
    stacked = pipeline.stack_stages(params["layers"], num_stages=k, repeats=v)
    specs = tp_stage_specs(stacked, v) if model else pipeline.stage_spec(v)
    return {
        "embed": repl.replicate(params["embed"]),
        "stages": repl.place(stacked, specs),
        "head": repl.replicate(params["head"]),
    }


def train_pipeline(
    repl, wrapped, tx, name, *, zero3=False, check=None, model=False, stacked=False,
    scatter_grads="microbatch",
):  # fmt: skip
    """Three steps of the pipelined model with ``wrapped`` on ``repl``, and the same steps of
    ``tx`` on one device: ``(state, placed, got, want)``, ``got`` and ``want`` as `init_params`.
    With ``zero3`` the parameters are stored with ``shard_params`` and gathered where used
    (their stage gradients reduce-scattered as ``scatter_grads`` says).
    With ``stacked`` the one-device run keeps the stage layers stacked as the pipeline does
    (``[K, L/K, ...]``), for a ``tx`` that depends on the leaves' shapes (Adafactor factors a
    leaf's two largest axes)."""
    schedule, v = {**SCHEDULES, "zerobubble": (pipeline.ZeroBubble(), 1)}[name]
    layer = (lambda p, h: layer_fn(rp.gather_params(p), h)) if zero3 else layer_fn
    f = pipeline.value_and_grad(
        pipeline.scan_layers(layer), loss_fn, num_microbatches=4, schedule=schedule,
        scatter_grads=scatter_grads,
    )  # fmt: skip
    grads = zero3_pipelined_grads(f) if zero3 else pipelined_grads(f)
    params = init_params()
    placed = placed_pipeline(repl, params, v, k=repl.mesh.shape["stage"], model=model)
    stored = wrapped.shard_params(placed) if zero3 else placed
    state = {"params": stored, "opt": wrapped.init(stored)}
    batches = [make_batch(16, seed=10 + i) for i in range(3)]
    for x, t in batches:
        state, _ = repl.run(pipeline_step(wrapped, grads), state, x, t)
    trained = unshard(state["params"], placed) if zero3 else state["params"]
    if stacked:  # the same model on one device, its layers in the pipeline's stacked shape
        k = repl.mesh.shape["stage"]
        layout = {
            "embed": params["embed"],
            "stages": pipeline.stack_stages(params["layers"], num_stages=k, repeats=v),
            "head": params["head"],
        }

        def loss(p, x, t):
            layers = pipeline.unstack_stages(p["stages"], repeats=v)
            return oracle_loss({**p, "layers": layers}, x, t)

        want = train_oracle(loss, layout, tx, batches)
        got = jax.tree.map(np.asarray, trained)
        params = layout
    else:
        want = train_oracle(oracle_loss, params, tx, batches)
        got = from_pipeline(trained, v)
    err = rel_err(got, want)
    print(f"rel_err {err:.2e}")  # shown with pytest -s
    assert err <= TOL, err
    assert rel_err(got, params) > 1e-2  # training moved them
    if check is not None:  # a step_fn that must be refused, on the trained state
        check(state, grads)
    return state, placed


def zero3_pipelined_grads(f):
    """`pipelined_grads` on ZeRO-3 parameters: the embedding and head gathered where they are
    used, each layer gathered inside the layer scan (in ``f``)."""

    def grads(params, x, t):
        h, embed_vjp = jax.vjp(lambda e: x @ rp.gather_params(e)["w"], params["embed"])
        head, head_vjp = jax.vjp(rp.gather_params, params["head"])
        loss, (g_stages, g_h, g_head) = f(params["stages"], h, t, head)
        (g_embed,) = embed_vjp(g_h)
        (g_head,) = head_vjp(g_head)
        return loss, {"embed": g_embed, "stages": g_stages, "head": g_head}

    return grads


def unshard(tree, like):
    """ZeRO-3 parameters as host arrays: each is stored in its own shape, as ``like``'s."""
    out = jax.tree.map(
        lambda p: np.asarray(p.value), tree, is_leaf=lambda x: isinstance(x, rp.ShardedParam)
    )
    assert jax.tree.map(np.shape, out) == jax.tree.map(np.shape, like)
    return out


def rule_bytes(shape, spec, n, *, model=4, lead=0):
    """Bytes on one device of an fp32 leaf of ``shape`` placed with ``spec`` (over `model` of
    size ``model``) once ZeRO splits it by its documented rule: its first axis past ``lead``
    not split already that divides by the ``n`` replicas (none: whole on each)."""
    taken = {d for d, e in enumerate(spec) if e is not None}
    d = zero_split(shape, n, lead, taken)
    parts = [n if i == d else model if i in taken else 1 for i in range(len(shape))]
    return 4 * math.prod(s // p for s, p in zip(shape, parts))


@pytest.mark.parametrize(
    "name, opt, zero_stage",
    pairwise(name=["gpipe", "1f1b", "circular"], opt=list(OPTIMIZERS), zero_stage=[1, 2]),
)
@pytest.mark.slow
def test_zero_x_pp_trains_as_one_device_with_1_over_kd_of_the_state(name, opt, zero_stage):
    """{"data": 2, "stage": 4}: the state of each stage block is flattened and split over the
    two replicas (1/(K*D) of the leaf per device), that of the embedding and head over the
    replicas (1/D); three steps equal one device with the full batch."""
    repl = make_repl({"data": 2, "stage": 4})
    tx = OPTIMIZERS[opt]()
    state, placed = train_pipeline(repl, repl.wrap_optimizer(tx, zero_stage=zero_stage), tx, name)
    leaves = state_leaves(state["opt"])
    assert len(leaves) == (0 if opt == "sgd" else 2 * 4)  # mu and nu of 4 parameters
    sizes = {jax.tree_util.keystr(k): a.size for k, a in flat_with_path(placed)}
    for path, x in leaves:
        size = next(s for k, s in sizes.items() if path.endswith(k))
        split = 8 if "stages" in path else 2  # K * D for stage blocks, D for the rest
        assert device_bytes(x) == math.ceil(size / split) * 4, (path, x.shape, x.sharding)


@pytest.mark.parametrize("where", ["option", "chain"])
@pytest.mark.slow
def test_zero_x_pp_clips_by_the_norm_of_the_whole_gradient(where):
    """Global-norm clipping with ZeRO-1 under a pipeline, as wrap_optimizer's option and inside
    the optax chain (run on the slices): the squares of each stage block's slices are summed
    over the replicas and the stages, those of the embedding and head over the replicas."""
    repl = make_repl({"data": 2, "stage": 4})
    max_norm = 0.01
    tx = optax.chain(optax.clip_by_global_norm(max_norm), optax.adam(1e-2))
    if where == "option":
        wrapped = repl.wrap_optimizer(optax.adam(1e-2), zero_stage=1, clip_global_norm=max_norm)
    else:
        wrapped = repl.wrap_optimizer(tx, zero_stage=1)
    for i in range(3):
        x, t = make_batch(16, seed=10 + i)
        assert float(optax.tree.norm(jax.grad(oracle_loss)(init_params(), x, t))) > 4 * max_norm

    def refused(state, grads):
        def no_params(state, x, t):  # the slices cannot tell stage blocks from whole leaves
            _, g = grads(state["params"], x, t)
            updates, opt = wrapped.update(g, state["opt"])
            return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {}

        with pytest.raises(
            ValueError, match=r"(?s)(zero_stage=1|clip_global_norm).*stage.*state\[.params.\]"
        ):
            repl.run(no_params, state, *make_batch(16))

    train_pipeline(repl, wrapped, tx, "1f1b", check=refused)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_zero_x_tp_trains_as_one_device_with_1_over_dt_of_the_state(opt):
    """{"data": 2, "model": 4}: the Megatron MLP with ZeRO-1; the state of every parameter is
    split over the 2 replicas and the 4 devices of `model` (1/8 per device)."""
    repl = make_repl({"data": 2, "model": 4})
    tx = OPTIMIZERS[opt]()
    state, _, params, want = train_mlp(repl, repl.wrap_optimizer(tx, zero_stage=1), tx)
    got = jax.tree.map(np.asarray, state["params"])
    err = rel_err(got, want)
    print(f"rel_err {err:.2e}")  # shown with pytest -s
    assert err <= TOL, err
    assert rel_err(got, params) > 1e-2
    assert state["params"]["w1"].sharding.spec == P(None, "model")  # the layout is kept
    for path, x in state_leaves(state["opt"]):  # 1/(D T) where an axis is free to split
        key = path.split("'")[-2]
        shape, spec = params[key].shape, tuple(MLP_SPECS[key])
        assert device_bytes(x) == rule_bytes(shape, spec, 2), (path, x.shape)
    if opt == "adam":
        assert device_bytes(state["opt"].inner[0].mu["w1"]) == 4 * 12 * 32 // 8


@pytest.mark.parametrize(
    "zero_stage, scatter_grads", [(1, "microbatch"), (3, "microbatch"), (3, "step")]
)
@pytest.mark.slow
def test_zero_x_pp_x_tp_trains_as_one_device(zero_stage, scatter_grads):
    """{"data": 2, "stage": 2, "model": 2}, 1F1B, Adam: stage layers split over `stage` and,
    inside a stage, over `model`; ZeRO-1's state (ZeRO-3's parameters too) of a stage block is
    1/(K*D*T) of the leaf per device. ZeRO-3's stage gradients summed whole (each device its
    `model` part) and reduce-scattered once a step equal it too."""
    repl = make_repl({"data": 2, "stage": 2, "model": 2})
    tx = optax.adam(1e-2)
    wrapped = repl.wrap_optimizer(tx, zero_stage=zero_stage)
    state, placed = train_pipeline(
        repl, wrapped, tx, "1f1b", zero3=zero_stage == 3, model=True, scatter_grads=scatter_grads
    )
    w, mu = state["params"]["stages"]["w"], state["opt"].inner[0].mu["stages"]["w"]
    stored = [mu] if zero_stage < 3 else [w.value, mu.value]
    for x in stored:
        assert device_bytes(x) == 4 * placed["stages"]["w"].size // 8, x.sharding


def test_zero3_x_tp_trains_as_one_device_with_1_over_dt_of_the_parameters():
    """{"data": 2, "model": 4}, ZeRO-3: each parameter stored flat over `data` and `model`
    (1/8 per device), gathered in the forward pass; Adam, three steps equal one device."""
    repl = make_repl({"data": 2, "model": 4})
    tx = optax.adam(1e-2)
    wrapped = repl.wrap_optimizer(tx, zero_stage=3)

    def step(state, x, t):
        def loss(p):
            return mlp_loss(rp.gather_params(p), x, t)

        g = jax.grad(loss)(state["params"])
        updates, opt_state = wrapped.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, {}

    params = mlp_params()
    stored = wrapped.shard_params(repl.place(params, MLP_SPECS))
    state = {"params": stored, "opt": wrapped.init(stored)}
    batches = [mlp_batch(16, seed=10 + i) for i in range(3)]
    for x, t in batches:
        state, _ = repl.run(step, state, x, t)
    want = train_oracle(mlp_loss, params, tx, batches)
    got = {k: np.asarray(p.value) for k, p in state["params"].items()}
    err = rel_err(got, want)
    print(f"rel_err {err:.2e}")  # shown with pytest -s
    assert err <= TOL, err
    for k, p in state["params"].items():  # 1/(D T) where an axis is free to split, else 1/T
        spec = tuple(MLP_SPECS[k])
        assert device_bytes(p.value) == rule_bytes(params[k].shape, spec, 2), k
    assert device_bytes(state["params"]["w1"].value) == 4 * 12 * 32 // 8


ZERO3_PIPELINES = [
    # each schedule once with the gradients scattered per micro-batch, the optimizers alternating
    ("gpipe", "sgd", "microbatch"),
    ("1f1b", "adam", "microbatch"),
    ("circular", "adam", "microbatch"),
    *((name, "sgd", "step") for name in ("gpipe", "circular", "1f1b", "interleaved", "zerobubble")),
]


@pytest.mark.parametrize("name, opt, scatter_grads", ZERO3_PIPELINES)
@pytest.mark.slow
def test_zero3_x_pp_trains_as_one_device_with_1_over_kd_of_the_parameters(name, opt, scatter_grads):
    """{"data": 2, "stage": 4}, ZeRO-3: each stage's layers stored flat layer by layer over the
    replicas (1/(K*D) of a stage leaf per device), gathered one layer at a time inside the
    layer scan; three steps equal one device with the full batch, with the stage gradients
    reduce-scattered in each micro-batch's backward pass or summed whole and reduce-scattered
    once a step (``scatter_grads="step"``)."""
    repl = make_repl({"data": 2, "stage": 4})
    tx = OPTIMIZERS[opt]()
    wrapped = repl.wrap_optimizer(tx, zero_stage=3)
    state, placed = train_pipeline(repl, wrapped, tx, name, zero3=True, scatter_grads=scatter_grads)
    flats = dict(flat_with_path(state["params"]))
    sizes = {jax.tree_util.keystr(k): a.size for k, a in flat_with_path(placed)}
    for path, x in flats.items():
        key = jax.tree_util.keystr(path[:-1])  # without the ShardedParam's .flat
        layer = {"['stages']['w']": D * D, "['stages']['b']": D}.get(key)
        if layer is None:  # the embedding and the head: 1/D each
            assert device_bytes(x) == 4 * math.ceil(sizes[key] / 2), key
        else:  # a stage's 16 / K layers, each split over the D replicas: 1/(K D)
            assert device_bytes(x) == 4 * (16 // 4) * math.ceil(layer / 2), key
            assert device_bytes(x) == 4 * sizes[key] // 8, key
    for path, x in state_leaves(state["opt"]):
        assert device_bytes(x) in {device_bytes(f) for f in flats.values()}, path


@pytest.mark.parametrize(
    "scatter_grads", [pytest.param("microbatch", marks=pytest.mark.slow), "step"]
)
def test_zero3_x_pp_scatter_grads_step_reduce_scatters_each_gradient_once_a_step(scatter_grads):
    """1F1B, ZeRO-3 on {"data": 2, "stage": 4}, M = 4, read from the compiled step: with
    scatter_grads="step" the reduce-scatters over `data` carry each gradient a device holds
    once (its stage's layers, the embedding, the head: whole over the replicas), where
    "microbatch" scatters the stage's once per micro-batch; `explain` lists the whole stage
    gradients the step holds, as found in the program's loops."""
    repl = make_repl({"data": 2, "stage": 4})
    wrapped = repl.wrap_optimizer(optax.sgd(0.1), zero_stage=3)
    f = pipeline.value_and_grad(
        pipeline.scan_layers(lambda p, h: layer_fn(rp.gather_params(p), h)), loss_fn,
        num_microbatches=4, schedule=pipeline.OneFOneB(), scatter_grads=scatter_grads,
    )  # fmt: skip
    stored = wrapped.shard_params(placed_pipeline(repl, init_params(), 1))
    state = {"params": stored, "opt": wrapped.init(stored)}
    step = pipeline_step(wrapped, zero3_pipelined_grads(f))
    report = repl.explain(step, state, *make_batch(16), stage_costs=False)
    scattered = report.bytes_by(kind="reduce-scatter", axes=("data",))
    stage = 4 * (16 // 4) * (D * D + D)  # a stage's 4 layers, whole, fp32
    other = 4 * (D_IN * D + D * D_OUT)  # the embedding and the head
    (note,) = report.pipelines
    if scatter_grads == "microbatch":
        assert scattered == 4 * stage + other and note.held_bytes is None
        return
    assert scattered == stage + other
    assert note.held_bytes == (stage, 0)
    assert "of which stage gradients, summed whole over the micro-batches (1f1b)" in str(report)


def test_zero3_with_stage_blocks_not_stored_sharded_is_refused_with_the_fix():
    repl = make_repl({"data": 2, "stage": 4})
    wrapped = repl.wrap_optimizer(optax.adam(1e-2), zero_stage=3)
    placed = placed_pipeline(repl, init_params(), 1)
    stored = {**wrapped.shard_params({k: placed[k] for k in ("embed", "head")})}
    stored["stages"] = placed["stages"]
    with pytest.raises(
        ValueError,
        match=r"wrap_optimizer\(zero_stage=3\): parameter \['stages'\]\['b'\] is split over "
        r"'stage' .*not stored sharded.*opt\.shard_params\(params\).*scan_layers",
    ):
        wrapped.init(stored)


def test_zero_with_data_sharded_parameters_is_refused_with_the_fix():
    repl = make_repl({"data": 2, "stage": 4})
    x = repl.place(np.ones((8, 4), np.float32), P("data"))
    with pytest.raises(
        ValueError,
        match=r"wrap_optimizer\(zero_stage=1\): parameter \['w'\] is sharded as .*over the "
        r"replica axes \['data'\].*'stage'/'model' only.*zero_stage=3",
    ):
        repl.wrap_optimizer(optax.adam(1e-3), zero_stage=1).init({"w": x})


def test_a_transformation_with_no_rule_on_parts_gathers_stage_blocks_too():
    """A sort over every element of a leaf has no rule on parts: on a stage block it gathers
    the parts over `data` and over `stage` into the whole leaf (the warning names it), and
    three steps equal one device."""
    from test_zero_any_tx import clip_by_quantile

    repl = make_repl({"data": 2, "stage": 4})
    tx = clip_by_quantile(1e-2)
    wrapped = repl.wrap_optimizer(tx, zero_stage=1)
    with pytest.warns(UserWarning, match=r"zero_stage=1.*gathered for each step.*reshape"):
        train_pipeline(repl, wrapped, tx, "1f1b")


@pytest.mark.parametrize("zero_stage", [1, 3])
@pytest.mark.slow
def test_factored_adafactor_on_stage_blocks_trains_as_one_device(zero_stage):
    """Adafactor factoring each stage layer's [8, 8] matrix: its row and column statistics
    are per layer, so a stage block's are the block of the whole leaf's; on the parts, with
    nothing gathered, and equal to one device."""
    repl = make_repl({"data": 2, "stage": 4})
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=4)
    wrapped = repl.wrap_optimizer(tx, zero_stage=zero_stage)
    placed = placed_pipeline(repl, init_params(), 1)
    stored = wrapped.shard_params(placed) if zero_stage == 3 else placed
    assert wrapped.plan(stored).on_shards
    train_pipeline(repl, wrapped, tx, "1f1b", zero3=zero_stage == 3, stacked=True)


def gpt_explain(mesh, zero_stage, *, policy=True):
    """``repl.explain`` of the GPT's Adam step on ``mesh`` under ``zero_stage``, from shapes;
    ``policy=False`` scans the blocks without `rp.regather_policy` (weights kept)."""
    from replicator.models import gpt

    config = gpt.GPTConfig(vocab_size=128, seq_len=32, d_model=64, num_heads=4, num_layers=2)
    repl = make_repl(mesh)
    opt = repl.wrap_optimizer(optax.adam(1e-3), zero_stage=zero_stage)

    def init():
        params = gpt.place(repl, gpt.init(config, jax.random.key(0)), config=config)
        if zero_stage == 3:
            params = opt.shard_params(params, stacked=["blocks"])
        return {"params": params, "opt": opt.init(params)}

    def loss_fn(p, b):
        if policy:
            return gpt.loss(p, b["tokens"], b["targets"], config=config)
        x = gpt.embed(p["embed"], b["tokens"])
        x, _ = jax.lax.scan(lambda h, q: (gpt.block(q, h, config=config), None), x, p["blocks"])
        return gpt.head_loss(p["head"], x, b["targets"])

    def step(state, batch):
        params, opt_state, metrics = opt.step(loss_fn, state["params"], state["opt"], batch)
        return {"params": params, "opt": opt_state}, metrics

    shape = jax.ShapeDtypeStruct((16, 32), np.int32)
    state = repl.abstract(init)
    report = repl.explain(step, state, {"tokens": shape, "targets": shape})
    return report, state


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [{"data": 2, "model": 4}])  # T = 4: a whole weight is 4x
def test_fsdp_x_tp_computes_each_product_once_and_moves_no_weight_over_model(mesh):
    """Read from the compiled programs: ZeRO-3 x TP does tensor parallelism's matmul FLOPs
    (a weight gathered whole on every `model` device would multiply them by T), moves nothing
    over `model` but TP's activations, and its data-axis volume is the ZeRO paper's: under
    3 Psi_T words with each layer gathered again backward, 2 Psi_T with the weights kept."""
    tp, tp_state = gpt_explain(mesh, 0)
    fsdp, _ = gpt_explain(mesh, 3)
    kept, _ = gpt_explain(mesh, 3, policy=False)
    zero1, _ = gpt_explain(mesh, 1)
    for report in (fsdp, kept, zero1):
        assert report.matmul_flops <= 1.001 * tp.matmul_flops, report.matmul_flops / tp.matmul_flops
        assert report.bytes_by(kind="all-gather", axes=("model",)) == 0
        assert report.bytes_by(axes=("model",)) == tp.bytes_by(axes=("model",))
    psi_t = sum(  # bytes one `model` device holds of the parameters
        math.prod(x.sharding.shard_shape(x.shape)) * 4 for x in jax.tree.leaves(tp_state["params"])
    )

    def volume(r):
        return sum(r.bytes_by(kind=k, axes=("data",)) for k in ("all-gather", "reduce-scatter")) + (
            2 * r.bytes_by(kind="all-reduce", axes=("data",))
        )

    assert abs(volume(tp) / (2 * psi_t) - 1) < 1e-3  # data parallelism's all-reduce
    assert abs(volume(zero1) / (2 * psi_t) - 1) < 1e-3
    assert abs(volume(kept) / (2 * psi_t) - 1) < 1e-3
    assert 2.5 * psi_t < volume(fsdp) <= 3 * psi_t
    assert fsdp.memory.temporaries < kept.memory.temporaries  # one layer's weights at a time
    (note,) = fsdp.zero
    assert note.zero_stage == 3 and not note.gathered
    assert note.whole_leaves == 2 and note.whole_bytes > 0  # the biases split over `model`


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lamb", "clip_chain", "adafactor_factored"])
def test_without_zero_a_stage_block_is_updated_as_part_of_its_whole_leaf(name):
    """zero_stage=0 on {"data": 2, "stage": 4}: LAMB's trust ratio, a global norm in a chain
    and Adafactor's factored statistics see each stage block as part of the whole stacked leaf,
    as on one device (LAMB differed by 2e-3 when each device updated its block alone)."""
    from test_zero_any_tx import TRANSFORMS

    tx = TRANSFORMS[name][0]()
    repl = make_repl({"data": 2, "stage": 4})
    train_pipeline(repl, repl.wrap_optimizer(tx), tx, "1f1b", stacked=True)


def test_without_zero_and_without_params_a_whole_leaf_update_is_refused():
    """Without the parameters the update cannot tell the stage blocks: an element-wise
    transformation still runs (each block's update is the block of the leaf's), and one that
    is not is refused, naming the fix."""
    repl = make_repl({"data": 2, "stage": 4})
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.5))
    wrapped = repl.wrap_optimizer(tx)
    f = pipeline.value_and_grad(
        pipeline.scan_layers(layer_fn), loss_fn, num_microbatches=4, schedule=pipeline.OneFOneB()
    )
    grads = pipelined_grads(f)

    def step(state, x, t):
        _, g = grads(state["params"], x, t)
        updates, opt = wrapped.update(g, state["opt"])  # no params
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {}

    placed = placed_pipeline(repl, init_params(), 1)
    state = {"params": placed, "opt": wrapped.init(placed)}
    with pytest.raises(ValueError, match=r"(?s)zero_stage=0.*pass them.*not element-wise"):
        repl.run(step, state, *make_batch(16, seed=1))
