"""A BPE tokenizer trained on local text, then the GPT trained on that text through it.

No download: the documents are modules of Python's standard library, copied one per file into
``OUT/corpus``. The ``tokenizers`` package trains a byte-level BPE tokenizer on them, with
``<|endoftext|>`` as a special token, and saves ``OUT/tokenizer.json``. Then
``replicator train configs/lm_dp.yaml`` trains on the corpus with ``data.tokenizer`` set: each
file is encoded, followed by ``<|endoftext|>``, and the stream is cut into windows of
``seq_len + 1`` tokens (see Tokenizers in docs/guides/llama_and_hf.md). ``model.vocab`` is the
tokenizer's size.

    pip install "replicator[hf]"                         # the tokenizers package
    python examples/train_lm_tokenizer.py                # 8 emulated CPU devices
    python examples/train_lm_tokenizer.py --steps 400    # run again: resumes from OUT/lm_tokenizer
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/replicator_tokenizer", help="corpus, tokenizer, run")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--vocab", type=int, default=512, help="the BPE tokenizer's vocabulary size")
    p.add_argument("--max-bytes", type=int, default=400_000, help="of stdlib modules to copy")
    return p.parse_args()


def write_corpus(directory: pathlib.Path, max_bytes: int) -> list[pathlib.Path]:
    """Python's top-level stdlib modules, in sorted order, one document per file."""
    directory.mkdir(parents=True, exist_ok=True)
    files, total = [], 0
    for source in sorted(pathlib.Path(os.__file__).parent.glob("*.py")):
        text = source.read_text(encoding="utf-8")
        if total + len(text) > max_bytes:
            break
        (directory / f"{source.stem}.txt").write_text(text, encoding="utf-8")
        files.append(directory / f"{source.stem}.txt")
        total += len(text)
    return files


def train_tokenizer(files: list[pathlib.Path], vocab: int, path: pathlib.Path) -> int:
    """A byte-level BPE tokenizer.json trained on ``files``; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],  # the EOS replicator puts after each document
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(f) for f in files], trainer=trainer)
    tokenizer.save(str(path))
    return tokenizer.get_vocab_size()


def main() -> int:
    args = parse_args()
    try:
        import tokenizers  # noqa: F401
    except ModuleNotFoundError as e:  # one line naming the extra, before anything is written
        print(
            f"train_lm_tokenizer.py: needs the {e.name} package, which is not installed; "
            f'pip install "replicator[hf]" (in a clone: pip install -e ".[hf]").',
            file=sys.stderr,
        )
        return 2
    out = pathlib.Path(args.out)
    files = write_corpus(out / "corpus", args.max_bytes)
    size = train_tokenizer(files, args.vocab, out / "tokenizer.json")
    print(f"tokenizer: {size} tokens, trained on {len(files)} documents", flush=True)

    from replicator import cli

    root = pathlib.Path(__file__).resolve().parent.parent
    return cli.main(
        [
            "train",
            str(root / "configs" / "lm_dp.yaml"),
            f"out_dir={out}",
            "name=lm_tokenizer",
            f"steps={args.steps}",
            f"data.path={out / 'corpus'}",
            f"data.tokenizer={out / 'tokenizer.json'}",
            f"model.vocab={size}",
            "model.layers=2",
            "global_batch=16",
            f"log_every={max(1, args.steps // 4)}",
            f"checkpoint_every={args.steps}",
            "plot=false",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
