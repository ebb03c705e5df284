"""The values a config's keys may take, and the keys that only some model kinds read."""

from __future__ import annotations

import re

MODEL_KINDS = ("gpt", "llama", "mlp", "cnn")  # in a file; kind: llama is short for family: llama
# The most CPU devices one process emulates: 4096 take about 8 s to start, 100000 minutes.
MAX_CPU_DEVICES = 4096
MAX_STEPS = 2**31 - 1  # the state's step counter is an int32
DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("none", "full", "dots")
BYTE_VOCAB = 256
GPT_ONLY = {  # the gpt-only keys' defaults
    "family": "gpt",
    "vocab": BYTE_VOCAB,
    "d_ff": None,
    "dtype": "float32",
    "remat": False,
    "attention": "ring",
    "zigzag": True,
    "vocab_parallel": True,
    "scan_layers": True,
    "reduce_dtype": None,
    "residual_split": False,
    "loss_chunks": 1,
    "moe_chunks": 1,
    "experts": 0,
    "moe_every": 1,
    "top_k": 1,
    "capacity_factor": 1.25,
    "aux_weight": 0.01,
    "normalize_top_k": None,
}
ATTENTIONS = ("ring", "all_to_all", "dot_product", "splash")
# model.family: the GPT's own, or a family of replicator.models.families.FAMILIES (Llama's block
# and what the family adds). Importing that module imports jax (through the replicator package),
# so the config keeps its own list; tests/test_cli.py checks that it is FAMILIES'.
MODEL_FAMILIES = (
    "gpt", "llama", "mixtral", "qwen2", "gemma2", "gemma3_text", "qwen3", "qwen3_moe", "mistral",
)  # fmt: skip
EXPERT_FAMILIES = ("mixtral", "qwen3_moe")  # the families with a mixture of experts in every block
# the keys of the families on Llama's block (every one of MODEL_FAMILIES but gpt), and defaults
LLAMA_BLOCK_ONLY = {
    "kv_heads": None,
    "rope_theta": 10000.0,
    "norm_eps": 1e-5,
    "tie_embeddings": False,
    "head_dim": None,
    "sliding_window": None,
}
DATA_AXES = ("dcn_data", "data")  # the replicas: the batch is split over these
RING_IN_ONE_COND = ("1f1b", "interleaved", "zerobubble")  # schedules that cannot run a ring
OWN_KIND = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
SCHEDULES = ("gpipe", "1f1b", "circular", "interleaved", "zerobubble")  # pipeline schedules
WANDB_MODES = ("offline", "online", "disabled")
