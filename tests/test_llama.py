"""The Llama family on the GPT's machinery (`gpt.GPTConfig`'s RMSNorm, rotary positions, SwiGLU,
grouped-query attention, no biases, tied head): its logits, loss and every gradient equal
transformers' ``LlamaForCausalLM`` with the same weights; on meshes (Megatron TP, FSDP x TP, a
1F1B pipeline x TP, a zigzag ring over ``context``) three SGD steps equal one device; and what
it cannot compute is refused with the fix."""

import dataclasses
import functools
import math

import jax
import numpy as np
import optax
import pytest
from oracle import rel_err, torch_loss_and_grads

import replicator as rp
from replicator import attention, pipeline
from replicator.models import gpt, hf, llama

# -- against transformers ------------------------------------------------------------------------

HF_CASES = {
    "gqa": dict(rope_theta=10000.0),
    # Llama 3's rescaled frequencies with wavelengths on both sides of, and between, 64 / 1 and
    # 64 / 4 positions (head_dim 16, theta 5e5: 6.3, 37, 167, ...), and a tied head.
    "llama3-tied": dict(
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
}
HF_TOL = {"logits": 1e-5, "grads": 1e-4}


@functools.cache
def hf_model(case):
    """A random fp32 ``LlamaForCausalLM`` (vocab 128, hidden 64, 4 heads, 2 key/value heads, 3
    layers, MLP 96), weights large enough (std 0.2, norm scales 1 +- 0.1) that attention is far
    from uniform, and its converted parameters and config."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        attn_implementation="eager",
        **HF_CASES[case],
    )
    model = transformers.LlamaForCausalLM(hf_config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    config = hf.decoder_config(hf_config.to_dict(), seq_len=16)
    params = llama.params_from_state_dict(model.state_dict(), config=config)
    return model, config, params


def hf_batch(seed=3):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, 128, size=(2, 17)).astype(np.int32)
    return t[:, :-1], t[:, 1:]


@pytest.mark.slow  # 2-5 s each (the first imports torch and transformers)
@pytest.mark.parametrize("case", list(HF_CASES))
def test_logits_equal_transformers(case):
    torch = pytest.importorskip("torch")
    model, config, params = hf_model(case)
    tokens, _ = hf_batch()
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
    got = np.asarray(jax.jit(functools.partial(gpt.apply, config=config))(params, tokens))
    assert rel_err(got, want) <= HF_TOL["logits"], rel_err(got, want)
    # The comparison can fail: other rotary frequencies give other logits.
    wrong = dataclasses.replace(config, rope_theta=config.rope_theta / 2, rope_scaling=None)
    assert rel_err(gpt.apply(params, tokens, config=wrong), want) > 1e-3


@pytest.mark.slow  # 1-5 s each
@pytest.mark.parametrize("attention", ["ring", "dot_product"])
@pytest.mark.parametrize("case", list(HF_CASES))
def test_loss_and_every_gradient_equal_torch_autograd(case, attention):
    """The mean next-token cross-entropy and the gradient of every transformers parameter
    (`llama.state_dict_from_params` of `gpt.loss`'s gradients), against torch's autograd; with
    the library's attention (on one device: plain attention, key/value heads repeated) and
    with ``jax.nn.dot_product_attention`` (grouped)."""
    pytest.importorskip("torch")
    model, config, params = hf_model(case)
    config = dataclasses.replace(config, attention=attention)
    tokens, targets = hf_batch(seed=4)
    want_loss, grads = torch_loss_and_grads(model, tokens, targets)
    want = {name: g.numpy() for name, g in grads.items()}
    loss_fn = functools.partial(gpt.loss, config=config)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, tokens, targets)
    got = llama.state_dict_from_params(grads, config=config)
    assert sorted(got) == sorted(want)  # tied: one table, both uses' gradients summed
    assert rel_err(float(loss), want_loss) <= HF_TOL["grads"]
    errs = {name: rel_err(got[name], want[name]) for name in want}
    assert max(errs.values()) <= HF_TOL["grads"], errs


def test_grouped_query_attention_is_multi_head_attention_with_shared_heads():
    """Key/value head ``j`` serves query heads ``2j, 2j + 1``: the GQA model equals the
    multi-head model whose key/value heads are those, each repeated (transformers'
    ``repeat_kv``), with the library's attention and with ``jax.nn.dot_product_attention``."""
    gqa = llama.config(vocab_size=32, d_model=16, num_layers=1, num_heads=4, num_kv_heads=2,
                       d_ff=24, seq_len=8)  # fmt: skip
    mha = dataclasses.replace(gqa, num_kv_heads=4)
    shapes = jax.eval_shape(lambda: gpt.init(gqa, jax.random.key(0)))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: 0.3 * rng.normal(size=a.shape).astype(np.float32), shapes)
    apply = jax.jit(gpt.apply, static_argnames="config")
    wide = lambda w: np.repeat(np.asarray(w).reshape(1, 16, 2, 4), 2, axis=2).reshape(1, 16, 16)
    attn = params["blocks"]["attn"]
    shared = {**params, "blocks": {**params["blocks"], "attn": attn | {
        "k": wide(attn["k"]), "v": wide(attn["v"])}}}  # fmt: skip
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8) % 32
    want = apply(shared, tokens, config=mha)
    for impl in ("ring", "dot_product"):
        config = dataclasses.replace(gqa, attention=impl)
        assert rel_err(apply(params, tokens, config=config), want) <= 1e-6


def test_state_dict_round_trip_and_names():
    config = llama.config(
        vocab_size=32, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=24, bias=True
    )
    shapes = jax.eval_shape(lambda: gpt.init(config, jax.random.key(0)))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32), shapes)
    state = llama.state_dict_from_params(params, config=config)
    assert state["model.layers.1.self_attn.q_proj.weight"].shape == (16, 16)
    assert state["model.layers.0.self_attn.v_proj.bias"].shape == (8,)
    assert state["lm_head.weight"].shape == (32, 16)
    back = llama.params_from_state_dict(state, config=config)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert rel_err(back, params) == 0
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\], unexpected \[\]"):
        llama.params_from_state_dict(
            {k: v for k, v in state.items() if k != "lm_head.weight"}, config=config
        )
    wrong = {**state, "model.layers.0.self_attn.k_proj.weight": np.zeros((16, 16), np.float32)}
    with pytest.raises(
        ValueError,
        match=r"^llama\.params_from_state_dict: model\.layers\.0\.self_attn\.k_proj\.weight is "
        r"\[16, 16\]; config's sizes give \[8, 16\]",
    ):
        llama.params_from_state_dict(wrong, config=config)
    with pytest.raises(ValueError, match=r"config is not a Llama's"):
        llama.params_from_state_dict(state, config=gpt.GPTConfig())


def test_hf_configs_the_gpt_cannot_compute_are_refused():
    base = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    c = hf.decoder_config(base | {"rope_theta": 1e6, "rope_scaling": None, "rms_norm_eps": 1e-6})
    assert (c.rope_theta, c.rope_scaling, c.norm_eps, c.num_kv_heads) == (1e6, None, 1e-6, 2)
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192, rope_theta=5e5)  # fmt: skip
    c = hf.decoder_config(base | {"rope_parameters": scaling})
    assert c.rope_scaling == gpt.RopeScaling(8.0, 1.0, 4.0, 8192) and c.rope_theta == 5e5
    hash(c)
    wide = hf.decoder_config(base | {"head_dim": 16, "hidden_act": "gelu"})  # heads apart from D
    assert (wide.head_dim, wide.q_width, wide.activation, wide.gated) == (
        16,
        64,
        "gelu_exact",
        True,
    )
    for change, match in [
        ({"hidden_act": "tanh"}, r"hidden_act='tanh' is not implemented"),
        ({"attention_bias": True}, r"attention_bias=True but mlp_bias=False"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_type='yarn' is not"),
        (
            {"model_type": "phi3"},
            r"model_type='phi3'; this reads the configs of llama, mixtral, qwen2, gemma2",
        ),
    ]:
        with pytest.raises(ValueError, match=r"^hf\.decoder_config: " + match):
            hf.decoder_config(base | change)


def test_gpt_config_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match=r"num_heads=4 must divide by num_kv_heads=3"):
        gpt.GPTConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"rope_scaling=\{'factor': 8.0\}; pass a gpt.RopeScaling"):
        gpt.GPTConfig(position="rope", rope_scaling={"factor": 8.0})
    with pytest.raises(ValueError, match=r"norm='batch'; use one of 'layer', 'rms'"):
        gpt.GPTConfig(norm="batch")
    with pytest.raises(ValueError, match=r"head_dim = d_model / num_heads = 3 must be even"):
        gpt.GPTConfig(d_model=12, num_heads=4, position="rope")


# -- on meshes: three SGD steps equal one device ---------------------------------------------------

TOL = 1e-5
GLOBAL_BATCH = 16
# 8 query heads, 4 key/value heads (2 per `model` device of 2 or 4), Llama 3 frequencies, tied.
CONFIG = llama.config(
    vocab_size=64, d_model=32, num_layers=4, num_heads=8, num_kv_heads=4, d_ff=48, seq_len=8,
    rope_theta=500000.0, rope_scaling=gpt.RopeScaling(8.0, 1.0, 4.0, 16), tie_embeddings=True,
)  # fmt: skip


def make_repl(mesh_shape):
    n = math.prod(mesh_shape.values())
    return rp.Replicator(mesh_shape=mesh_shape, devices=jax.devices()[:n])


def batches(n=3, seed=7):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = rng.integers(0, CONFIG.vocab_size, size=(GLOBAL_BATCH, CONFIG.seq_len + 1))
        t = t.astype(np.int32)
        out.append({"tokens": t[:, :-1], "targets": t[:, 1:]})
    return out


def loss_fn(params, batch, config=CONFIG):
    return gpt.loss(params, batch["tokens"], batch["targets"], config=config)


@functools.cache
def oracle():
    """Three SGD steps on one device with the full batch: the parameters and the losses."""
    return one_device(optax.sgd(0.1))


def one_device(tx):
    """Three steps of ``tx`` on one device with the full batch: the parameters and losses."""
    params = gpt.init(CONFIG, jax.random.key(0))

    @jax.jit
    def step(params, opt, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    opt, losses = tx.init(params), []
    for batch in batches():
        params, opt, loss = step(params, opt, batch)
        losses.append(float(loss))
    return params, np.array(losses)


def check_against_oracle(got, losses):
    want, want_losses = oracle()
    assert rel_err(got, want) <= TOL, rel_err(got, want)
    assert rel_err(losses, want_losses) <= TOL, (losses, want_losses)
    assert rel_err(got, gpt.init(CONFIG, jax.random.key(0))) > 1e-3  # training moved them


def shard_shapes(x):
    return {tuple(s.data.shape) for s in x.addressable_shards}


def train(repl, config=CONFIG, zero_stage=0, split=None):
    """Three steps of ``wrap_optimizer(sgd).step`` on `gpt.place`'s layout (ZeRO-3: stored with
    ``shard_params``, ``split`` its ``split``): the trained parameters (host arrays), the
    losses, the state."""
    tx = repl.wrap_optimizer(optax.sgd(0.1), zero_stage=zero_stage)
    traces = []

    def step(state, batch):
        traces.append(1)
        params, opt, metrics = tx.step(
            functools.partial(loss_fn, config=config), state["params"], state["opt"], batch
        )
        return {"params": params, "opt": opt}, {"loss": metrics["loss"]}

    placed = gpt.place(repl, gpt.init(config, jax.random.key(0)), config=config)
    if zero_stage == 3:
        placed = tx.shard_params(placed, stacked=gpt.zero_stacked(config), split=split)
    state, losses = {"params": placed, "opt": tx.init(placed)}, []
    for batch in batches():
        state, out = repl.run(step, state, batch)
        losses.append(float(np.asarray(out["loss"])[0]))
    assert len(traces) == 1
    return host(state["params"]), np.array(losses), state


def stored(p):
    """A parameter's array, whether ZeRO-3 stores it (`rp.ShardedParam`) or not."""
    return p.value if isinstance(p, rp.ShardedParam) else p


def host(params):
    is_sharded = lambda x: isinstance(x, rp.ShardedParam)
    return jax.tree.map(lambda p: np.asarray(stored(p)), params, is_leaf=is_sharded)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["ring", "dot_product"])
def test_megatron_tensor_parallel_llama_trains_as_one_device(attention):
    """{"data": 2, "model": 4}: each device holds 2 of the 8 query heads and 1 of the 4
    key/value heads (the ones its queries use) and 1/4 of the SwiGLU units; the same with
    ``jax.nn.dot_product_attention``."""
    config = dataclasses.replace(CONFIG, attention=attention)
    got, losses, state = train(make_repl({"data": 2, "model": 4}), config)
    check_against_oracle(got, losses)
    blocks, (L, d, hd, f) = state["params"]["blocks"], (4, 32, 4, 48)
    assert shard_shapes(blocks["attn"]["q"]) == {(L, d, 8 * hd // 4)}
    assert shard_shapes(blocks["attn"]["k"]) == {(L, d, 4 * hd // 4)}
    assert shard_shapes(blocks["attn"]["out"]) == {(L, 8 * hd // 4, d)}
    assert shard_shapes(blocks["mlp"]["gate"]) == {(L, d, f // 4)}
    assert shard_shapes(blocks["mlp"]["down"]) == {(L, f // 4, d)}
    assert "w" not in state["params"]["head"]


@pytest.mark.slow
def test_fsdp_with_tensor_parallel_llama_trains_as_one_device():
    """ZeRO-3 over `data` on top of the Megatron split over `model`: each leaf keeps its shape,
    one more of its axes split over the 2 replicas; the blocks gathered layer by layer."""
    got, losses, state = train(make_repl({"data": 2, "model": 4}), zero_stage=3)
    check_against_oracle(got, losses)
    q = state["params"]["blocks"]["attn"]["q"].value
    assert shard_shapes(q) == {(4, 32 // 2, 32 // 4)}  # rows over data, columns over model


@pytest.mark.parametrize("mesh", [{"data": 4}, {"data": 4, "model": 2}])
def test_fsdp_with_the_token_table_split_by_columns_trains_as_one_device(mesh):
    """``split=gpt.zero_split(config)``: the (tied) token table ``[64, 32]`` split over the
    replicas by its width, each replica looking up its columns of every replica's tokens (32
    a replica, fewer than the 64 rows) and exchanging them in one all-to-all; the head gathers
    it whole. Split by rows (the test above: 128 tokens in all, more than 64 rows), the table is
    gathered for the lookup too: that moves fewer bytes."""
    n = mesh["data"]
    got, losses, state = train(make_repl(mesh), zero_stage=3, split=gpt.zero_split(CONFIG))
    check_against_oracle(got, losses)
    table = state["params"]["embed"]["tokens"]
    assert table.dim == -1 and shard_shapes(table.value) == {(64, 32 // n)}


@pytest.mark.slow
def test_bf16_gradients_summed_in_bf16_train_as_summed_in_fp32():
    """``reduce_dtype=bfloat16`` on ZeRO-3 over 4 replicas (bf16 compute): three SGD steps
    agree with the same steps summing the gradients in fp32 to bf16's precision (a factor of
    the replicas anywhere in the bf16 path would be far off)."""
    bf16 = dataclasses.replace(CONFIG, dtype=jax.numpy.bfloat16)
    repl = make_repl({"data": 4})
    want, want_losses, _ = train(repl, bf16, zero_stage=3)
    got, losses, _ = train(repl, dataclasses.replace(bf16, reduce_dtype="bfloat16"), 3)
    assert rel_err(got, want) <= 5e-3, rel_err(got, want)  # 9e-4 here; 0.61 with 4x the gradient
    assert rel_err(losses, want_losses) <= 1e-4, (losses, want_losses)
    assert rel_err(got, gpt.init(CONFIG, jax.random.key(0))) > 1e-2  # training moved them


@pytest.mark.slow  # 3-7 s
def test_apply_on_a_zigzag_context_mesh_gives_one_devices_logits():
    """On {"data": 2, "context": 4} the sequence is laid out in zigzag order inside the model,
    and each device rotates its queries and keys by its own chunks' positions; `gpt.apply`'s
    logits equal one device's."""
    repl = make_repl({"data": 2, "context": 4})
    params = gpt.init(CONFIG, jax.random.key(0))
    tokens = batches(1)[0]["tokens"]
    orders = []

    def step(params, tokens):
        orders.append(gpt.sequence_order(CONFIG, tokens.shape[-1]))
        return params, {"logits": gpt.apply(params, tokens, config=CONFIG)}

    _, out = repl.run(step, gpt.place(repl, params, config=CONFIG), tokens)
    got = np.asarray(out["logits"]).reshape(GLOBAL_BATCH, CONFIG.seq_len, CONFIG.vocab_size)
    assert rel_err(got, gpt.apply(params, tokens, config=CONFIG)) <= TOL
    np.testing.assert_array_equal(orders[0], attention.zigzag_order(CONFIG.seq_len, 4))


@pytest.mark.slow
def test_zigzag_ring_over_context_with_tensor_parallel_trains_as_one_device():
    """{"data": 2, "context": 2, "model": 2}: each device holds two chunks of every sequence
    (zigzag), and rotates its queries and keys by those chunks' positions."""
    got, losses, _ = train(make_repl({"data": 2, "context": 2, "model": 2}))
    check_against_oracle(got, losses)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 3])
def test_one_f_one_b_pipeline_with_tensor_parallel_llama_trains_as_one_device(zero_stage):
    """{"data": 2, "stage": 2, "model": 2}, 1F1B: two stages of two blocks; the tied token
    table gets the embedding's and the head's gradients (with ZeRO-3: gathered for each, its
    gradients scattered back and summed)."""
    repl = make_repl({"data": 2, "stage": 2, "model": 2})
    grad_fn = gpt.pipeline_value_and_grad(CONFIG, num_microbatches=4, schedule="1f1b")
    tx = repl.wrap_optimizer(optax.sgd(0.1), zero_stage=zero_stage)

    def step(state, batch):
        loss, grads = grad_fn(state["params"], batch)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, {"loss": rp.all_reduce(loss, "mean")}

    params = gpt.init(CONFIG, jax.random.key(0))
    placed = gpt.place_pipeline(repl, params, num_stages=2, config=CONFIG)
    if zero_stage == 3:
        placed = tx.shard_params(placed)
    state, losses = {"params": placed, "opt": tx.init(placed)}, []
    for batch in batches():
        state, out = repl.run(step, state, batch)
        losses.append(float(np.asarray(out["loss"])[0]))
    got = host(state["params"])
    got["blocks"] = pipeline.unstack_stages(got.pop("stages"))
    check_against_oracle(got, np.array(losses))
    columns = 4 * 4 // 2  # 2 of the 4 key/value heads, over `model`
    rows = 32 // 2 if zero_stage == 3 else 32  # ZeRO-3: over the 2 replicas too
    assert shard_shapes(stored(state["params"]["stages"]["attn"]["k"])) == {(1, 2, rows, columns)}


@pytest.mark.slow
def test_fewer_key_value_heads_than_model_devices_kept_whole_stay_exact():
    """Multi-query attention (1 key/value head) on `model` = 4 is refused by the Megatron rules;
    ``"kv_heads": None`` keeps K and V whole on every device, and the gradients equal one
    device's."""
    config = dataclasses.replace(CONFIG, num_kv_heads=1)
    repl = make_repl({"data": 2, "model": 4})
    params = gpt.init(config, jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"^gpt\.place: num_kv_heads=1 does not split over the 4 devices of 'model' \(rules "
        r"map 'kv_heads' to 'model'\); use num_kv_heads a multiple of 4 \(e\.g\. 4\), or a "
        r"smaller 'model' axis, or rules=\{\*\*gpt\.MEGATRON_RULES, 'kv_heads': None\}",
    ):
        gpt.place(repl, params, config=config)
    placed = gpt.place(repl, params, config=config, rules={**gpt.MEGATRON_RULES, "kv_heads": None})
    assert shard_shapes(placed["blocks"]["attn"]["k"]) == {(4, 32, 4)}

    def step(params, batch):
        grads = jax.grad(functools.partial(loss_fn, config=config))(params, batch)
        return rp.all_reduce(grads, "mean"), {}

    batch = batches(1)[0]
    grads, _ = repl.run(step, placed, batch)
    want = jax.grad(functools.partial(loss_fn, config=config))(params, batch)
    assert rel_err(jax.tree.map(np.asarray, grads), want) <= TOL


def test_dot_product_attention_over_a_context_axis_is_refused():
    config = dataclasses.replace(CONFIG, attention="dot_product")
    repl = make_repl({"data": 2, "context": 2})
    shapes = jax.eval_shape(lambda: gpt.init(config, jax.random.key(0)))
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes)
    placed = gpt.place(repl, zeros, config=config)
    step = lambda p, b: (p, {"loss": loss_fn(p, b, config)})
    with pytest.raises(
        ValueError,
        match=r"^GPTConfig\(attention='dot_product'\) attends over whole sequences, but the mesh "
        r"splits them over the 2 devices of 'context'; use attention='ring' or 'all_to_all'",
    ):
        repl.run(step, placed, batches(1)[0])


def test_specs_of_the_llama_layout():
    specs = gpt.partition_specs(config=CONFIG)
    P = jax.sharding.PartitionSpec
    assert specs["blocks"]["attn"] == {
        "q": P(None, None, "model"),
        "k": P(None, None, "model"),
        "v": P(None, None, "model"),
        "out": P(None, "model", None),
    }
    assert specs["blocks"]["mlp"] == {
        "gate": P(None, None, "model"),
        "up": P(None, None, "model"),
        "down": P(None, "model", None),
    }
    assert specs["embed"] == {"tokens": P(None, None)}
    assert specs["head"] == {"norm": {"scale": P(None)}}
    roles = jax.tree.structure(gpt.logical_axes_for(CONFIG), is_leaf=lambda a: isinstance(a, tuple))
    assert roles == jax.tree.structure(jax.eval_shape(lambda: gpt.init(CONFIG, jax.random.key(0))))
    d, hd, f, v = 32, 4, 48, 64
    n = 4 * (2 * d * d + 2 * d * 4 * hd + 3 * d * f) + d * v
    assert gpt.flops_per_token(CONFIG) == 6 * n + 6 * 4 * 8 * d
