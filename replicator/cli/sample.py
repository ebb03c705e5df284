"""``replicator sample CONFIG --prompt TEXT --max-new-tokens N``: text from a trained run or a
Hugging Face checkpoint, on one device.

The model is CONFIG's (with ``key=value`` overrides, as ``replicator train`` reads it): its
``model:`` section, or with ``init_from=DIR`` the checkpoint's sizes. The weights are the newest
checkpoint of a run (``--run RUN_DIR``; by default the config's own, ``out_dir/name``), or, with
``init_from`` and no run, the Hugging Face checkpoint's. The prompt is encoded by the config's
``data.tokenizer``, else by the checkpoint's own ``tokenizer.json`` (or ``tokenizer.model``),
else as its UTF-8 bytes (what ``replicator train`` reads without a tokenizer); the prompt and
its continuation (`replicator.models.generate`) are printed, decoded.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable

import jax
import numpy as np

from replicator.cli import config as config_lib
from replicator.cli import jobs, runs
from replicator.cli.config import TrainConfig
from replicator.models import generate, gpt, hf


def add_parser(commands) -> None:
    """The ``sample`` subcommand's options."""
    p = commands.add_parser(
        "sample",
        help="text from a trained run or a Hugging Face checkpoint (init_from=DIR)",
        description="Generates text on one device from the newest checkpoint of a run (--run "
        "RUN_DIR, by default CONFIG's out_dir/name) or, with init_from=DIR and no run, from a "
        "Hugging Face checkpoint; the model is CONFIG's (with key=value overrides, as for "
        "train). The prompt is encoded by data.tokenizer, else the checkpoint's tokenizer.json, "
        "else as bytes, and printed with its continuation. Example: replicator sample "
        "configs/llama_tiny.yaml --prompt 'def main' --max-new-tokens 64 --temperature 0.8",
    )
    p.add_argument("config", help="a YAML file (its model and data.tokenizer)")
    p.add_argument("overrides", nargs="*", help="key=value, as for train (init_from=DIR)")
    p.add_argument("--run", metavar="RUN_DIR",
                   help="a run directory of replicator train (default: out_dir/name, unless "
                   "init_from is given)")  # fmt: skip
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, required=True, metavar="N",
                   help="tokens to generate")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 (the default) for greedy decoding, else the sampling temperature")  # fmt: skip
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample from the smallest set of tokens holding P of the probability "
                   "(default 1: every token)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, metavar="S", help="the sampling seed")


@dataclasses.dataclass(frozen=True)
class Codec:
    """Text to token ids and back: ``encode(text)``, ``decode(ids)``; ``name`` for messages."""

    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


def run(args: argparse.Namespace) -> int:
    """``replicator sample``: prints the prompt and its continuation; returns 0.

    Raises:
      ValueError, FileNotFoundError: for a config, run, checkpoint, tokenizer or prompt that
        cannot give text (the CLI prints the message on one line, exit code 2).
    """
    cfg = config_lib.load(args.config, args.overrides)
    if cfg.model.kind != "gpt":
        raise ValueError(
            f"model.kind={cfg.model.kind!r} does not generate text; sample a model.kind: gpt "
            f"config (any model.family)."
        )
    run_dir = args.run
    if run_dir is None and cfg.init_from is None:
        run_dir = os.path.join(cfg.out_dir, cfg.name)
    if run_dir is not None and cfg.init_from is None:  # a run started from a checkpoint: its sizes
        recorded = _recorded_init_from(run_dir)
        if recorded is not None:
            cfg = config_lib.load(args.config, [*args.overrides, f"init_from={recorded}"])
    model = jobs.gpt_config(cfg)
    device = jax.devices()[0]
    if run_dir is not None:
        params = run_params(run_dir, model, device)
    else:
        mesh = jax.make_mesh((1,), ("data",), devices=[device])
        params = hf.load(cfg.init_from, hf.abstract(hf.read_config(cfg.init_from), mesh))
    # a Hugging Face model reads its tokenizer's special tokens (a BOS); a run was trained without
    codec = tokenizer(cfg, model.vocab_size, special=run_dir is None)
    prompt = codec.encode(args.prompt)
    _check_length(len(prompt), args.max_new_tokens, model, codec)
    out = generate(
        params, model, np.asarray(prompt, np.int32), args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, seed=args.seed,
    )  # fmt: skip
    print(codec.decode(np.asarray(out).tolist()), flush=True)
    return 0


def _recorded_init_from(run_dir: str) -> str | None:
    try:
        with open(os.path.join(run_dir, runs.INIT_FROM_RECORD)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _check_length(prompt: int, new: int, model: gpt.GPTConfig, codec: Codec) -> None:
    if prompt == 0:
        raise ValueError(f"--prompt is empty once encoded ({codec.name}); give some text.")
    if new >= 0 and prompt + new > model.seq_len:
        fix = (
            f"or model.seq_len={prompt + new} (rotary positions)"
            if model.position == "rope"
            else "(the learned position table has model.seq_len rows)"
        )
        raise ValueError(
            f"the prompt is {prompt} tokens ({codec.name}), and with --max-new-tokens {new} the "
            f"text is {prompt + new}, over model.seq_len={model.seq_len}; give --max-new-tokens "
            f"{max(model.seq_len - prompt, 0)} or fewer, a shorter prompt, {fix}."
        )


def run_params(run_dir: str, model: gpt.GPTConfig, device: jax.Device) -> dict:
    """The parameters of the newest checkpoint of ``run_dir`` on ``device``: the ``params`` of
    its state only (the optimizer's is not read), a pipeline's stages as the stacked blocks.

    Raises:
      FileNotFoundError: if the run has no checkpoint.
      ValueError: if its parameters are not ``model``'s (another config than the run's).
    """
    import orbax.checkpoint as ocp

    directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
    steps = runs.checkpoint_steps(run_dir)
    if not steps:
        raise FileNotFoundError(
            f"no checkpoint in {directory}; train the run first (replicator train CONFIG), or "
            f"give --run RUN_DIR of one that saved a checkpoint, or init_from=DIR (a Hugging "
            f"Face checkpoint)."
        )
    item_handlers = {"state": ocp.PyTreeCheckpointHandler(), "record": ocp.JsonCheckpointHandler()}
    manager = ocp.CheckpointManager(directory, item_handlers=item_handlers)
    tree = manager.item_metadata(steps[-1])["state"]
    tree = getattr(tree, "tree", tree)
    job = "job" in tree  # replicator train's state: {"job": {"params", "opt"}, "step"}
    saved = (tree["job"] if job else tree)["params"]
    want = jax.eval_shape(lambda: gpt.init(model, jax.random.key(0)))
    one = jax.sharding.SingleDeviceSharding(device)
    like = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(tuple(s.shape), s.dtype, sharding=one), saved
    )
    _check_saved(like, want, steps[-1], directory)
    restore = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=one, dtype=s.dtype), like)
    nest = lambda x: {"job": {"params": x}} if job else {"params": x}
    state = ocp.args.PyTreeRestore(nest(like), restore_args=nest(restore), partial_restore=True)
    restored = manager.restore(steps[-1], args=ocp.args.Composite(state=state))["state"]
    params = (restored["job"] if job else restored)["params"]
    manager.close()
    if "stages" in params:  # [K, L/K, ...] or [V, K, L/K, ...]: the layers in row-major order
        layers = lambda a, w: a.reshape(w.shape)
        params = {**params, "blocks": jax.tree.map(layers, params.pop("stages"), want["blocks"])}
    return params


def _check_saved(like: dict, want: dict, step: int, directory: str) -> None:
    """Refuses saved parameters (``like``) that are not ``want``'s: another structure or
    shape, naming the first leaf that differs (a pipeline's ``stages`` hold the same layers,
    stacked in stages)."""
    mine = dict(want)
    if "stages" in like:
        mine["stages"] = mine.pop("blocks")
    flat = lambda tree: {jax.tree_util.keystr(k): a for k, a in jax.tree.leaves_with_path(tree)}
    saved, wanted = flat(like), flat(mine)
    differ = sorted(set(saved) ^ set(wanted))
    if differ:
        where = "the checkpoint" if differ[0] in saved else "the config's model"
        problem = f"params{differ[0]} is only in {where}"
    else:
        problem = None
        for name, a in saved.items():
            b = wanted[name]
            staged = name.startswith("['stages']") and a.shape[a.ndim - b.ndim + 1 :] == b.shape[1:]
            if a.shape != b.shape and not (staged and np.prod(a.shape) == np.prod(b.shape)):
                problem = f"params{name} is {list(a.shape)}, and the config gives {list(b.shape)}"
                break
    if problem is not None:
        raise ValueError(
            f"checkpoint step {step} in {directory} does not hold the config's model: {problem}; "
            f"give the config and key=value overrides the run was trained with."
        )


def tokenizer(cfg: TrainConfig, vocab_size: int, *, special: bool) -> Codec:
    """The prompt's `Codec`: ``data.tokenizer``, else the ``init_from`` checkpoint's
    ``tokenizer.json`` or ``tokenizer.model``, else UTF-8 bytes. ``special``: the tokenizer
    adds its special tokens (a BOS) as it encodes, as a Hugging Face model was trained."""
    path = cfg.data.tokenizer
    if path is None and cfg.init_from is not None:
        for name in ("tokenizer.json", "tokenizer.model"):
            if os.path.isfile(os.path.join(cfg.init_from, name)):
                path = os.path.join(cfg.init_from, name)
                break
    if path is None:
        if vocab_size < 256:
            raise ValueError(
                f"the model's vocabulary of {vocab_size} holds no byte-level text (ids 0-255); "
                f"give data.tokenizer=FILE, the tokenizer the model was trained with."
            )
        decode = lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return Codec("bytes", lambda text: list(text.encode("utf-8")), decode)
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer {path!r}: no such file; give data.tokenizer=FILE.")
    if path.endswith(".model"):
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=path)
        encode = lambda text: sp.encode(text, add_bos=special and sp.bos_id() >= 0)
        return Codec(
            path, encode, lambda ids: sp.decode([i for i in ids if i < sp.get_piece_size()])
        )
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(path)
    encode = lambda text: tok.encode(text, add_special_tokens=special).ids
    return Codec(path, encode, lambda ids: tok.decode(ids, skip_special_tokens=True))
