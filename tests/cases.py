"""Cases for the oracle tests whose settings multiply: every pair of settings, not every product.

A test over schedules x remat policies x optimizers has 30 cases; almost every defect needs only
two settings to show (a schedule with a remat policy, a policy with an optimizer), so the cases
that hold every *pair* of values at least once find it at half the cost (all-pairs testing).
Where another test already runs a pair's whole product (``test_pipeline.py`` runs every schedule
under every remat policy), :func:`each_value` keeps one case per value.

    >>> [p.id for p in pairwise(name=["a", "b"], remat=["x", "y"], opt=["s", "t"])]
    ['a-x-s', 'a-y-t', 'b-x-t', 'b-y-s']
    >>> [p.id for p in each_value(name=["a", "b", "c"], remat=["x", "y"])]
    ['a-x', 'b-y', 'c-x']
"""

from __future__ import annotations

import itertools

import pytest


def _axes(axes: dict) -> list[list[tuple[str, object]]]:
    """Each axis as (id, value) pairs: a dict gives its ids, a list its values' str."""
    return [
        list(values.items()) if isinstance(values, dict) else [(str(v), v) for v in values]
        for values in axes.values()
    ]


def _param(row) -> pytest.param:
    return pytest.param(*(value for _, value in row), id="-".join(name for name, _ in row))


def pairwise(**axes) -> list:
    """Cases in which every value of each axis meets every value of every other axis at least once.

    The two largest axes are crossed in full; each further axis takes, row by row, the value that
    meets the most pairs not met yet, and a pair still unmet after that gets a row of its own.
    Arguments are in the test's parameter order.
    """
    values = _axes(axes)
    order = sorted(range(len(values)), key=lambda i: -len(values[i]))
    first, second, rest = order[0], order[1], order[2:]
    rows, met = [], set()
    for a, b in itertools.product(range(len(values[first])), range(len(values[second]))):
        row = {first: a, second: b}
        for axis in rest:
            row[axis] = max(
                range(len(values[axis])),
                key=lambda v: sum((k, row[k], axis, v) not in met for k in row),
            )
        met |= {(i, row[i], j, row[j]) for i in row for j in row if i != j}
        rows.append(row)
    for i, j in itertools.combinations(range(len(values)), 2):  # a pair still unmet: its own row
        for a, b in itertools.product(range(len(values[i])), range(len(values[j]))):
            if (i, a, j, b) not in met:
                rows.append({**dict.fromkeys(range(len(values)), 0), i: a, j: b})
                met |= {(i, a, j, b), (j, b, i, a)}
    return [_param([values[k][row[k]] for k in range(len(values))]) for row in rows]


def each_value(**axes) -> list:
    """As many cases as the longest axis has values; every value of every axis in one of them."""
    values = _axes(axes)
    longest = max(map(len, values))
    return [_param([axis[r % len(axis)] for axis in values]) for r in range(longest)]
