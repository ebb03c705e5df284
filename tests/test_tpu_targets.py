"""TPU targets compiled here by libtpu, with no TPU: accelerator-type names and their devices, a
step's report read from the TPU program (and its FLOPs equal to the CPU program's), every shipped
config compiled for a TPU slice of its mesh's size, ``replicator explain --target``, and
libtpu's start-up warnings kept from the user.

The whole module needs libtpu (``pip install "replicator[tpu]"``); without it it is skipped.
"""

import collections
import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator import cli
from replicator.cli import config as config_lib
from replicator.cli import jobs

if importlib.util.find_spec("libtpu") is None:
    pytest.skip('libtpu is not installed (pip install "replicator[tpu]")', allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parents[1]
# TargetReport's keys, at the top level of report.to_json()
TARGET_KEYS = (
    "target", "platform", "num_devices", "device_kind", "hbm_bytes", "peak_bytes", "fits",
    "over_bytes", "fit_hint", "step_seconds", "xla_seconds", "xla_seconds_how", "model_flops",
    "mfu",
)  # fmt: skip
# what libtpu prints on a host without TPUs unless replicator sets its variables first
LIBTPU_NOISE = ("TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "could not determine TPU")


def _fresh_env() -> dict:
    """The environment of a new shell: without the libtpu variables `import replicator` set in
    this process (``rp``'s own start-up must set them in the child)."""
    env = dict(os.environ)
    for name in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "ALLOW_MULTIPLE_LIBTPU_LOAD"):
        env.pop(name, None)
    return env


def _python(*args, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout,
        cwd=ROOT, env=_fresh_env(),
    )  # fmt: skip


def _why(stderr: str) -> str:
    """The lines of a failed run's stderr that say why: Python's error, the CLI's refusal, or
    the TPU compiler's fatal check (libtpu aborts the process); else its end."""
    said = [
        line for line in stderr.splitlines()
        if re.match(r"(F\d{4} |\w*(Error|Exception)\b|replicator explain: )", line)
    ]  # fmt: skip
    return "\n".join(said)[-3000:] or stderr[-3000:]


def _noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if any(n in line for n in LIBTPU_NOISE)]


# -- 1. targets by name ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, canonical, chips, topology",
    [
        ("v5p-16", "v5p-16", 8, "v5p:2x2x2"),  # v5p counts TensorCores: 8 chips
        ("v5p-8", "v5p-8", 4, "v5p:2x2x1"),
        ("v5p-512", "v5p-512", 256, "v5p:4x8x8"),
        ("v4-8", "v4-8", 4, "v4:2x2x1"),  # so does v4
        ("v5e-8", "v5e-8", 8, "v5e:2x4"),  # v5e counts chips
        ("v5litepod-8", "v5e-8", 8, "v5e:2x4"),  # gcloud's name of v5e
        ("v5e-256", "v5e-256", 256, "v5e:16x16"),
        ("v6e-256", "v6e-256", 256, "v6e:16x16"),
        ("v5p:2x2x2", "v5p-16", 8, "v5p:2x2x2"),  # libtpu's own spelling
        (" V5P-16 ", "v5p-16", 8, "v5p:2x2x2"),
    ],
)
def test_target_names_as_gcloud_spells_them(name, canonical, chips, topology):
    t = rp.targets.tpu_target(name)
    assert (t.name, t.chips, t.topology, t.slices) == (canonical, chips, topology, 1)
    assert t.num_devices == chips and t.label == canonical


@pytest.mark.parametrize(
    "name, match",
    [
        ("v5p-12", r"'v5p-12': v5p-N counts TensorCores, two a chip; N must be 8, 16, 32, \.\.\. "
         r"\(a power of two\) up to 16384 \(8192 chips\), e\.g\. v5p-16; another slice shape "
         r"by its topology, e\.g\. v5p:2x2x3\."),
        ("v7-8", r"'v7-8' is not a TPU accelerator type; use one of v4-8, v5e-8, v5e-256, "
         r"v5p-16, v5p-512, v6e-256 .* or libtpu's 'v5p:2x2x2'\."),
        ("v5e-512", r"'v5e-512': v5e-N counts chips; N must be 1, 2, 4, \.\.\. \(a power of two\) "
         r"up to 256 \(256 chips\)"),
        ("v6e-3", r"v6e-N counts chips; N must be .* \(a power of two\)"),
        ("v5p:2x2", r"'v5p:2x2': a v5p slice is a 3-D torus; write v5p:2x2x2 or v5p-N\."),
        ("tpu", r"is not a TPU accelerator type; use one of v4-8"),
        ("v5p", r"is not a TPU accelerator type"),
        # the message's own rule: v4-N and v5p-N start at 8 TensorCores (4 chips)
        ("v5p-4", r"N must be 8, 16, 32"),
        ("v4-4", r"N must be 8, 16, 32"),
    ],
    ids=lambda v: v if " " not in v else "",
)  # fmt: skip
def test_target_refuses_a_name_cloud_tpu_does_not_have(name, match):
    with pytest.raises(ValueError, match=match):
        rp.targets.tpu_target(name)


@pytest.mark.parametrize("slices", [0, -1, 1.5, True, "2"])
def test_target_refuses_slices_that_are_not_a_count(slices):
    with pytest.raises(ValueError, match=r"target: slices must be an int >= 1"):
        rp.targets.tpu_target("v5p-16", slices=slices)


@pytest.mark.parametrize(
    "name, count, kind",
    [
        ("v4-8", 4, "TPU v4"),
        ("v5e-8", 8, "TPU v5 lite"),
        ("v5litepod-4", 4, "TPU v5 lite"),
        ("v5p-8", 4, "TPU v5"),
        ("v5p-16", 8, "TPU v5"),
        ("v6e-8", 8, "TPU v6 lite"),
    ],
)
def test_tpu_devices_a_device_per_chip(name, count, kind):
    """A megacore chip is one JAX device: as many devices as the target has chips."""
    devices = rp.tpu_devices(name)
    assert len(devices) == rp.targets.tpu_target(name).chips == count
    assert {d.platform for d in devices} == {"tpu"}
    assert {d.device_kind for d in devices} == {kind}
    assert len({d.id for d in devices}) == count
    assert jax.devices()[0].platform == "cpu"  # this machine's devices stay what they are


def test_two_slices_have_twice_the_devices_each_with_its_slice_index():
    devices = rp.tpu_devices("v5p-16", slices=2)
    assert len(devices) == 16 and len({d.id for d in devices}) == 16
    assert collections.Counter(d.slice_index for d in devices) == {0: 8, 1: 8}
    t = rp.targets.tpu_target("v5p-16", slices=2)
    assert (t.num_devices, t.label) == (16, "2 x v5p-16")


def test_a_mesh_the_torus_cannot_hold_in_whole_axes_is_laid_out_with_axes_split():
    """v5p-512's chips are a 4 x 8 x 8 torus: ``jax.make_mesh`` finds no whole physical axes
    for a mesh axis of 2, so a ``{data: 128, stage: 2}`` layout (which `rp.plan` enumerates)
    is laid out with physical axes split, every chip once."""
    from replicator._src.core import compat

    devices = rp.tpu_devices("v5p-512")
    with pytest.raises(NotImplementedError):
        jax.make_mesh((128, 2), ("data", "stage"), devices=devices)
    mesh = compat.make_mesh([128, 2], ["data", "stage"], devices)
    assert mesh.devices.shape == (128, 2) and mesh.axis_names == ("data", "stage")
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)


def test_two_slices_whose_axes_split_the_torus_are_laid_out_with_axes_split():
    """Llama 3.1 405B's recipe on two v6e-256 slices: ``{dcn_data: 2, data: 64, model: 4}``
    has no whole physical axes for ``model`` on a slice's 16 x 16 torus; each slice is laid
    out with physical axes split, every chip once, the slices along ``dcn_data``."""
    from jax.experimental import mesh_utils

    from replicator._src.core import compat

    devices = rp.tpu_devices("v6e-256", slices=2)
    shape, slices = (1, 64, 4), (2, 1, 1)
    with pytest.raises(NotImplementedError):
        mesh_utils.create_hybrid_device_mesh(shape, slices, devices)
    mesh = compat.make_hybrid_mesh(shape, slices, ("dcn_data", "data", "model"), devices)
    assert mesh.devices.shape == (2, 64, 4)
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
    assert {d.slice_index for d in mesh.devices[1].flat} == {1}


def test_tpu_devices_without_libtpu_names_the_extra(monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else found(name, *a)
    )
    with pytest.raises(ImportError, match=r"libtpu, which is not installed; pip install "
                       r"\"replicator\[tpu\]\""):  # fmt: skip
        rp.tpu_devices("v5p-16")


# -- 2. a step compiled for v5p-16 ------------------------------------------------------------

WIDTH, OUT, BATCH = 512, 128, 1024  # a two-layer MLP, Adam, the global batch


def _mlp_job(devices):
    repl = rp.Replicator(mesh_shape={"data": -1}, devices=devices)
    with repl.context():
        tx = repl.wrap_optimizer(optax.adam(1e-3))

    def init():
        params = repl.replicate({"w1": jnp.zeros((WIDTH, WIDTH)), "w2": jnp.zeros((WIDTH, OUT))})
        return {"params": params, "opt": tx.init(params)}

    def step_fn(state, batch):
        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["w1"])
            return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, {"loss": rp.all_reduce(loss, "mean")}

    batch = {
        "x": jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32),
        "y": jax.ShapeDtypeStruct((BATCH, OUT), jnp.float32),
    }
    return repl, init, step_fn, batch


@pytest.fixture(scope="module")
def mlp_on_v5p():
    """The MLP's `StepReport` for v5p-16, with the model's FLOPs per chip."""
    repl, init, step_fn, batch = _mlp_job(rp.tpu_devices("v5p-16"))
    state = repl.abstract(init)
    # per chip: forward 2 B W (W + O), backward 2 B W^2 (dW1) + 4 B W O (dW2 and dh)
    flops = (4 * WIDTH * WIDTH + 6 * WIDTH * OUT) * BATCH / 8
    return repl, state, repl.explain(step_fn, state, batch, model_flops=flops), flops


def test_explain_on_v5p_reads_the_tpu_program(mlp_on_v5p):
    _, state, report, flops = mlp_on_v5p
    assert report.platform == "tpu" and report.num_devices == 8
    t = report.target
    assert isinstance(t, rp.targets.TargetReport)
    assert (t.target, t.device_kind, t.slices, t.hardware) == ("v5p-16", "TPU v5", 1, "tpu-v5p")
    assert t.hbm_bytes == rp.planner.HARDWARE_PROFILES["tpu-v5p"].memory_bytes
    assert t.fits and t.over_bytes == 0 and t.fit_hint is None
    assert 0 < t.peak_bytes == report.memory.peak < t.hbm_bytes
    # the HBM libtpu allocates (jax 0.12), its arguments within it, no more than the bound
    m = report.memory
    assert m.peak == (m.compiler_peak or m.bound) and m.arguments <= m.peak <= m.bound, m
    assert (m.compiler_peak > 0) == (jax.__version_info__ >= (0, 12)), m
    assert t.step_seconds > 0 and t.compute_seconds > 0
    assert t.model_flops == flops and 0 < t.mfu <= 1
    assert t.mfu == pytest.approx(flops / (t.step_seconds * t.peak_flops))
    # the TPU program's matmuls are the step's: nothing counted twice, nothing left out
    assert report.matmul_flops == pytest.approx(flops, rel=1e-6)
    assert report.unknown_trip_counts == 0
    # the state's shapes live on the target's devices
    sharding = jax.tree.leaves(state)[0].sharding
    assert {d.platform for d in sharding.device_set} == {"tpu"}


def test_explain_on_v5p_to_json_has_the_target_keys_at_the_top(mlp_on_v5p):
    _, _, report, flops = mlp_on_v5p
    data = json.loads(report.to_json())
    assert set(TARGET_KEYS) <= set(data), set(TARGET_KEYS) - set(data)
    assert (data["target"], data["platform"], data["num_devices"]) == ("v5p-16", "tpu", 8)
    assert data["device_kind"] == "TPU v5" and data["fits"] is True
    assert data["hbm_bytes"] == rp.planner.HARDWARE_PROFILES["tpu-v5p"].memory_bytes
    assert data["step_seconds"] > 0 and data["model_flops"] == flops and 0 < data["mfu"] <= 1
    assert data["xla_seconds"] is None or data["xla_seconds"] > 0


@pytest.mark.parametrize(
    "name, kind, hardware",
    [
        ("v4-8", "TPU v4", "tpu-v4"),
        ("v5e-8", "TPU v5 lite", "tpu-v5e"),
        ("v5p-8", "TPU v5", "tpu-v5p"),
        ("v6e-8", "TPU v6 lite", "tpu-v6e"),
    ],
)
def test_explain_on_each_generation_names_its_chip(name, kind, hardware):
    repl, init, step_fn, batch = _mlp_job(rp.tpu_devices(name))
    report = repl.explain(step_fn, repl.abstract(init), batch)
    t = report.target
    assert report.platform == "tpu" and report.num_devices == rp.targets.tpu_target(name).chips
    assert (t.target, t.device_kind, t.hardware) == (name, kind, hardware)
    assert t.hbm_bytes == rp.planner.HARDWARE_PROFILES[hardware].memory_bytes and t.fits
    assert t.step_seconds > 0


@pytest.mark.parametrize("api", ["run", "replicate", "place", "distribute"])
def test_a_target_replicator_refuses_to_run_or_place(mlp_on_v5p, api):
    """Nothing runs on compile-only devices: each refusal is ours and names explain."""
    repl, state, _, _ = mlp_on_v5p
    _, _, step_fn, batch = _mlp_job(rp.tpu_devices("v5p-16"))
    calls = {
        "run": lambda: repl.run(step_fn, state, batch),
        "replicate": lambda: repl.replicate({"w": np.zeros((4,), np.float32)}),
        "place": lambda: repl.place(np.zeros((8, 4), np.float32), P("data")),
        "distribute": lambda: repl.distribute(lambda ctx: iter([{"x": np.zeros((8, 4))}])),
    }
    with pytest.raises(ValueError, match=r"Replicator\.\w+: this Replicator's devices are "
                       r"v5p-16's, .* Use repl\.explain\(step_fn, repl\.abstract\(init\)"):  # fmt: skip
        calls[api]()


def test_a_step_over_the_hbm_is_does_not_fit_error():
    """The TPU compiler refuses a step bigger than the chip's HBM: DoesNotFitError (a
    ValueError) with the compiler's words, before any report."""
    repl = rp.Replicator(mesh_shape={"data": -1}, devices=rp.tpu_devices("v5e-8"))
    n = 17 * 2**30 // 4  # 17 GiB of fp32, on every chip of 16 GiB
    state = repl.abstract(lambda: {"w": repl.replicate(jnp.zeros((n,), jnp.float32))})

    def step_fn(state, batch):
        return {"w": state["w"] * 1.5 + batch["x"].sum()}, {}

    with pytest.raises(rp.targets.DoesNotFitError, match=r"does not fit v5e-8: the TPU compiler "
                       r"refused it: .*exceeds available HBM") as info:  # fmt: skip
        repl.explain(step_fn, state, {"x": jax.ShapeDtypeStruct((8, 4), jnp.float32)})
    assert isinstance(info.value, ValueError)
    assert info.value.target == "v5e-8" and "exceeds available HBM" in info.value.shortfall


# -- 3. the TPU program's FLOPs equal the CPU program's -----------------------------------------


@pytest.mark.slow  # the fast lane compiles for a TPU in the config tests (lm_dp) and section 6
@pytest.mark.parametrize("layers", [2, 4])
def test_gpt_matmul_flops_on_v5p_equal_the_cpu_programs(layers):
    """The CLI's GPT step (scanned layers, attention's batched matmuls) for v5p-16 and for 8
    CPU devices: the same matmul FLOPs. The TPU compiler writes its loops without a trip count
    and batched matmuls as convolutions; both are read from its HLO (loops.py,
    convolution.py), so a layer counted once, or a convolution miscounted, fails here."""
    cfg = config_lib.load(
        ROOT / "configs/lm_dp.yaml",
        ["model.d_model=256", "model.heads=8", "model.seq_len=128", f"model.layers={layers}"],
    )
    assert len(jax.devices()) == 8 and jax.devices()[0].platform == "cpu"
    reports = {}
    for where, devices in (("cpu", None), ("tpu", rp.tpu_devices("v5p-16"))):
        repl, step_fn, state, batch = jobs.abstract_job(cfg, devices=devices)
        reports[where] = repl.explain(step_fn, state, batch)
    cpu, tpu = reports["cpu"], reports["tpu"]
    assert (cpu.platform, tpu.platform) == ("cpu", "tpu")
    assert tpu.unknown_trip_counts == 0 and cpu.unknown_trip_counts == 0
    assert tpu.matmul_flops == pytest.approx(cpu.matmul_flops, rel=1e-3)
    # and the layers are most of it: a loop counted once would be far off
    assert tpu.matmul_flops > 0.5 * cpu.flops


@pytest.mark.slow  # 2 compiles (tied), 1 (untied), 10-20 s each
@pytest.mark.parametrize("tied", [False, True])
def test_llama_zero3_on_v5p_reduces_in_bf16_and_looks_up_without_the_table(tied):
    """Llama (bf16 compute, ZeRO-3 over 4 chips of v5p-8) read from the TPU program: with
    ``model.reduce_dtype=bfloat16`` the gradients' reduce-scatters carry half the bytes of fp32's
    (the tied head's gather of the token table too: the tied model is compiled both ways, the
    untied one in bf16 only) and nothing else moves more; the token table, split by columns
    (``gpt.zero_split``), is never gathered for the lookup: its all-to-all carries each
    replica's ``n D`` activations."""
    args = ["model.kind=llama", "model.dtype=bfloat16", "model.d_model=256", "model.heads=8",
            "model.seq_len=256", "model.layers=2", "model.vocab=4096", "zero_stage=3",
            "global_batch=8", f"model.tie_embeddings={str(tied).lower()}"]  # fmt: skip
    reports = {}
    for reduce in ("null", "bfloat16") if tied else ("bfloat16",):
        cfg = config_lib.load(ROOT / "configs/lm_dp.yaml", [*args, f"model.reduce_dtype={reduce}"])
        repl, step_fn, state, batch = jobs.abstract_job(cfg, devices=rp.tpu_devices("v5p-8"))
        reports[reduce] = repl.explain(step_fn, state, batch)
    bf16 = reports["bfloat16"]
    scatter = lambda r: r.bytes_by(kind="reduce-scatter", axes=("data",))
    if tied:  # every gradient, the token table's as the head's too, scattered in half the bytes
        fp32 = reports["null"]
        assert scatter(fp32) > 0 and scatter(bf16) == pytest.approx(0.5 * scatter(fp32), rel=0.02)
        assert bf16.collective_bytes < fp32.collective_bytes
    else:  # every gradient scattered in bf16
        kinds = {c.dtype for c in bf16.collectives if c.kind == "reduce-scatter"}
        assert scatter(bf16) > 0 and kinds == {"bf16"}, kinds
    for r in reports.values():  # of the [4096, 256] weights only the head's is gathered whole
        whole = [c for c in r.collectives if c.kind == "all-gather" and c.bytes >= 4096 * 256 * 2]
        assert [(c.bytes, c.count) for c in whole] == [(4096 * 256 * 2, 1)], whole
        a2a = r.bytes_by(kind="all-to-all", axes=("data",))  # forward and backward
        assert a2a == pytest.approx(2 * 2 * 256 * 256 * 2, rel=0.05), a2a


@pytest.mark.slow  # one compile, about 15 s
def test_llama_with_splash_on_v5p_copies_no_activation_between_layouts(monkeypatch):
    """Splash attends heads first (`layers.attention._attend_heads_first`): queries, keys and
    values are projected straight into the kernel's ``[B, heads, S, head_dim]``, the output
    projected out of it, and the attention's ZeRO-3 parts are laid out before their gather. So
    the TPU program copies no activation between layouts (a transpose of q, k, v or their
    gradients, forward, in remat and backward)."""
    from replicator._src.report import hlo

    texts = []
    analyze = hlo.analyze
    monkeypatch.setattr(
        hlo, "analyze", lambda text, mesh, **kw: texts.append(text) or analyze(text, mesh, **kw)
    )
    args = ["model.kind=llama", "model.dtype=bfloat16", "model.d_model=512", "model.heads=4",
            "model.seq_len=512", "model.layers=2", "model.vocab=4096", "model.remat=full",
            "model.attention=splash", "zero_stage=3", "global_batch=4"]  # fmt: skip
    cfg = config_lib.load(ROOT / "configs/lm_dp.yaml", args)
    repl, step_fn, state, batch = jobs.abstract_job(cfg, devices=rp.tpu_devices("v5p-8"))
    report = repl.explain(step_fn, state, batch)
    assert report.platform == "tpu" and len(texts) == 1
    copies = re.findall(r"= bf16\[([\d,]+)\]\S* (?:copy|transpose)\(", texts[0])
    # q, k and v a chip: one sequence of 512 tokens, 4 heads of 128, in either layout
    moved = [c for c in copies if sorted(map(int, c.split(","))) == [1, 4, 128, 512]]
    assert copies and not moved, moved  # transposed to the kernel and back, they were copied


@pytest.mark.slow  # one TPU compile, about 10 s
def test_bf16_reduce_with_a_model_axis_is_refused_on_xla_cpu_and_compiles_for_a_tpu():
    """ZeRO-3 with ``reduce_dtype: bfloat16`` and a ``model`` axis aborts XLA:CPU's compiler
    (``Invalid binary instruction opcode copy``, the process gone): refused with the library's
    own error while the step is traced, naming the fixes. The TPU program of the same step,
    compiled from this CPU host, is not refused."""
    args = ["model.kind=llama", "model.dtype=bfloat16", "model.d_model=256", "model.heads=8",
            "model.seq_len=128", "model.layers=2", "model.vocab=512", "zero_stage=3",
            "model.reduce_dtype=bfloat16", "global_batch=8", "mesh.data=2", "mesh.model=2"]  # fmt: skip
    cfg = config_lib.load(ROOT / "configs/lm_dp.yaml", args)
    repl, step_fn, state, batch = jobs.abstract_job(cfg, devices=jax.devices()[:4])
    with pytest.raises(ValueError, match=r"reduce_dtype='bfloat16'.*'model' axis aborts XLA:CPU"):
        repl.explain(step_fn, state, batch)
    repl, step_fn, state, batch = jobs.abstract_job(cfg, devices=rp.tpu_devices("v5p-8"))
    assert repl.explain(step_fn, state, batch).platform == "tpu"


# -- 4. every shipped config compiles for a TPU of its mesh's size ------------------------------

# A config whose mesh has a free axis (-1) goes to 8 chips (v5p-16), one of fixed sizes to as many
# chips. The large models compile here narrowed to two layers of heads 128 wide (the splash
# kernel's), a 512-token sequence and a small vocabulary, with everything else of their config
# (family, grouped-query attention, kernel, ZeRO stage, reduce dtype, remat, dtypes, optimizer):
# the TPU compiler's time grows with the widths and the sequence, not with what it checks here.
# Whether each fits its own slice at full size is `benchmarks/config_fits.py`'s (BENCHMARKS.md).
NARROW = ["model.layers=2", "model.d_model=512", "model.heads=4", "model.d_ff=1024",
          "model.vocab=4096", "model.seq_len=512"]  # fmt: skip
BIG = {
    # MaxText's v5p-512 layout (ZeRO-3, remat full) at one sequence a chip
    "llama2_70b": ("v5p-16", [*NARROW, "model.kv_heads=1", "global_batch=8"]),
    # ZeRO-3 and remat full, one sequence a chip: the config is written for v5p-8
    "llama2_7b": ("v5p-8", [*NARROW, "model.kv_heads=4"]),
    # MaxText's v6e-256 layout (ZeRO-3 over the chips x a 4-way expert axis), one sequence a
    # chip, on 8 chips (the published row compiles at 256 in benchmarks/published.py)
    "mixtral_8x22b": ("v6e-8", [*NARROW, "model.kv_heads=1", "mesh.data=2", "global_batch=8"]),
}
# A config whose program is another's kind, at 2 layers, is left to that one here (each still
# compiles at full size in `benchmarks/config_fits.py`): gpt_7b5 (a GPT over data, as lm_dp),
# llama3_8b and llama_tiny (Llama under ZeRO-3, as llama2_7b and llama2_70b), mixtral_tiny
# (dropless experts over expert and model axes, as mixtral_8x22b).
# gemma2_9b and qwen3_30b_a3b compile at 2 layers of their full width in
# tests/test_families_tpu.py (splash's local layers, the routed rows).
SAME_KIND = {"gpt_7b5": "lm_dp", "llama3_8b": "llama2_7b", "llama_tiny": "llama2_70b",
             "mixtral_tiny": "mixtral_8x22b", "gemma2_9b": "test_families_tpu.py",
             "qwen3_30b_a3b": "test_families_tpu.py"}  # fmt: skip
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml") if p.stem not in SAME_KIND)


def _target_for(name: str) -> tuple[str, list[str]]:
    if name in BIG:
        return BIG[name]
    mesh = config_lib.load(ROOT / "configs" / f"{name}.yaml").mesh
    fixed = math.prod(v for v in mesh.values() if v != -1)
    chips = math.lcm(fixed, 8) if -1 in mesh.values() else fixed
    return (f"v5p-{2 * chips}" if chips >= 4 else f"v5e-{chips}"), []


# compiled by CI's jax 0.12 lane too (both_lanes: its libtpu is another compiler): one config of
# each kind of program, splash with ZeRO-3 (v5p), remat by name, a pipeline, experts over an
# `expert` axis (v6e)
BOTH_LANES = ("llama2_7b", "llama2_70b", "lm_pipeline", "mixtral_8x22b")
# the two largest of them compile on jax 0.12 alone (CI's time): lane 1 has llama2_7b's kind
LANE_2_ONLY = ("llama2_70b", "mixtral_8x22b")


def _marks(name: str) -> list:
    # the fast lane compiles lm_dp's; every config compiles in the whole suite (3-30 s each)
    if name == "lm_dp":
        return []
    return [pytest.mark.slow, *([pytest.mark.both_lanes] if name in BOTH_LANES else [])]


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in CONFIGS])
def test_every_config_compiles_for_a_tpu_of_its_mesh_and_fits(name, tmp_path, capfd):
    """``replicator explain configs/NAME.yaml --target T --quick``, as typed: the CLI compiles
    in a process of its own (`cli.isolated`), so an abort there would be exit 2 here, never
    this process gone. A step the TPU compiler rejects (or aborts on) fails, as does one that
    does not fit. Its stderr carries none of libtpu's start-up warnings."""
    if name in LANE_2_ONLY and jax.__version_info__ < (0, 12):
        pytest.skip("compiled by CI's jax 0.12 lane (libtpu 0.0.50.1, the benchmarks' compiler)")
    target, overrides = _target_for(name)
    out = tmp_path / "report.json"
    code = cli.main(
        ["explain", f"{ROOT}/configs/{name}.yaml", *overrides, "--target", target,
         "--json", str(out), "--quick"]
    )  # fmt: skip
    run = capfd.readouterr()
    assert code == 0, f"exit {code} for {target}:\n{_why(run.err)}"
    assert not _noise(run.err), _noise(run.err)
    assert "): fits: peak" in run.out, run.out  # the report's line, as a user reads it
    report = json.loads(out.read_text())
    assert report["platform"] == "tpu" and report["target"] == target
    assert report["num_devices"] == rp.targets.tpu_target(target).chips
    assert report["fits"] is True, (report["peak_bytes"], report["hbm_bytes"])
    assert report["step_seconds"] > 0 and report["unknown_trip_counts"] == 0
    assert f"on {target} (" in run.out


@pytest.mark.slow  # one compile, about 10 s
def test_splash_on_a_mesh_that_names_model_and_expert_of_size_1_compiles_for_a_tpu(tmp_path):
    """A Pallas kernel compiles for the TPU only where every mesh axis is manual: a config
    whose mesh names ``model: 1`` and ``expert: 1`` (axes left to XLA) failed with JAX's
    "Mosaic kernels cannot be automatically partitioned"; the kernel's call is mapped by hand
    over them."""
    out = tmp_path / "report.json"
    run = _python(
        "-m", "replicator.cli", "explain", "configs/llama_tiny.yaml", "model.attention=splash",
        "model.seq_len=128", "mesh.data=4", "mesh.model=1", "mesh.expert=1", "--target",
        "v5p-8", "--json", out, "--quick",
    )  # fmt: skip
    assert run.returncode == 0, _why(run.stderr)
    assert json.loads(out.read_text())["fits"] is True


@pytest.mark.slow  # three compiles, 10-15 s each (on libtpu 0.0.42.1: two, then one again)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_llama_tiny_explains_with_the_per_layer_compiles(accumulate, tmp_path, capsys):
    """Without ``--quick``, a scanned Llama (ZeRO-3 with a ``model`` axis) is compiled twice
    more, with one and with two layers unrolled (and accumulation's micro-batches), for XLA's
    estimate. libtpu 0.0.50.1 compiles them; libtpu 0.0.42.1 aborts in them (XLA's SPMD
    partitioner, ``IsManualSubgroup``): the step is compiled again without, its estimate
    scaled, and the report says why."""
    target, overrides = _target_for("llama_tiny")
    out = tmp_path / "report.json"
    code = cli.main(
        ["explain", f"{ROOT}/configs/llama_tiny.yaml", *overrides,
         f"accumulate_steps={accumulate}", "--target", target, "--json", str(out)]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err[-3000:]
    report = json.loads(out.read_text())
    assert report["xla_seconds"] > 0 and report["fits"] is True
    how = report["xla_seconds_how"]
    if jax.__version_info__ < (0, 12):
        assert "ended the process (SIGABRT) compiling the step with its layers unrolled" in how
        assert "jax 0.12 with libtpu 0.0.50.1 compiles" in how
    elif accumulate == 1:
        assert "with 1 and 2 layers unrolled" in how, how
    else:
        assert "with 1 and 2 layers and its 2 micro-batches unrolled" in how, how


# -- 5. the CLI ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_explain_target_writes_the_report_json(tmp_path, capsys):
    out = tmp_path / "lm_dp.json"
    code = cli.main(
        ["explain", str(ROOT / "configs/lm_dp.yaml"), "--target", "v5p-16", "--json", str(out)]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "on v5p-16 (TPU v5, tpu-v5p): fits" in printed and f"wrote {out}" in printed
    data = json.loads(out.read_text())
    assert set(TARGET_KEYS) <= set(data), set(TARGET_KEYS) - set(data)
    assert (data["target"], data["platform"], data["num_devices"]) == ("v5p-16", "tpu", 8)
    assert data["device_kind"] == "TPU v5" and data["fits"] is True and data["slices"] == 1
    assert data["mesh"] == {"data": 8}
    assert data["step_seconds"] > 0 and data["model_flops"] > 0 and 0 < data["mfu"] <= 1
    assert data["hbm_bytes"] == rp.planner.HARDWARE_PROFILES["tpu-v5p"].memory_bytes


def test_cli_explain_two_slices_adds_a_dcn_data_axis(tmp_path, capsys):
    """The TPU writes a collective's part across slices as a ``send`` to the DCN runtime (with
    ``_xla_megascale_*`` attributes), after its part inside each slice: `explain` reads it as a
    collective over ``dcn_data``, priced at the DCN's bandwidth."""
    out = tmp_path / "lm_dp.json"
    code = cli.main(
        ["explain", str(ROOT / "configs/lm_dp.yaml"), "--target", "v5p-16", "--slices", "2",
         "--json", str(out)]
    )  # fmt: skip
    capsys.readouterr()
    assert code == 0
    data = json.loads(out.read_text())
    assert (data["target"], data["num_devices"], data["slices"]) == ("2 x v5p-16", 16, 2)
    assert data["mesh"] == {"dcn_data": 2, "data": 8}
    assert data["fits"] is True and data["platform"] == "tpu"
    # the gradients' all-reduce crosses the slices: part of it is on the DCN
    assert any("dcn_data" in c["axes"] for c in data["collective_summary"]), [
        (c["kind"], c["axes"]) for c in data["collective_summary"]
    ]
    assert data["dcn_seconds"] > 0


@pytest.mark.slow  # four TPU programs of 2 x v5p-16, about 10 s each
@pytest.mark.parametrize(
    "zero, reduce, hybrid", [(0, None, False), (3, None, False), (0, "bfloat16", False),
                             (3, None, True)]
)  # fmt: skip
def test_the_bytes_across_slices_are_the_hierarchical_formulas(
    tmp_path, capsys, zero, reduce, hybrid
):
    """`configs/lm_dp.yaml` at width 512 (12.9M parameters) on 2 x v5p-16 (``dcn_data=2
    data=8``). XLA reduces inside each slice, across the slices on a chip's ``1 / data`` of
    the buffer, then gathers inside; so a chip sends across slices, a step, with ``G`` the
    gradients' fp32 bytes:

    - ZeRO-0: the all-reduce, ``2 (S-1)/S x G / data``;
    - ZeRO-3 over both slices: the gathers forward and backward, ``2 x (S-1)/S x G / data``,
      and the scatter, ``(S-1)/S x G / data``;
    - ZeRO-0 with ``model.reduce_dtype: bfloat16``: the all-reduce in bf16, half of fp32's;
    - hybrid ZeRO-3 (``zero_axes: [data]``: split inside each slice, whole on each): no
      gather crosses; the mean of each chip's reduced part across the slices, an all-reduce
      of ``G / data``: ``2 (S-1)/S x G / data``, as ZeRO-0.

    Read from the program within 2% (the small leaves cross padded to the TPU's tiles; the
    token table's columns are looked up by an all-to-all, not gathered)."""
    from replicator.cli import jobs as jobs_lib
    from replicator.models import sizes

    overrides = ["model.d_model=512", "model.heads=8", f"zero_stage={zero}"]
    overrides += [f"model.reduce_dtype={reduce}"] if reduce else []
    overrides += ["zero_axes=[data]"] if hybrid else []
    out = tmp_path / "lm_dp.json"
    argv = ["explain", str(ROOT / "configs/lm_dp.yaml"), *overrides, "--target", "v5p-16",
            "--slices", "2", "--quick", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["mesh"] == {"dcn_data": 2, "data": 8}
    across = collections.Counter()
    for c in data["collective_summary"]:
        if c["axes"] == ["dcn_data"] and c["dtype"] == ("bf16" if reduce else "f32"):
            across[c["kind"]] += c["wire_bytes"]
    cfg = config_lib.load(str(ROOT / "configs/lm_dp.yaml"), overrides)
    params = sizes.model_shape(jobs_lib.gpt_config(cfg), cfg.global_batch).num_params
    grads = (2 if reduce else 4) * params
    s, d = 2, 8
    if zero == 0 or hybrid:
        assert set(across) == {"all-reduce"}, across
        assert across["all-reduce"] == pytest.approx(2 * (s - 1) / s * grads / d, rel=0.01)
    else:
        assert across["all-gather"] == pytest.approx(2 * (s - 1) / s * grads / d, rel=0.02)
        assert across["reduce-scatter"] == pytest.approx((s - 1) / s * grads / d, rel=0.02)
    assert data["dcn_seconds"] > 0
    every = [c["wire_bytes"] for c in data["collective_summary"] if "dcn_data" in c["axes"]]
    assert sum(data["dcn_bytes"].values()) == pytest.approx(sum(every))  # the report's line
    if hybrid:  # nothing else crosses: no gather, and the token lookup stays in the slice
        assert sum(every) == pytest.approx(across["all-reduce"])


@pytest.mark.slow  # a TPU program of 2 x v5p-16, about 10 s
def test_stages_across_slices_send_only_the_stage_sends_and_shared_grads(tmp_path, capsys):
    """``pipeline.across_slices: true`` on 2 x v5p-16 (``{stage 2, data 8}``: stage ``j`` is
    slice ``j``): what crosses is each tick's two stage sends (activations forward, cotangents
    back, one micro-batch each: 1F1B's ``M + 2K - 2`` ticks) and the mean over the stages of
    the parameters outside the stage blocks (embedding, head), read as collectives over
    ``stage``; the data axis's reductions stay inside each slice."""
    out = tmp_path / "pipe.json"
    keys = ["model.d_model=512", "model.heads=8", "mesh.stage=2", "mesh.data=8",
            "pipeline.across_slices=true"]  # fmt: skip
    argv = ["explain", str(ROOT / "configs/lm_pipeline.yaml"), *keys, "--target", "v5p-16",
            "--slices", "2", "--quick", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["mesh"] == {"data": 8, "stage": 2}
    cfg = config_lib.load(str(ROOT / "configs/lm_pipeline.yaml"), keys)
    k, m = 2, cfg.pipeline.microbatches
    rows = cfg.global_batch // 8 // m  # a micro-batch of a replica
    activation = rows * cfg.model.seq_len * 512 * 4  # fp32
    ticks = m + 2 * k - 2
    assert data["dcn_bytes"]["one-to-one"] == 2 * ticks * activation
    crossing = {(c["kind"], tuple(c["axes"])) for c in data["collective_summary"]}
    assert ("one-to-one", ("stage",)) in crossing and ("all-reduce", ("data",)) in crossing
    outside = (256 * 512 + 64 * 512 + 512 * 256 + 2 * 512) * 4  # embedding, head: fp32 bytes
    assert 0 < data["dcn_bytes"]["all-reduce"] <= outside
    assert set(data["dcn_bytes"]) == {"one-to-one", "all-reduce"}


@pytest.mark.slow  # two TPU programs of 2 x v5p-16, about 10 s each
def test_diloco_sends_an_eighth_of_the_bytes_across_slices(tmp_path, capsys):
    """``local_steps: 8`` on 2 x v5p-16: one program of 8 optimizer steps sends across slices
    what one synchronous step sends (each chip averages its ``1 / data`` part of the parameter
    deltas across the slices): an eighth a step, read from the two programs."""
    across = {}
    for h in (None, 8):
        out = tmp_path / f"lm_dp_{h}.json"
        keys = ["model.d_model=512", "model.heads=8", "global_batch=128"]
        keys += [f"local_steps={h}"] if h else []
        argv = ["explain", str(ROOT / "configs/lm_dp.yaml"), *keys, "--target", "v5p-16",
                "--slices", "2", "--quick", "--json", str(out)]  # fmt: skip
        assert cli.main(argv) == 0, capsys.readouterr().err
        data = json.loads(out.read_text())
        assert data["optimizer_steps"] == (h or 1)
        across[h] = sum(data["dcn_bytes"].values())
    printed = capsys.readouterr().out
    assert "local SGD: a step is 8 optimizer steps" in printed
    assert across[8] == pytest.approx(across[None], rel=0.02)  # one exchange of the same size
    assert across[8] / 8 / across[None] == pytest.approx(1 / 8, rel=0.02)  # an eighth a step


def _refused(capsys, *args, tries: bool = False) -> str:
    """The one line of a refused ``explain lm_dp``; with ``tries``, after the changes it tried
    (one a line)."""
    code = cli.main(["explain", str(ROOT / "configs/lm_dp.yaml"), *args])
    err = capsys.readouterr().err
    assert code == 2, err
    *tried, line = err.rstrip().splitlines()
    assert all(t.startswith("  does not fit: trying ") for t in tried) and (tries or not tried), err
    assert line.startswith("replicator explain: "), err
    return line


def test_stages_across_slices_need_a_stage_axis_of_the_slices():
    """``pipeline.across_slices`` lays ``mesh.stage`` across the slices: refused, naming the
    keys, when the stages are not a multiple of the slices or a ``dcn_data`` axis is given."""
    from replicator.cli import targets as cli_targets

    target = rp.targets.tpu_target("v5p-16", slices=2)
    base = config_lib.load(str(ROOT / "configs/lm_pipeline.yaml"), ["pipeline.across_slices=true"])
    for mesh in ({"data": 16, "stage": 1}, {"dcn_data": 2, "data": 4, "stage": 2}):
        with pytest.raises(ValueError, match="give mesh.stage a multiple of 2 and no mesh.dcn"):
            cli_targets.mesh_on_target(dataclasses.replace(base, mesh=mesh), target)
    staged = cli_targets.mesh_on_target(
        dataclasses.replace(base, mesh={"data": 8, "stage": 2}), target
    )
    assert staged.mesh == {"data": 8, "stage": 2}  # no dcn_data added
    plain = dataclasses.replace(
        base, pipeline=dataclasses.replace(base.pipeline, across_slices=False)
    )
    assert "dcn_data" in cli_targets.mesh_on_target(plain, target).mesh


def test_cli_slices_without_a_target_is_refused(capsys):
    line = _refused(capsys, "--slices", "2")
    assert "--slices counts TPU slices of a --target; give --target too." in line
    line = _refused(capsys, "--quick")
    assert "--quick skips compiles of a --target's step; give --target too." in line


@pytest.mark.parametrize("bad, valid", [("v7-8", "v5p-16"), ("v5p-12", "v5p-16"),
                                        ("v5e-512", "v5e-2")])  # fmt: skip
def test_cli_a_bad_target_is_refused_in_one_line(capsys, bad, valid):
    """The message names the bad target and a valid one."""
    line = _refused(capsys, "--target", bad)
    assert f"target {bad!r}" in line and valid in line
    rp.targets.tpu_target(valid)


def test_cli_a_mesh_that_is_not_the_targets_chips_is_refused(capsys):
    code = cli.main(["explain", str(ROOT / "configs/lm_3d.yaml"), "--target", "v5p-8"])
    err = capsys.readouterr().err
    assert code == 2
    assert "does not make the 4 chips of v5p-8" in err and len(err.strip().splitlines()) == 1


def test_cli_target_refuses_data_path(capsys, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("hello " * 1000)
    line = _refused(capsys, f"data.path={text}", "--target", "v5p-16")
    assert "a target compiles from shapes only" in line


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_cli_explain_target_the_mlp_at_every_zero_stage(tmp_path, capsys, zero_stage):
    """The built-in MLP's state is built from shapes at every ZeRO stage (its parameters are
    drawn with NumPy inside ``init``)."""
    out = tmp_path / "mlp.json"
    code = cli.main(
        ["explain", str(ROOT / "configs/mlp_zero.yaml"), f"zero_stage={zero_stage}",
         "--target", "v5p-16", "--json", str(out)]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    data = json.loads(out.read_text())
    assert (data["target"], data["platform"], data["fits"]) == ("v5p-16", "tpu", True)


@pytest.mark.slow
def test_cli_a_mesh_over_part_of_a_torus_axis_is_laid_out_or_refused_in_one_line(capsys):
    """{data: 32, model: 2} on v5p-128 (a 4x4x4 torus): the model axis takes part of a physical
    axis, which jax.make_mesh does not do by itself on v5p. It compiles, or is refused in one
    line (exit 2), never a traceback."""
    code = cli.main(
        ["explain", str(ROOT / "configs/lm_dp.yaml"), "mesh.data=32", "mesh.model=2",
         "--target", "v5p-128"]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code in (0, 2), captured.err[-2000:]
    if code == 0:
        assert "on v5p-128 (TPU v5, tpu-v5p): fits" in captured.out
    else:
        assert len(captured.err.strip().splitlines()) == 1, captured.err


@pytest.mark.slow
def test_cli_a_model_over_the_hbm_names_the_smallest_change_that_fits(capsys):
    """lm_dp at 1.6 B parameters under ZeRO-2 on 8 v5e chips of 16 GiB: the TPU compiler
    refuses it (17.5 GB of temporaries); the one line says so and names the first change
    (compiled) that fits, ZeRO-3. (From ZeRO-2, two compiles; from ZeRO-0 it would be four.)"""
    line = _refused(
        capsys,
        "model.d_model=4096",
        "model.heads=32",
        "model.layers=8",
        "zero_stage=2",
        "--target",
        "v5e-8",
        tries=True,
    )
    assert "lm_dp does not fit v5e-8: the TPU compiler refused the step: " in line
    assert "exceeds available HBM" in line
    assert "smallest change that fits: zero_stage=3 (peak " in line
    assert "Traceback" not in line


# -- 6. libtpu's start-up warnings ------------------------------------------------------------


def test_libtpu_start_up_warnings_do_not_reach_the_user():
    """On importing replicator; a command that compiles for a TPU is each config's test above."""
    run = _python("-c", "import replicator, jax; print(jax.devices())")
    assert run.returncode == 0, run.stderr[-3000:]
    assert not _noise(run.stderr), _noise(run.stderr)
    assert "CpuDevice" in run.stdout


def test_a_target_program_stays_out_of_the_persistent_compilation_cache(tmp_path):
    """JAX writes a compile-only TPU executable to its persistent cache and then cannot read it
    back (a warning on every later compile): replicator leaves those programs out, and the CPU
    programs of the same process in. Two processes compile the same TPU and CPU programs."""
    code = (
        "import warnings, jax, jax.numpy as jnp, numpy as np, replicator as rp\n"
        "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
        "warnings.simplefilter('error')\n"
        "mesh = Mesh(np.array(rp.tpu_devices('v5p-8')), ('d',))\n"
        "x = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P('d')))\n"
        "jax.jit(lambda x: (jnp.sin(x) @ x.T).sum()).lower(x).compile()\n"
        "print(float(jax.jit(lambda v: (v * 2).sum())(jnp.ones(3))))\n"
    )
    env = {**_fresh_env(), "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # fmt: skip
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             cwd=ROOT, env=env, timeout=300)  # fmt: skip
        assert run.returncode == 0 and "persistent compilation cache" not in run.stderr, run.stderr
        assert run.stdout.strip() == "6.0"
    names = [p.name for p in (tmp_path / "cache").glob("*-cache")]
    assert any(n.startswith("jit__lambda") for n in names)  # the CPU program, cached
    assert len([n for n in names if n.startswith("jit__lambda")]) == 1, names  # not the TPU's
