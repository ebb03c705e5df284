"""Data-parallel overhead: ``Replicator.run`` against a hand-written ``jit(shard_map)`` step.

Both sides train the same MLP (3 dense layers, tanh, MSE loss, Adam) on the same random batches,
data parallel over 8 emulated CPU devices, with the same math: local gradients, a ``pmean`` over
``data``, the optax update, the loss returned stacked per replica. The script first checks that
both give the same parameters after 3 steps, then alternates them in one process (R rounds of K
steps each, the order swapped every round) and reports the median per-step wall time of each and
the ratio replicator / hand-written of the medians (target: <= 1.03), with a bootstrap 95%
interval over rounds.

    python benchmarks/dp_overhead.py
    python benchmarks/dp_overhead.py --rounds 5 --steps 5 --json /tmp/dp_overhead.json
    python benchmarks/dp_overhead.py --lowering pmap  # replicator's pmap lowering instead
"""

# ruff: noqa: E402  (the device count must be set before JAX starts its backend)
import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import argparse
import collections
import datetime
import itertools
import json
import shlex
import sys
import time

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp

TARGET = 1.03
# Steps dispatched but unfinished, at most. Replicator.run waits for the oldest beyond 2 on CPU,
# because XLA:CPU's cross-device collectives deadlock with many queued programs (with jax 0.10.2
# this script's unbounded hand-written loop aborted in a rendezvous timeout at 100 steps).
IN_FLIGHT = 2
IN_DIM, OUT_DIM, NUM_BATCHES = 256, 16, 4


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30, help="alternating rounds (R)")
    p.add_argument("--steps", type=int, default=20, help="steps per side per round (K)")
    p.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    p.add_argument("--batch-per-replica", type=int, default=32)
    p.add_argument(
        "--lowering", choices=["shard_map", "pmap"], default="shard_map", help="replicator's side"
    )
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    return p.parse_args()


def init_state(width: int, tx: optax.GradientTransformation, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    dims = [IN_DIM, width, width, OUT_DIM]
    params = [
        {"w": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32), "b": np.zeros(b, "f4")}
        for a, b in itertools.pairwise(dims)
    ]
    # Host (numpy) copies, so each side's replicate() starts from the same values.
    return jax.tree.map(np.asarray, {"params": params, "opt_state": tx.init(params)})


def loss_fn(params, batch):
    h = batch["x"]
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        h = jnp.tanh(h) if i < len(params) - 1 else h
    return jnp.mean((h - batch["y"]) ** 2)


def make_steps(repl: rp.Replicator):
    """The replicator ``step_fn`` and the hand-written program, doing the same math."""
    wrapped = repl.wrap_optimizer(optax.adam(1e-3))
    inner = optax.adam(1e-3)

    def step_fn(state, batch):  # one replica's view; wrap_optimizer all-reduces the grads
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = wrapped.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state}, {"loss": rp.all_reduce(loss, "mean")}

    def hand_body(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        grads = jax.lax.pmean(grads, "data")
        updates, opt_state = inner.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state}, jax.lax.pmean(loss, "data")[None]

    hand = jax.jit(
        jax.shard_map(
            hand_body,
            mesh=repl.mesh,
            in_specs=(P(), P("data")),
            out_specs=(P(), P("data")),
            check_vma=False,
        ),
        donate_argnums=(0,),
    )
    return wrapped, step_fn, hand


def main() -> None:
    args = parse_args()
    if len(jax.devices()) != 8:
        sys.exit(f"dp_overhead: expected 8 CPU devices, got {jax.devices()}")
    repl = rp.Replicator(mesh_shape={"data": -1}, lowering=args.lowering)
    wrapped, step_fn, hand = make_steps(repl)
    host_state = init_state(args.width, wrapped)
    n = args.batch_per_replica * repl.num_replicas
    rng = np.random.default_rng(1)
    batches = [  # global batches, split over "data" as repl.distribute would place them
        jax.device_put(
            {"x": rng.normal(size=(n, IN_DIM)), "y": rng.normal(size=(n, OUT_DIM))},
            NamedSharding(repl.mesh, P("data")),
        )
        for _ in range(NUM_BATCHES)
    ]

    def run_repl(state, k):
        for i in range(k):
            state, out = repl.run(step_fn, state, batches[i % NUM_BATCHES])
        return jax.block_until_ready((state, out["loss"]))

    def run_hand(state, k):
        in_flight = collections.deque()  # the same bound as Replicator.run on CPU (see IN_FLIGHT)
        for i in range(k):
            while len(in_flight) >= IN_FLIGHT:
                in_flight.popleft().block_until_ready()
            state, loss = hand(state, batches[i % NUM_BATCHES])
            in_flight.append(loss)
        return jax.block_until_ready((state, loss))

    # Correctness (also compiles both): same parameters and losses after 3 steps.
    (sa, la), (sb, lb) = (f(repl.replicate(host_state), 3) for f in (run_repl, run_hand))
    assert la.shape == lb.shape == (repl.num_replicas,), (la.shape, lb.shape)
    worst = 0.0
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path({"params": sa["params"], "loss": la})[0],
        jax.tree.leaves({"params": sb["params"], "loss": lb}),
    ):
        err = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
        worst = max(worst, err)
        if not err <= 1e-5:  # also catches NaN
            sys.exit(
                f"dp_overhead: ABORT, replicator and hand-written steps differ after 3 steps at "
                f"{jax.tree_util.keystr(path)}: relative error {err:.2e} > 1e-5"
            )
    print(f"correctness: same params and loss after 3 steps (max rel. error {worst:.1e})")

    # Timing: alternate the two in one process; a round is K steps of each, order swapped.
    fns = {"replicator": run_repl, "hand-written": run_hand}
    states = {"replicator": sa, "hand-written": sb}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name, fn in fns.items():  # warm-up: one untimed round each
        states[name] = fn(states[name], args.steps)[0]
    for r in range(args.rounds):
        for name in list(fns)[:: 1 if r % 2 == 0 else -1]:
            t0 = time.perf_counter()
            states[name] = fns[name](states[name], args.steps)[0]
            times[name].append((time.perf_counter() - t0) / args.steps)

    a, b = np.array(times["replicator"]), np.array(times["hand-written"])
    ratio = float(np.median(a) / np.median(b))
    idx = np.random.default_rng(0).integers(0, len(a), size=(2000, len(a)))  # paired resamples
    boot = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
    lo, hi = (float(q) for q in np.percentile(boot, [2.5, 97.5]))
    med = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    iqr = {k: [1e3 * float(q) for q in np.percentile(v, [25, 75])] for k, v in times.items()}
    command = shlex.join(["python", *sys.argv])
    today = datetime.date.today().isoformat()

    print(f"{repl!r}, MLP {IN_DIM}-{args.width}-{args.width}-{OUT_DIM}, Adam, global batch {n}")
    print(f"{args.rounds} rounds x {args.steps} steps per side; per-step wall time (ms):")
    for k in times:
        print(f"  {k:13s} median {med[k]:8.3f}  IQR [{iqr[k][0]:.3f}, {iqr[k][1]:.3f}]")
    verdict = "meets" if ratio <= TARGET else "MISSES"
    print(
        f"ratio replicator / hand-written of medians: {ratio:.3f} "
        f"(bootstrap 95% [{lo:.3f}, {hi:.3f}]); {verdict} the target <= {TARGET}\n"
    )
    print("| date | jax | command | replicator ms | hand-written ms | ratio (95% CI) |")
    print("|---|---|---|---|---|---|")
    print(f"| {today} | {jax.__version__} | `{command}` | {med['replicator']:.2f} | ", end="")
    print(f"{med['hand-written']:.2f} | {ratio:.3f} [{lo:.3f}, {hi:.3f}] |")
    if args.json:
        results = dict(date=today, jax=jax.__version__, command=command, config=vars(args))
        results |= dict(median_ms=med, iqr_ms=iqr, ratio=ratio, ratio_ci95=[lo, hi])
        with open(args.json, "w") as f:
            json.dump(results | dict(target=TARGET, per_step_s=times), f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
