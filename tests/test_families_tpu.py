"""The families' TPU programs, compiled here for a v5p (libtpu, nothing runs), at 2 layers of
their full width: Gemma 2 9B's sliding-window layers run in the splash kernel (no ``S x S``
array in the program) and fit; Qwen3-30B-A3B's 128 experts compute the routed rows only
(dropless, the TPU's grouped matmuls). `benchmarks/families_tpu.py` compiles them whole."""

import os
import re

import pytest

import replicator as rp

pytestmark = pytest.mark.slow  # one TPU compile each, 30-90 s
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compiled(config: str, target: str, overrides: list[str], monkeypatch):
    from replicator._src.report import hlo
    from replicator.cli import config as config_lib
    from replicator.cli import jobs

    cfg = config_lib.load(os.path.join(ROOT, "configs", f"{config}.yaml"), overrides)
    repl, step_fn, state, batch = jobs.abstract_job(cfg, devices=rp.tpu_devices(target))
    texts, analyze = [], hlo.analyze
    monkeypatch.setattr(
        hlo, "analyze", lambda text, *a, **k: texts.append(text) or analyze(text, *a, **k)
    )
    return cfg, repl.explain(step_fn, state, batch), texts[-1]


def seq_by_seq(text: str, seq: int) -> set[str]:
    shapes = re.findall(r"\b(?:bf16|f32|s32|pred|s8|u8)\[([\d,]+)\]", text)
    return {s for s in shapes if [int(d) for d in s.split(",")].count(seq) >= 2}


def test_gemma2_9b_runs_its_local_layers_in_splash_and_fits(monkeypatch):
    pytest.importorskip("libtpu")
    cfg, report, text = compiled("gemma2_9b", "v5p-128", ["model.layers=2"], monkeypatch)
    assert report.platform == "tpu" and report.target.fits, report.target
    assert report.kernel_flops > 0  # the splash kernels
    assert cfg.model.sliding_window < cfg.model.seq_len
    assert not seq_by_seq(text, cfg.model.seq_len)
    # the check can fail: XLA's attention over a window builds its scores whole
    import jax
    import jax.numpy as jnp

    from replicator.models.layers.masked_attention import masked_attention

    q = jax.ShapeDtypeStruct((1, 1024, 2, 64), jnp.bfloat16)
    pos = jnp.arange(1024)
    xla = jax.jit(lambda q: masked_attention(q, q, q, q_pos=pos, k_pos=pos, window=512))
    assert seq_by_seq(xla.lower(q).compile().as_text(), 1024)


def test_qwen3_30b_a3b_computes_the_routed_rows_and_fits(monkeypatch):
    """The experts' grouped matmuls alone (XLA's attention, no remat: the only Pallas kernels,
    each layer's rows computed 3 times) against the routed rows, as the program's tags count
    them and as the kernels' shapes (their rows padded to their tiles) give them."""
    pytest.importorskip("libtpu")
    over = ["model.layers=2", "model.attention=dot_product", "model.remat=false",
            "model.moe_chunks=1"]  # fmt: skip
    cfg, report, text = compiled("qwen3_30b_a3b", "v5p-64", over, monkeypatch)
    assert report.platform == "tpu" and report.target.fits, report.target
    m = cfg.model
    assert (m.experts, m.top_k, m.capacity_factor) == (128, 8, None)
    tokens = cfg.global_batch * m.seq_len / report.num_devices
    routed = 3 * 2 * 3 * m.d_model * m.d_ff * tokens * m.top_k * m.layers
    assert 1.0 <= report.kernel_flops / routed <= 1.1, report.kernel_flops / routed
    from replicator._src.report import hlo

    untagged = hlo.analyze(re.sub(r"replicator_kernel_flops_\d+", "kernel", text), report.mesh)
    assert 1.0 <= untagged.kernel_flops / routed <= 1.1, untagged.kernel_flops / routed
