"""The ``replicator`` command.

replicator train CONFIG [key=value ...]       train as a YAML config says (configs/)
replicator explain CONFIG [key=value ...] [--target v5p-16 [--slices N]]
                                              what its step costs per device, without running it
replicator plan CONFIG --devices N [--memory 16GiB] [--hardware tpu-v5e]
                                              the fastest layout that fits, written as a config
replicator sample CONFIG [key=value ...] [--run RUN_DIR] --prompt TEXT --max-new-tokens N
                                              text from a run's checkpoint (or init_from=DIR)
replicator launch -n N [--devices-per-process D] [--watchdog S] -- CMD ...
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Sequence

# An application on the public API only: config (YAML configs validated into dataclasses), jobs
# (a config becomes a model, an input_fn, a step_fn and a run), launch (the launcher's options).
from replicator.cli import config, isolated, jobs, launch, plan, preflight, sample, targets

# replicator train's exit codes (EXIT_CODES, in its --help; `replicator launch` handles a
# worker's EXIT_NOTHING_TO_DO and EXIT_SIGINT/EXIT_SIGTERM as a clean stop, not a failure)
EXIT_TRAINED = 0
EXIT_FAILED = 1
EXIT_REFUSED = 2
EXIT_NOTHING_TO_DO = 4
EXIT_SIGINT = 130  # 128 + the signal, as shells report a process a signal ended
EXIT_SIGTERM = 143
EXIT_CODES = f"""exit codes:
  {EXIT_TRAINED}    trained to steps
  {EXIT_FAILED}    failed during training (a traceback, or a checkpoint that could not be written)
  {EXIT_REFUSED}    refused before the first step (one line saying why); nothing changed on disk
  {EXIT_NOTHING_TO_DO}    nothing to do: the run was at steps already (give a larger steps)
  {EXIT_SIGINT}  stopped by SIGINT (Ctrl-C) at a step boundary, its checkpoint saved (unless
       emergency_after says not to): the same command resumes
  {EXIT_SIGTERM}  stopped by SIGTERM (preemption), likewise"""


class _OneLineParser(argparse.ArgumentParser):
    """argparse, with a usage error as one line on stderr (``replicator plan: ...``, and where
    the options are listed) and exit code 2; its subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help).\n")


class _TablesAsWritten(argparse.HelpFormatter):
    """argparse's help, with a text of several lines (the exit codes' table) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="replicator", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="train as a YAML config says, e.g. configs/lm_pipeline.yaml",
        description="Trains as CONFIG says, with key=value overrides (dotted for sections: "
        "model.layers=8). Metrics, checkpoints and the loss plot go to out_dir/name; running "
        "the same command again resumes. cpu_devices=0 turns off the emulated CPU devices.",
        epilog=EXIT_CODES,
        formatter_class=_TablesAsWritten,
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
        "mesh.data=8 mesh.stage=8 model.layers=16 global_batch=256. With --target, the step "
        "is compiled for that TPU slice instead (libtpu, here; no TPU needed), and the report "
        "adds its HBM and whether the step fits, the step's time by the roofline and by XLA's "
        "estimate, and the MFU: replicator explain configs/llama3_8b.yaml --target v5p-64",
    )
    explain.add_argument("config", help="a YAML file")
    explain.add_argument("overrides", nargs="*", help="key=value")
    explain.add_argument("--json", metavar="PATH", help="also write the whole report as JSON")
    targets.add_args(explain, what="explain the step")
    preflight.add_args(explain)
    explain.add_argument(
        "--quick", action="store_true",
        help="with --target: compile the step once (about a third of the time); XLA's estimate "
        "of a step whose layers are scanned is then scaled from its FLOPs, not read from the "
        "step with one and with two layers unrolled",
    )  # fmt: skip
    plan.add_parser(commands)
    sample.add_parser(commands)
    commands.add_parser(  # parsed by the launcher itself: see main()
        "launch",
        help="run a command as N local processes of one JAX distributed job "
        "(replicator launch --help)",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``replicator ARGS``; returns the exit code.

    A config the CLI or the library refuses before the first step is one line on stderr,
    ``replicator train: ...`` (or ``explain``), and exit code 2; a failure during training keeps
    its traceback, except a checkpoint that could not be written for lack of space (one line,
    exit code 1).

    Args:
      argv: the arguments after ``replicator`` (default: ``sys.argv[1:]``).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # the launcher parses its own options (--watchdog, ...)
        return launch.main(argv[1:])
    args = _parser().parse_args(_normalised(argv))
    if args.command not in ("train", "explain", "plan", "sample"):
        return 2
    where = f"replicator {args.command}"
    if args.command in ("plan", "sample"):
        try:
            return (plan if args.command == "plan" else sample).run(args)
        except (*jobs.USER_ERRORS, OSError) as e:
            return _user_error(where, e)
    try:
        cfg = config.load(args.config, args.overrides)
        # explain: a config the library refuses (e.g. M < K for 1F1B) is a message too
        report = _explain(cfg, args) if args.command == "explain" else None
    except (*jobs.USER_ERRORS, OSError, isolated.CompilerAbortedError) as e:
        return _user_error(where, e)
    if report is None:
        try:
            summary = jobs.run(cfg)
        except jobs.SetupError as e:  # refused before the first step; later: a traceback
            return _user_error(where, e)
        except jobs.RUN_ERRORS as e:  # e.g. a full disk: the message says it all; exit 1
            print(f"{where}: {e}", file=sys.stderr)
            return EXIT_FAILED
        return _exit_code(summary)
    print(report)
    if args.json:
        print(f"wrote {args.json}")
    return 0


def _exit_code(summary: dict) -> int:
    """``replicator train``'s exit code for how its run ended (`EXIT_CODES`)."""
    if summary["preempted"]:
        return EXIT_SIGINT if summary["stopped_by"].startswith("SIGINT") else EXIT_SIGTERM
    return EXIT_NOTHING_TO_DO if summary["nothing_to_do"] else EXIT_TRAINED


def _explain(cfg, args):
    target = targets.check_args(args)
    if target is None:
        if args.quick or args.resume:
            flag = "--quick skips compiles of" if args.quick else "--resume checks a run against"
            raise ValueError(f"{flag} a --target's step; give --target too.")
        return jobs.explain(cfg, json_path=args.json)
    if args.json:
        jobs.check_writable(args.json, flag="--json")
    if args.resume:  # the checkpoint checked first: a mismatch compiles nothing
        report = preflight.explain(cfg, target, args.resume, per_layer=not args.quick)
    else:
        report = isolated.explain(cfg, target, per_layer=not args.quick)  # an abort: one line
    if cfg.local_steps and report.target is not None:  # DiLoCo: crosses once for H steps
        per = dataclasses.replace(report.target, optimizer_steps=cfg.local_steps)
        report = dataclasses.replace(report, target=per)
    if args.json:
        with open(args.json, "w") as f:
            f.write(report.to_json() + "\n")
    return report


def _normalised(argv: list[str]) -> list[str]:
    """``argv`` as argparse can read it: a value that starts with ``-`` joined to its option
    (``--memory -5GiB`` becomes ``--memory=-5GiB``, which argparse would take for an option of
    its own; the option then refuses the value with its own message), and the ``key=value``
    overrides moved next to the config, where argparse looks for them (``plan CONFIG --devices
    8 steps=2`` reads as ``plan CONFIG steps=2 --devices 8``)."""
    joined: list[str] = []
    for arg in argv:
        option = joined[-1] if joined else ""
        if _takes_value(option) and re.match(r"-\.?\d", arg):
            joined[-1] = f"{option}={arg}"
        else:
            joined.append(arg)
    if joined[:1] not in (["train"], ["explain"], ["plan"], ["sample"]):
        return joined
    positional, options = [], []
    for i, arg in enumerate(joined[1:], 1):
        is_value = _takes_value(joined[i - 1])
        (options if is_value or arg.startswith("-") else positional).append(arg)
    return joined[:1] + positional + options


# explain's and plan's options that take no value: the argument after one is not its value
_FLAGS = ("--help", "--quick", "--wide")


def _takes_value(arg: str) -> bool:
    """Whether ``arg`` is an option whose value is the next argument (every ``--`` option of
    explain and plan but the flags, when not written ``--option=value``)."""
    return arg.startswith("--") and "=" not in arg and arg not in _FLAGS


def _user_error(where: str, error: BaseException) -> int:
    """Prints a refused command's message (no traceback) on stderr; the exit code 2."""
    print(f"{where}: {error}", file=sys.stderr)
    return 2
