"""`Profile`: a ``jax.profiler`` trace of a few steady-state steps of `rp.fit`."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from replicator._src.core.errors import positive_int


@dataclasses.dataclass(frozen=True)
class Profile:
    """Trace steps ``start_step`` to ``start_step + num_steps - 1`` (counted from 1) into ``dir``.

    The trace is ``jax.profiler``'s: ``dir/plugins/profile/<run>/<host>.xplane.pb``, which
    TensorBoard's profile plugin (``tensorboard --logdir dir``) and Perfetto open. The first step
    of a run compiles the program, so the default ``start_step=3`` keeps compilation out of the
    trace. Every process writes its own trace of its devices.

    >>> Profile("/tmp/trace", start_step=5, num_steps=2).steps()
    range(5, 7)
    """

    dir: str | os.PathLike
    start_step: int = 3
    num_steps: int = 3

    def __post_init__(self) -> None:
        positive_int(self.start_step, api="rp.training.Profile", name="start_step")
        positive_int(self.num_steps, api="rp.training.Profile", name="num_steps")
        if not isinstance(self.dir, str | os.PathLike) or not os.fspath(self.dir):
            raise TypeError(f"rp.training.Profile: dir must be a directory path; got {self.dir!r}.")

    def steps(self) -> range:
        """The steps the trace covers."""
        return range(self.start_step, self.start_step + self.num_steps)

    @classmethod
    def of(cls, profile: Any) -> Profile | None:
        """``profile`` as given to `rp.fit`: None, a `Profile`, or a dict of its fields."""
        if profile is None or isinstance(profile, Profile):
            return profile
        if isinstance(profile, dict):
            unknown = set(profile) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(
                    f"rp.fit: profile has unknown keys {sorted(unknown)}; use dir, start_step "
                    f"and num_steps."
                )
            return cls(**profile)
        raise TypeError(
            f"rp.fit: profile must be an rp.training.Profile or a dict with dir, start_step and "
            f"num_steps; got {type(profile).__name__}."
        )


class Tracer:
    """Starts and stops the trace around the steps of a `Profile`, in `rp.fit`'s loop."""

    def __init__(self, profile: Profile | None) -> None:
        self.profile, self.on = profile, False

    def before(self, step: int) -> None:
        """Before step ``step`` (counted from 1) runs."""
        if self.profile is not None and not self.on and step == self.profile.start_step:
            jax.profiler.start_trace(os.fspath(self.profile.dir))
            self.on = True

    def after(self, step: int, state: Any) -> None:
        """After step ``step`` was dispatched: the trace ends once its last step has run."""
        if self.on and step >= self.profile.steps()[-1]:
            jax.block_until_ready(state)
            self.stop()

    def stop(self) -> None:
        if self.on:
            self.on = False
            jax.profiler.stop_trace()
