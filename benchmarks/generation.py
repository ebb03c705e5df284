"""Greedy decoding on the CPU: ``replicator.models.generate`` against transformers' ``generate``.

One Llama-shaped model (by default d_model 512, 8 layers, 8 query and 4 key/value heads, MLP
1408, vocabulary 32000: 56M parameters), fp32, its random weights made by transformers
(``LlamaForCausalLM``, seed 0) and converted (`llama.params_from_state_dict`), so both decode
the same model. For each batch size, the same prompts (``--prompt-len`` random ids) and
``--new-tokens`` new tokens (no EOS: every row generates them all), alternated in one process:
``--rounds`` timed calls of each, the median reported as new tokens per second (batch x new
tokens / seconds, the prefill included). Ours is compiled by its first call, timed apart (the
compile, and the first call's wall time); transformers' first call is a warm-up too. Both
greedy, and the tokens are checked equal.

    python benchmarks/generation.py                      # batch 1 and 8; the table
    python benchmarks/generation.py --json gen.json      # and the figures as JSON

JAX and torch each use every core of the machine (torch's intra-op threads: ``--threads``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import numpy as np


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="timed calls of each, per batch size")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch's threads")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return p.parse_args()


def _models(args):
    """transformers' model and ours (config, parameters) of the same random weights."""
    import torch
    import transformers

    from replicator.models import hf, llama

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=args.d_ff,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=4096,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.generation_config.eos_token_id = None  # every row generates all its tokens
    model.generation_config.pad_token_id = 0
    seq_len = args.prompt_len + args.new_tokens
    config = hf.decoder_config(model.config.to_dict(), seq_len=seq_len)
    params = llama.params_from_state_dict(model.state_dict(), config=config)
    return model, config, jax.device_put(params, jax.devices()[0])


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _one_batch(args, model, config, params, batch: int) -> dict:
    """The figures of one batch size: compile, first call, and the median of the timed calls."""
    import torch

    from replicator.models import generate

    n = args.new_tokens
    prompt = np.random.default_rng(batch).integers(3, args.vocab, (batch, args.prompt_len))
    ours = lambda: np.asarray(generate(params, config, prompt, n))  # fetched: the work is done
    ids = torch.from_numpy(prompt)
    mask = torch.ones_like(ids)

    def theirs():
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n)  # fmt: skip
        return out.numpy()

    first, want = _timed(ours)  # compiles
    _timed(theirs)  # warm-up
    times = {"ours": [], "transformers": []}
    outs = {}
    for _ in range(args.rounds):
        for name, fn in (("ours", ours), ("transformers", theirs)):
            seconds, outs[name] = _timed(fn)
            times[name].append(seconds)
    median = {k: statistics.median(v) for k, v in times.items()}
    return {
        "batch": batch,
        "ours_tokens_per_s": batch * n / median["ours"],
        "transformers_tokens_per_s": batch * n / median["transformers"],
        "ours_seconds": times["ours"],
        "transformers_seconds": times["transformers"],
        "ours_first_call_seconds": first,  # trace + compile + one call
        "same_tokens": bool(
            (outs["ours"] == outs["transformers"]).all() and (want == outs["ours"]).all()
        ),
    }


def main() -> None:
    args = _args()
    import torch

    torch.set_num_threads(args.threads)
    model, config, params = _models(args)
    size = sum(p.numel() for p in model.parameters())
    rows = [_one_batch(args, model, config, params, int(b)) for b in args.batches.split(",")]
    print(
        f"greedy decoding, {size / 1e6:.0f}M-parameter Llama (d_model {args.d_model}, "
        f"{args.layers} layers, {args.heads}/{args.kv_heads} heads, vocab {args.vocab}), fp32, "
        f"prompt {args.prompt_len} + {args.new_tokens} new tokens, median of {args.rounds}; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, jax "
        f"{jax.__version__}, torch {torch.__version__}\n"
    )
    print(
        "| batch | ours tokens/s | transformers tokens/s | ours / transformers | ours first call (compile) s | same tokens |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["ours_tokens_per_s"] / r["transformers_tokens_per_s"]
        print(
            f"| {r['batch']} | {r['ours_tokens_per_s']:.0f} | {r['transformers_tokens_per_s']:.0f} "
            f"| {ratio:.2f} | {r['ours_first_call_seconds']:.1f} | {r['same_tokens']} |"
        )
    if args.json:
        record = {"args": vars(args), "parameters": size, "jax": jax.__version__,
                  "torch": torch.__version__, "rows": rows}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
