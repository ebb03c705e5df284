"""`replicator plan`'s pricing options and worker processes, from its command line."""

from __future__ import annotations

import argparse
import dataclasses
import os

import replicator as rp
from replicator.cli import jobs
from replicator.cli.config import TrainConfig
from replicator.models import gpt


def default_workers(target) -> int:
    """Processes that compile by default: 2, or 1 on one core; for a TPU target, one for
    each 2 cores, up to 2: libtpu's compiler keeps 2 cores busy (Mixtral 8x22B on v6e-256: a
    layout compiled in 119-138 s alone, two side by side in 130-303 s each)."""
    cores = os.cpu_count() or 1
    return max(1, min(2, cores // 2 if target is not None else cores))


def pricing_options(cfg: TrainConfig, args: argparse.Namespace):
    """`rp.plan`'s ``pricing`` for ``--compile-top``: the GPT's sizes, and the record's
    default number of ladders unless told; None (compile every ladder) for ``all``, and by
    default for a model that cannot be priced."""
    top = args.compile_top
    if top == "all":
        return None
    if top is not None and (not str(top).isdigit() or int(top) < 1):
        raise ValueError(f"--compile-top must be a number >= 1 or 'all'; got {top!r}.")
    shape = None
    if cfg.model.kind == "gpt":
        slots = {"adam": 2, "adamw": 2, "lion": 1, "sgd": 0, "adafactor": 0}
        opt_slots = slots.get(cfg.optimizer.name, 2)
        shape = gpt.model_shape(jobs.gpt_config(cfg), cfg.global_batch, opt_slots)
        if cfg.model.reduce_dtype is not None:  # every ZeRO stage sums the gradients in it
            import jax.numpy as jnp

            reduce_bytes = jnp.dtype(cfg.model.reduce_dtype).itemsize
            shape = dataclasses.replace(shape, reduce_bytes=reduce_bytes)
    if shape is None and top is None:
        return None
    if shape is None:
        raise ValueError(
            f"--compile-top prices a GPT; {args.config} has model.kind={cfg.model.kind!r}: "
            f"leave --compile-top out (or give 'all') to compile every ladder."
        )
    options = {} if top is None else {"compile_top": int(top)}
    for flag, key, ok, what in (
        ("--skip-slower", "skip_slower", lambda x: x >= 1, "a number >= 1"),
        ("--time-limit", "time_limit", lambda x: x > 0, "a number of seconds > 0"),
    ):
        raw = getattr(args, key)
        if raw is None:
            continue
        try:
            value = None if raw == "none" else float(raw)
        except ValueError:
            value = float("nan")
        if value is not None and not ok(value):
            raise ValueError(f"{flag} must be {what} or 'none'; got {raw!r}.")
        options[key] = value
    return rp.planner.PricingOptions(model=shape, **options)


def add_pricing_args(p: argparse.ArgumentParser) -> None:
    """``--compile-top``, ``--skip-slower`` and ``--time-limit`` (`pricing_options`)."""
    top = rp.planner.PricingOptions.compile_top  # the record's default
    p.add_argument("--compile-top", default=None, metavar="K",
                   help="price every layout from formulas first (no compile: state, peak "
                   "memory, FLOPs, collective bytes) and compile only the K ladders of layouts "
                   f"that model fastest (default {top} for a GPT); 'all' compiles every ladder "
                   "(the default for other models)")  # fmt: skip
    skip = rp.planner.PricingOptions.skip_slower
    p.add_argument("--skip-slower", default=None, metavar="X",
                   help="with --compile-top: once a layout compiled fits, do not compile a "
                   f"ladder priced over X times its step (default {skip}); 'none' compiles "
                   "every ladder of a round")  # fmt: skip
    limit = rp.planner.PricingOptions.time_limit
    p.add_argument("--time-limit", default=None, metavar="S",
                   help="with --compile-top: begin no compile after S seconds, nor one that the "
                   "compiles so far say would end after them; the layouts left are listed as not "
                   f"compiled (default {limit:g}); 'none' compiles every ladder the search "
                   "reaches")  # fmt: skip
