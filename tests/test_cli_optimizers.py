"""The optimizer: section of run configs: optimizers, schedules, a weight-decay mask fixed from
the whole parameters (exact under every zero_stage), the EMA, and the learning rate in the
metrics."""

from __future__ import annotations

import json
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from oracle import rel_err

import replicator as rp
from replicator import cli
from replicator.cli import config as config_lib
from replicator.cli import jobs, optimizers
from replicator.cli.optimizers import OptimizerConfig
from replicator.models import gpt

ROOT = pathlib.Path(__file__).resolve().parent.parent
DP, PIPE, MLP = (ROOT / "configs" / f"{n}.yaml" for n in ("lm_dp", "lm_pipeline", "mlp_zero"))


def test_the_section_with_its_learning_rate_in_yaml_and_in_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "optimizer: {name: adamw, learning_rate: 1e-3, schedule: cosine, warmup_steps: 5}\n"
    )
    c = config_lib.load(path)
    assert c.optimizer == OptimizerConfig(
        name="adamw", learning_rate=0.001, schedule="cosine", warmup_steps=5
    )
    assert isinstance(c.optimizer.learning_rate, float)  # 1e-3: a string to YAML 1.1
    c = config_lib.load(
        DP, ["optimizer.name=adamw", "optimizer.warmup_steps=20", "optimizer.learning_rate=1e-3"]
    )  # lm_dp.yaml has a top-level learning_rate: the override replaces it
    assert c.optimizer == OptimizerConfig(name="adamw", warmup_steps=20, learning_rate=1e-3)
    assert isinstance(c.optimizer.learning_rate, float)
    c = config_lib.load(path, ["learning_rate=5e-4", "optimizer.b1=0.8"])  # replaces the section's
    assert c.optimizer.learning_rate == 5e-4 and c.optimizer.b1 == 0.8


def test_the_old_forms_a_name_alone_and_a_top_level_learning_rate():
    c = config_lib.load(PIPE)  # optimizer: adam, learning_rate: 0.003
    assert c.optimizer == OptimizerConfig(name="adam", learning_rate=0.003)
    c = config_lib.load(PIPE, ["optimizer.name=lion", "learning_rate=1e-4"])
    assert c.optimizer == OptimizerConfig(name="lion", learning_rate=1e-4)
    c = config_lib.load(PIPE, ["optimizer=sgd", "optimizer.momentum=0.9"])
    assert c.optimizer == OptimizerConfig(name="sgd", learning_rate=0.003, momentum=0.9)
    short = {"optimizer": "adamw", "learning_rate": 0.1}
    assert config_lib.from_dict(config_lib.TrainConfig, short).optimizer == (
        OptimizerConfig(name="adamw", learning_rate=0.1)
    )
    # the defaults, as before the section: Adam at a constant 3e-3
    assert config_lib.TrainConfig().optimizer == OptimizerConfig(name="adam", learning_rate=3e-3)
    # built in Python, a config takes the long forms only, and says which to write
    with pytest.raises(ValueError, match=r"^TrainConfig: optimizer='adamw' is a config file's "
                       r"short form of optimizer: \{name: adamw\}; give optimizer=OptimizerConfig"
                       r"\(name='adamw'\), or read the config with replicator.cli.config."
                       r"from_dict"):  # fmt: skip
        config_lib.TrainConfig(optimizer="adamw")


def test_a_learning_rate_set_twice_is_refused_naming_both_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1e-3\noptimizer: {name: adamw, learning_rate: 1e-2}\n")
    both = r"learning_rate and optimizer\.learning_rate are both set; set one of them"
    with pytest.raises(ValueError, match=rf"^{path}: {both}"):
        config_lib.load(path)
    with pytest.raises(ValueError, match=rf"^overrides: {both}"):
        config_lib.load(DP, ["learning_rate=1e-3", "optimizer.learning_rate=1e-3"])
    with pytest.raises(ValueError, match=rf"^config: {both}"):
        config_lib.from_dict(
            config_lib.TrainConfig, {"learning_rate": 1e-3, "optimizer": {"learning_rate": 0.1}}
        )


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["optimizer=adamx"], r"optimizer='adamx' is not an optimizer; use one of 'adam', 'adamw'"),
        (["optimizer.name=lino"], r"optimizer\.name=.lino. is not an optimizer.*mean .lion.\?"),
        (["optimizer.schedule=cos"],
         r"optimizer\.schedule='cos' is not a learning-rate schedule.*'cosine'"),
        (["optimizer.warmup_steps=-1"], r"optimizer\.warmup_steps must be an int >= 0; got -1"),
        (["optimizer.learning_rate=0"], r"optimizer\.learning_rate must be a finite number > 0"),
        (["optimizer.weight_decay=0.1"],
         r"optimizer\.weight_decay=0\.1: optimizer\.name='adam' has no weight decay .*adamw"),
        (["optimizer.name=adamw", "optimizer.weight_decay=-1"],
         r"optimizer\.weight_decay must be a number >= 0; got -1"),
        (["optimizer.name=sgd", "optimizer.b2=0.99"], r"optimizer\.b2 is for 'adam', 'adamw'"),
        (["optimizer.b1=1.0"], r"optimizer\.b1 must be in \[0, 1\); got 1\.0"),
        (["optimizer.momentum=0.9"], r"optimizer\.momentum is for optimizer\.name='sgd'"),
        (["optimizer.ema_decay=1"], r"optimizer\.ema_decay must be in \[0, 1\); got 1"),
        (["optimizer.end_factor=2"], r"optimizer\.end_factor must be in \[0, 1\]; got 2"),
        (["optimizer.decay_steps=0"], r"optimizer\.decay_steps must be an int >= 1; got 0"),
    ],
)  # fmt: skip
def test_refusals_name_the_key(overrides, words):
    with pytest.raises(ValueError, match=f"^{MLP}: .*{words}"):
        config_lib.load(MLP, overrides)


def test_no_weight_decay_is_accepted_for_any_optimizer():
    assert config_lib.load(MLP, ["optimizer.weight_decay=0"]).optimizer.weight_decay == 0.0


def test_schedules_are_optax_schedules_with_warmup():
    def at(config, steps, points):
        schedule = optimizers.schedule_fn(config, steps=steps)
        return [float(schedule(s)) for s in points]

    points = (0, 5, 10, 60, 110, 200)
    cos = OptimizerConfig(learning_rate=1.0, schedule="cosine", warmup_steps=10)
    want = optax.warmup_cosine_decay_schedule(0.0, 1.0, 10, 110, 0.0)
    assert at(cos, 110, points) == [float(want(s)) for s in points]
    lin = OptimizerConfig(learning_rate=2.0, schedule="linear", warmup_steps=4, end_factor=0.5)
    want = optax.join_schedules(
        [optax.linear_schedule(0.0, 2.0, 4), optax.linear_schedule(2.0, 1.0, 10)], [4]
    )
    assert at(lin, 14, (0, 2, 4, 9, 14, 30)) == [float(want(s)) for s in (0, 2, 4, 9, 14, 30)]
    assert np.allclose(at(lin, 14, (0, 2, 4, 9, 14)), [0.0, 1.0, 2.0, 1.5, 1.0])
    assert at(OptimizerConfig(learning_rate=0.3), 100, (0, 99)) == [pytest.approx(0.3)] * 2
    longer = OptimizerConfig(schedule="cosine", warmup_steps=2, decay_steps=50)  # not the run's
    want = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 2, 50, 0.0)
    assert at(longer, 10, (1, 30)) == [float(want(1)), float(want(30))]


def test_the_mask_is_fixed_from_the_whole_parameters():
    config = gpt.GPTConfig(vocab_size=16, seq_len=4, d_model=8, num_heads=2, num_layers=2)
    mask = optimizers.decay_mask(gpt.init(config, jax.random.key(0)))
    assert all(type(m) is bool for m in jax.tree.leaves(mask))  # static, not traced
    assert mask["blocks"]["attn"] == {  # stacked [L, ...]: the biases by their keys
        "out": True,
        "out_bias": False,
        "qkv": True,
        "qkv_bias": False,
    }
    assert mask["blocks"]["ln1"] == {"bias": False, "scale": False}
    assert mask["head"] == {"norm": {"bias": False, "scale": False}, "w": True}
    assert mask["embed"] == {"positions": True, "tokens": True}
    shapes = {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32), "gain": np.ones(3), "s": 2.0}
    assert optimizers.decay_mask(shapes) == {"w": True, "gain": False, "s": False}  # ndim <= 1


def test_adamw_decays_the_matrices_only_and_adam_is_optax_adam():
    params = {"w": jnp.full((2, 3), 2.0), "b": jnp.full((3,), 2.0), "ln": {"scale": jnp.ones(3)}}
    config = OptimizerConfig(name="adamw", learning_rate=0.5, weight_decay=0.1)
    tx, _ = optimizers.make_optimizer(config, steps=10, params=params)
    zeros = jax.tree.map(jnp.zeros_like, params)  # Adam's part is 0: the decay alone is left
    updates, _ = tx.update(zeros, tx.init(params), params)
    assert np.allclose(updates["w"], -0.5 * 0.1 * 2.0)
    assert not np.any(updates["b"]) and not np.any(updates["ln"]["scale"])
    tx, schedule = optimizers.make_optimizer(config_lib.load(PIPE).optimizer, steps=5, params=None)
    grads = jax.tree.map(lambda x: x * 0.3 + 0.1, params)
    got, _ = tx.update(grads, tx.init(params), params)
    want, _ = optax.adam(3e-3).update(grads, optax.adam(3e-3).init(params), params)
    assert jax.tree.all(jax.tree.map(np.array_equal, got, want)) and float(schedule(4)) == 3e-3


def _whole(tree):
    """ZeRO-3's ShardedParams as whole arrays, on the host."""

    def whole(x):
        return np.asarray(x.value if isinstance(x, rp.ShardedParam) else x)

    return jax.tree.map(whole, tree, is_leaf=lambda x: isinstance(x, rp.ShardedParam))


def _train(zero_stage, *overrides, steps=3):
    c = config_lib.load(
        MLP,
        ["model.layers=2", "model.d_model=32", "global_batch=32", f"zero_stage={zero_stage}",
         "accumulate_steps=1", f"steps={steps}", *overrides],
    )  # fmt: skip
    repl, step_fn, state, input_fn, _ = jobs.build(c)
    batches = iter(input_fn(repl.input_context()))
    history, rates = [_whole(state["job"]["params"])], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Adafactor: gathered for the update
        for _ in range(steps):
            state, metrics = repl.run(step_fn, state, next(batches))
            history.append(_whole(state["job"]["params"]))
            rates.append(float(np.asarray(metrics["learning_rate"]).ravel()[0]))
    return state, history, rates


ADAMW = ("optimizer.name=adamw", "optimizer.learning_rate=0.05", "optimizer.schedule=cosine",
         "optimizer.warmup_steps=1")  # fmt: skip


@pytest.mark.slow  # 4.3 s
def test_adamw_with_mask_and_warmup_cosine_is_exact_under_every_zero_stage(monkeypatch):
    with monkeypatch.context() as m:  # the oracle: the same job on one device
        replicator = rp.Replicator
        m.setattr(rp, "Replicator", lambda **kw: replicator(**kw, devices=jax.devices()[:1]))
        _, one, rates = _train(0, *ADAMW, "optimizer.weight_decay=0.5")
    schedule = optax.warmup_cosine_decay_schedule(0.0, 0.05, 1, 3, 0.0)
    assert rates == pytest.approx([float(schedule(s)) for s in range(3)])
    for zero_stage in (0, 1, 2, 3):
        _, got, _ = _train(zero_stage, *ADAMW, "optimizer.weight_decay=0.5")
        assert rel_err(got[-1], one[-1]) <= 1e-5, zero_stage
        assert np.any(got[-1]["layers"]["b"])  # the stacked biases train (zero at init)
    _, undecayed, _ = _train(0, *ADAMW, "optimizer.weight_decay=0")
    assert rel_err(undecayed[-1], one[-1]) > 1e-3  # the decay is in the numbers


@pytest.mark.parametrize(
    "zero_stage, overrides",
    [
        (3, ("optimizer.name=lion", "optimizer.learning_rate=0.001", "optimizer.b2=0.98")),
        (2, ("optimizer.name=sgd", "optimizer.momentum=0.9", "optimizer.learning_rate=0.01")),
        # Adafactor's factored statistics need whole 2-D leaves: ZeRO gathers them for its
        # update (with a warning), so it is exact and accepted under every zero_stage.
        (3, ("optimizer.name=adafactor", "optimizer.learning_rate=0.01")),
    ],
)
def test_every_optimizer_is_exact_under_zero(zero_stage, overrides):
    _, want, _ = _train(0, *overrides, steps=2)
    _, got, _ = _train(zero_stage, *overrides, steps=2)
    assert rel_err(got[-1], want[-1]) <= 1e-5


def test_the_ema_is_kept_in_the_state_and_exact_under_zero_3():
    ema_args = ("optimizer.name=sgd", "optimizer.learning_rate=0.1", "optimizer.ema_decay=0.5")
    state, history, _ = _train(0, *ema_args)
    want = history[0]
    for params in history[1:]:  # ema = d * ema + (1 - d) * params, after each update
        want = jax.tree.map(lambda e, p: 0.5 * e + 0.5 * p, want, params)
    assert rel_err(_whole(state["ema"]), want) <= 1e-6
    state3, _, _ = _train(3, *ema_args)
    assert isinstance(state3["ema"]["layers"]["w"], rp.ShardedParam)  # sharded as the params
    assert rel_err(_whole(state3["ema"]), want) <= 1e-5


def test_the_learning_rate_is_logged_with_the_metrics(tmp_path, capsys):
    args = ["train", str(MLP), f"out_dir={tmp_path}", "steps=4", "log_every=2", "plot=false",
            "model.layers=2", "model.d_model=32", "global_batch=32", "accumulate_steps=1",
            "optimizer.name=adamw", "optimizer.schedule=linear", "optimizer.warmup_steps=2",
            "optimizer.learning_rate=1e-3"]  # fmt: skip
    assert cli.main(args) == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (tmp_path / "mlp_zero/metrics.jsonl").read_text().splitlines()]
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, 1e-3, 2), optax.linear_schedule(1e-3, 0.0, 2)], [2]
    )
    # the rate of the step logged: steps 1, 2 and 4 ran with schedule(0), (1) and (3)
    assert [r["step"] for r in rows] == [1, 2, 4]
    assert [r["learning_rate"] for r in rows] == pytest.approx(
        [float(schedule(s)) for s in (0, 1, 3)]
    )
