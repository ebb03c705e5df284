"""The ``replicator`` command.

replicator train CONFIG [key=value ...]       train as a YAML config says (configs/)
replicator explain CONFIG [key=value ...]     what its step costs per device, without running it
replicator launch -n N [--devices-per-process D] -- CMD ...
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replicator", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="train as a YAML config says, e.g. configs/lm_pipeline.yaml",
        description="Trains as CONFIG says, with key=value overrides (dotted for sections: "
        "model.layers=8). Metrics, checkpoints and the loss plot go to out_dir/name; running "
        "the same command again resumes. cpu_devices=0 turns off the emulated CPU devices.",
    )
    train.add_argument("config", help="a YAML file")
    train.add_argument("overrides", nargs="*", help="key=value")
    explain = commands.add_parser(
        "explain",
        help="what a config's step costs per device (memory, FLOPs, collectives), not run",
        description="Compiles the training step of CONFIG (with key=value overrides) for its "
        "mesh on as many emulated CPU devices as the mesh has, and prints per device: memory "
        "(arguments, outputs, temporaries), FLOPs per step, every collective with its mesh "
        "axes, dtype and bytes per step, and for pipelines the bubble and the schedule. "
        "Nothing is trained. Example: replicator explain configs/lm_pipeline.yaml "
        "mesh.data=8 mesh.stage=8 model.layers=16 global_batch=256",
    )
    explain.add_argument("config", help="a YAML file")
    explain.add_argument("overrides", nargs="*", help="key=value")
    explain.add_argument("--json", metavar="PATH", help="also write the whole report as JSON")
    launch = commands.add_parser(
        "launch",
        help="run a command as N local processes of one JAX distributed job",
        description="Runs CMD as N local processes with a coordinator on 127.0.0.1. Each line "
        "of output is prefixed with its rank; if a process fails, the others are stopped and "
        "the exit code says which failed. In the script, call rp.distributed.initialize() first.",
    )
    launch.add_argument("-n", "--num-processes", type=int, required=True, help="processes")
    launch.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help="emulated CPU devices per process (sets jax_num_cpu_devices through initialize)",
    )
    launch.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    launch.add_argument(
        "--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL"
    )
    launch.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.command in ("train", "explain"):
        from replicator._src import config, jobs

        try:
            cfg = config.load(args.config, args.overrides)
            # explain: a config the library refuses (e.g. M < K for 1F1B) is a message too
            report = jobs.explain(cfg, json_path=args.json) if args.command == "explain" else None
        except (ValueError, OSError) as e:
            print(f"replicator {args.command}: {e}", file=sys.stderr)
            return 2
        if report is None:
            jobs.run(cfg)
            return 0
        print(report)
        if args.json:
            print(f"wrote {args.json}")
        return 0
    if args.command == "launch":
        from replicator._src.distributed import launch

        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            _parser().error("launch: give the command after --, e.g. -- python train.py")
        return launch(
            cmd,
            num_processes=args.num_processes,
            devices_per_process=args.devices_per_process,
            port=args.port,
            grace=args.grace,
        )
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
