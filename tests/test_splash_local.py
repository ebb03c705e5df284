"""The splash kernel's sliding window and logit soft-cap (Gemma 2/3, Mistral), exact against jnp.

A window ``W`` is transformers' ``sliding_window``: query ``i`` sees key ``j`` iff ``0 <= i - j <
W``; a soft cap ``c`` turns the scaled scores ``s = q.k / sqrt(head_dim)`` into ``c tanh(s / c)``
before the mask and the softmax. Off a TPU the kernel runs in Pallas's interpreter, tile by
tile: tiles of 128 (`splash.BLOCK` set so) make a 384-token window skip whole tiles, and the
program then holds no ``[seq, seq]`` array at all, so a mask of that shape would show.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replicator._src.sharded import splash


@pytest.fixture
def block(monkeypatch):
    """Sets the kernel's tile (`splash.BLOCK`); the kernels built under it are dropped after
    (`splash._kernel`'s cache does not key on the tile)."""
    splash._kernel.cache_clear()
    yield lambda size: monkeypatch.setattr(splash, "BLOCK", size)
    splash._kernel.cache_clear()


def _qkv(seq: int, q_scale: float = 1.0):
    keys = jax.random.split(jax.random.key(7), 4)
    q = q_scale * jax.random.normal(keys[0], (1, seq, 2, 128))  # 2 query heads, 1 K/V head
    k, v = (jax.random.normal(key, (1, seq, 1, 128)) for key in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], q.shape)


def _reference(q, k, v, *, window=None, soft_cap=None, cap_unscaled=False):
    """Gemma 2's attention in fp32 (``[batch, seq, heads, head_dim]``): scores scaled, capped,
    masked (causal, within ``window``), softmax."""
    seq, dim = q.shape[1], q.shape[3]
    k, v = (jnp.repeat(a, q.shape[2] // a.shape[2], axis=2) for a in (k, v))
    scale = 1 / np.sqrt(dim)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q if cap_unscaled else q * scale, k, precision="highest")
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = scores * scale if cap_unscaled else scores
    gap = np.arange(seq)[:, None] - np.arange(seq)[None, :]  # i - j
    visible = (gap >= 0) & (gap < (seq if window is None else window))
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision="highest")


def _close(a, b):
    """Equal up to fp32 rounding, which scales with the largest entries: where the reference's
    gradient is exactly 0 (query 0 sees only itself), the kernel's is a few 1e-6 of ``|b|``."""
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=4e-6 * float(np.max(np.abs(b))))


def _far(a, b) -> bool:
    return not np.allclose(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("window", [1, 3, 64])
def test_the_window_mask_is_transformers_sliding_window(window):
    """``LocalMask(window_size=(W - 1, 0))`` sees ``i - W < j <= i``: W keys, the query's own
    among them; neither W + 1 keys nor W - 1."""
    seq = 128
    mask = splash._mask(splash.mask_key(True, window=window), seq, seq)[0:seq, 0:seq]
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    np.testing.assert_array_equal(mask, (j <= i) & (i - j < window))
    assert mask.sum(1).max() == window and mask[window - 1, 0] and not mask[window, 0]


CASES = {  # name: (seq, tile, window, soft_cap, query scale)
    "window": (256, 512, 64, None, 1.0),  # one tile of 256
    "window-skips-tiles": (384, 128, 64, None, 1.0),  # 3 x 3 tiles: the corner one skipped
    "soft-cap": (256, 512, None, 50.0, 5.0),
    "window-and-soft-cap": (384, 128, 64, 50.0, 5.0),
}


@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_equal_a_jnp_reference(case, block):
    seq, tile, window, soft_cap, q_scale = CASES[case]
    block(tile)
    q, k, v, w = _qkv(seq, q_scale)
    f = lambda q, k, v: splash.splash_attention(q, k, v, window=window, soft_cap=soft_cap)
    ref = lambda q, k, v: _reference(q, k, v, window=window, soft_cap=soft_cap)
    out, want = f(q, k, v), ref(q, k, v)
    _close(out, want)
    grads = lambda f: jax.grad(lambda *a: jnp.sum(w * f(*a)), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(grads(f), grads(ref), strict=True):
        _close(a, b)
    # the options matter here: without them, or a window one off, or capped before the scale,
    # the reference is another
    assert _far(want, _reference(q, k, v))
    if window is not None:
        for other in (window - 1, window + 1):
            assert _far(want, _reference(q, k, v, window=other, soft_cap=soft_cap))
    if soft_cap is not None:
        assert _far(want, _reference(q, k, v, window=window))
        assert _far(want, _reference(q, k, v, window=window, soft_cap=soft_cap, cap_unscaled=True))


def test_live_pairs_of_a_window_are_the_tiles_the_kernel_computes(block):
    """4096 tokens in tiles of 512 (8 x 8), a window of 1024: a tile's queries reach keys at
    most 1535 tokens back, so the diagonal and the two below it are live, 8 + 7 + 6 = 21 tiles
    (causal: 36). The kernel's own table of tiles agrees, and stores no partial mask."""
    key = splash.mask_key(True, window=1024)
    assert key == ("local", 1024) and hash(key) == hash(("local", 1024))
    assert splash.live_pairs(4096, key=key) == 21 * 512 * 512
    assert splash.live_pairs(4096) == 36 * 512 * 512
    info = splash._kernel(1, 4096, 4096, key, True, False).fwd_mask_info
    assert np.count_nonzero(np.asarray(info.block_mask)) == 21
    assert info.partial_mask_blocks is None  # computed in the kernel, from the tile's indices
    assert splash.live_pairs(4096, key=("local", 4096)) == splash.live_pairs(4096)


def test_the_flops_tag_counts_the_windowed_tiles_and_no_seq_by_seq_array_is_built(block):
    """In tiles of 128, 384 tokens with a window of 64 run 5 of 9 tiles (the diagonal and the
    one below), and the tag says so. Neither the forward nor the backward program holds a
    ``384 x 384`` array (the interpreter runs the kernel's 128 x 128 tiles), where the jnp
    reference's does: no ``[seq, seq]`` mask enters the program."""
    block(128)
    q, k, v, _ = _qkv(384)
    f = lambda q, k, v: splash.splash_attention(q, k, v, window=64, soft_cap=50.0)
    loss = lambda f: lambda *a: jnp.sum(f(*a))
    text = jax.jit(f).lower(q, k, v).as_text(debug_info=True)
    flops = 4 * 128 * 5 * 128 * 128 * 2  # QK^T and PV, 5 tiles, 2 heads
    tags = set(re.findall(r"replicator_kernel_flops_\d+", text))
    assert tags == {splash.KERNEL_FLOPS.format(flops)}
    backward = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2))).lower(q, k, v).as_text()
    for program in (text, backward):
        assert "384x384" not in program
    reference = lambda q, k, v: _reference(q, k, v, window=64, soft_cap=50.0)
    assert "384x384" in jax.jit(reference).lower(q, k, v).as_text()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"window": 0}, "window=0; use a positive int"),
        ({"window": 2.5}, "window=2.5; use a positive int"),
        ({"soft_cap": 0.0}, "soft_cap=0.0; use a positive number"),
    ],
)
def test_a_bad_window_or_soft_cap_is_refused(kwargs, match):
    q, k, v, _ = _qkv(128)
    with pytest.raises(ValueError, match=match):
        splash.splash_attention(q, k, v, **kwargs)


def test_a_window_over_positions_out_of_order_is_refused():
    with pytest.raises(ValueError, match="a sliding window needs tokens in natural order"):
        splash.mask_key(True, positions=[0, 2, 1, 3], window=2)
    with pytest.raises(ValueError, match="a sliding window is causal, got causal=False"):
        splash.mask_key(False, window=2)
    assert splash.mask_key(True, positions=[5, 6, 7], window=2) == ("local", 2)
