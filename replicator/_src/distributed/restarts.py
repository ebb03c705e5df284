"""`Restarts`: how `launch` starts a job again after a failure, and resizes it when a host is
gone; and the checks of its values, which name the command line's flags."""

from __future__ import annotations

import dataclasses
import warnings

from replicator._src.core import errors

_OLD_KEYWORDS = {  # launch's keywords before Restarts, each a field of it
    "max_restarts": "max_restarts",
    "min_processes": "min_processes",
    "restart_backoff": "backoff",
    "join_timeout": "join_timeout",
    "rejoin_interval": "rejoin_interval",
}


@dataclasses.dataclass(frozen=True)
class Restarts:
    """How `launch` starts a job again after a failure, and resizes it when hosts are lost.

    Attributes:
      max_restarts: how many times the job is started again after a failure (0: never).
      min_processes: the fewest processes the job may go on with when hosts are lost (None:
        ``num_processes``, no resizing). Needs ``max_restarts >= 1``.
      backoff: seconds before the first restart (doubled for each next one, up to 60).
      join_timeout: seconds for a process of a restart to reach ``initialize`` before its host
        counts as gone (with ``min_processes`` only).
      rejoin_interval: seconds between the probes of a lost host.

    >>> Restarts(max_restarts=3, min_processes=2)
    Restarts(max_restarts=3, min_processes=2, backoff=1.0, join_timeout=60.0, rejoin_interval=60.0)
    """

    max_restarts: int = 0
    min_processes: int | None = None
    backoff: float = 1.0
    join_timeout: float = 60.0
    rejoin_interval: float = 60.0


def from_keywords(restarts: Restarts | None, old: dict) -> Restarts:
    """``restarts``, or the `Restarts` that `launch`'s old keywords (``old``) gave, with a
    ``DeprecationWarning`` naming the new spelling.

    Raises:
      TypeError: for a keyword `launch` never took.
      ValueError: if ``restarts`` and old keywords are both given.
    """
    unknown = sorted(set(old) - set(_OLD_KEYWORDS))
    if unknown:
        raise TypeError(f"launch() got an unexpected keyword argument {unknown[0]!r}")
    if not old:
        return Restarts() if restarts is None else restarts
    if restarts is not None:
        raise ValueError(
            f"rp.distributed.launch: restarts= and {', '.join(sorted(old))} are both given; "
            f"give restarts=rp.distributed.Restarts(...) only."
        )
    fields = {_OLD_KEYWORDS[k]: v for k, v in old.items()}
    spelled = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    warnings.warn(
        f"rp.distributed.launch({', '.join(sorted(old))}=...) is deprecated and will be removed "
        f"in the next release; use restarts=rp.distributed.Restarts({spelled}).",
        DeprecationWarning,
        stacklevel=3,
    )
    return Restarts(**fields)


def seconds(x) -> bool:
    """Whether ``x`` is a finite number (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and x != x + 1


def check(n: int, restarts: Restarts) -> None:
    """Refuses, naming the command line's flag, a `Restarts` that cannot act on ``n``
    processes."""
    api, r = "replicator launch", restarts
    if not isinstance(r, Restarts):
        raise ValueError(
            f"rp.distributed.launch: restarts must be an rp.distributed.Restarts; got {r!r}."
        )
    max_restarts, min_processes = r.max_restarts, r.min_processes
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"{api}: --max-restarts must be an int >= 0; got {max_restarts!r}.")
    if min_processes is not None:
        errors.positive_int(min_processes, api=api, name="--min-processes")
        if min_processes > n:
            raise ValueError(
                f"{api}: --min-processes {min_processes} is more than -n {n}; give at most {n}."
            )
        if min_processes < n and max_restarts < 1:
            raise ValueError(
                f"{api}: --min-processes {min_processes} resizes the job on a restart, and "
                f"--max-restarts is {max_restarts}; give --max-restarts 1 or more."
            )
        smaller = [p for p in range(1, n) if n % p == 0]
        if min_processes < n and not [p for p in smaller if p >= min_processes]:
            valid = ", ".join(map(str, smaller[::-1]))
            raise ValueError(
                f"{api}: --min-processes {min_processes} can never act with -n {n}: the job "
                f"shrinks to a count that divides {n}, and none lies in [{min_processes}, {n}); "
                f"give --min-processes {valid} or {n} (no resizing)."
            )
    for name, value in (
        ("--restart-backoff", r.backoff),
        ("--join-timeout", r.join_timeout),
        ("--rejoin-interval", r.rejoin_interval),
    ):
        least = 0 if name == "--restart-backoff" else 1e-9
        if not seconds(value) or value < least:
            bound = ">= 0" if least == 0 else "> 0"
            raise ValueError(f"{api}: {name} must be a number of seconds {bound}; got {value!r}.")
