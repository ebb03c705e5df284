"""Which context and expert axes `enumerate_layouts` tries for a model: plain Python.

The ``context`` axis splits every sequence (ring attention or all-to-all attention across it);
the ``expert`` axis splits a mixture of experts' experts. Both are left to XLA inside a step, as
``model`` is; the planner compiles each split and reads its collectives (the ring's
collective-permutes, the all-to-alls) from the program like any other.
"""

from __future__ import annotations

from collections.abc import Sequence

# Attention over a context axis: K/V blocks round a ring, or all-to-alls over the heads.
ATTENTIONS = ("ring", "all_to_all")
# Context axes are tried for sequences of at least this many tokens (`enumerate_layouts`).
MIN_CONTEXT_SEQ = 512
# ... and only where each device keeps at least this many tokens of every sequence.
MIN_CONTEXT_CHUNK = 64


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def token_splits(
    n: int, *, seq_len: int | None, attention: Sequence[str], zigzag: bool,
    min_context_seq: int, max_context: int | None, num_experts: int, max_expert: int | None,
) -> list[tuple[int, int, str | None]]:  # fmt: skip
    """The ``(expert, context, attention)`` splits of ``n`` devices to try, the plain one
    ``(1, 1, None)`` first (the rule is `enumerate_layouts`'; its options are checked by their
    records):

    >>> token_splits(8, seq_len=512, attention=ATTENTIONS, zigzag=True,
    ...              min_context_seq=512, max_context=4, num_experts=0, max_expert=None)
    [(1, 1, None), (1, 2, 'ring'), (1, 2, 'all_to_all'), (1, 4, 'ring'), (1, 4, 'all_to_all')]
    >>> token_splits(8, seq_len=64, attention=ATTENTIONS, zigzag=True,
    ...              min_context_seq=512, max_context=None, num_experts=6, max_expert=None)
    [(1, 1, None), (2, 1, None)]
    """
    splits: list[tuple[int, int, str | None]] = [(1, 1, None)]
    if num_experts:
        splits += [
            (e, 1, None) for e in _divisors(n)
            if e > 1 and num_experts % e == 0 and (max_expert is None or e <= max_expert)
        ]  # fmt: skip
        return splits
    if seq_len is None or seq_len < min_context_seq:
        return splits
    seq = seq_len
    for c in _divisors(n):
        if c == 1 or (max_context is not None and c > max_context):
            continue
        if seq % c or seq // c < MIN_CONTEXT_CHUNK:
            continue
        for attn in (a for a in ATTENTIONS if a in attention):
            if attn == "ring" and zigzag and seq % (2 * c):
                continue
            splits.append((1, c, attn))
    return splits
