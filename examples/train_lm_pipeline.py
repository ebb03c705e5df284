"""A byte-level GPT trained with DP x PP (1F1B) on Python's own standard library sources.

Nothing is downloaded: the text is the ``.py`` files that ship with Python. The decoder's blocks
are stacked into 4 pipeline stages on a ``{"data": 2, "stage": 4}`` mesh of 8 emulated devices;
the embedding runs before the stages and the head inside ``loss_fn``. ``rp.fit`` drives the
steps, logs to JSONL and checkpoints (run it again with the same ``--out`` to resume).

    python examples/train_lm_pipeline.py                     # 100 steps
    python examples/train_lm_pipeline.py --steps 20 --schedule gpipe
"""

from __future__ import annotations

import argparse


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--global-batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "circular", "1f1b"])
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", default=None, help="directory for checkpoints and metrics.jsonl")
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", 8)

    import optax

    import replicator as rp
    from replicator import pipeline
    from replicator.models import gpt

    config = gpt.GPTConfig(
        vocab_size=256,
        seq_len=args.seq_len,
        d_model=args.d_model,
        num_heads=4,
        num_layers=args.layers,
    )
    repl = rp.Replicator(mesh_shape={"data": 2, "stage": 4})
    repeats = 2 if args.schedule == "circular" else 1
    schedule = {
        "gpipe": pipeline.GPipe(),
        "circular": pipeline.Circular(repeats),
        "1f1b": pipeline.OneFOneB(),
    }[args.schedule]
    # The loss and this replica's gradients: embedding, then the stages as a pipeline, then
    # the head (gpt.pipeline_value_and_grad).
    grad_fn = gpt.pipeline_value_and_grad(
        config, num_microbatches=args.microbatches, schedule=schedule
    )
    tx = repl.wrap_optimizer(optax.adam(args.lr), clip_global_norm=1.0)

    def step_fn(state, batch):  # one data replica, every stage
        loss, grads = grad_fn(state["params"], batch)
        updates, opt = tx.update(grads, state["opt"], state["params"])  # all-reduce inside
        new = {"params": optax.apply_updates(state["params"], updates), "opt": opt}
        return new, {"loss": rp.all_reduce(loss, "mean")}

    text = gpt.stdlib_text(2_000_000)

    def input_fn(ctx: rp.InputContext):
        per = ctx.per_pipeline_batch_size(args.global_batch)
        yield from gpt.token_batches(
            text, batch_size=per, seq_len=args.seq_len, seed=ctx.input_pipeline_id
        )

    params = gpt.init(config, jax.random.key(0))
    # The blocks stacked into 4 stages and sharded over "stage"; embedding and head replicated.
    placed = gpt.place_pipeline(repl, params, num_stages=4, repeats=repeats)
    state = {"params": placed, "opt": tx.init(placed)}
    print(f"{repl}: GPT with {gpt.num_params(params):,} parameters, {args.schedule}, "
          f"{len(text):,} bytes of stdlib text")  # fmt: skip
    print(pipeline.render(schedule, 4, args.microbatches).splitlines()[-1])
    checkpointing = None  # with --out: checkpoints every 50 steps, resumed when run again
    if args.out is not None:
        checkpointing = rp.training.CheckpointOptions(f"{args.out}/checkpoints", every=50)
    logging = rp.training.LoggingOptions(
        every=args.log_every,
        metrics_path=None if args.out is None else f"{args.out}/metrics.jsonl",
        examples_per_step=args.global_batch,
        tokens_per_step=args.global_batch * args.seq_len,
    )
    result = rp.fit(
        repl,
        step_fn,
        state,
        input_fn,
        steps=args.steps,
        checkpointing=checkpointing,
        logging=logging,
    )
    first, last = result.history[0]["loss"], result.history[-1]["loss"]
    print(f"loss {first:.3f} -> {last:.3f} in {result.step} steps (tokens/s in the log)")


if __name__ == "__main__":
    main()
