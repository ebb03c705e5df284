"""``hf.load`` of Llama 2 70B's shapes onto one host of a 64-device ZeRO-3 layout: reads, seconds.

The checkpoint is synthetic: Llama 2 70B's ``config.json`` (hidden 8192, 64 heads, 8 KV heads,
intermediate 28672, vocabulary 32000) with ``--layers`` of its 80 layers, in bf16, in
safetensors files of at most 10 GB as Hugging Face shards it. The files are written sparsely:
each header, then the first 64 KiB of every tensor as random bf16 values, the rest left as holes
(so it takes no disk, and a hole reads as zeros).

The target is the placement ``replicator train configs/llama2_70b.yaml`` gives the parameters
over 64 devices (FSDP/ZeRO-3 over ``data``, MaxText's layout: every weight split 64 ways on its
first axis after the layers, i.e. on the Hugging Face tensor's inner dimension), built from
shapes by the CLI's job code (``jobs.abstract_job``), in fp32 as the CLI keeps the weights.
The 64 devices are 8 processes of 8 CPU devices (``replicator.launch``), as 8 hosts: process
0 calls ``hf.load`` and the others wait, so the figures are one host's, through the real code
path (each process reads the blocks of its own devices only).

Counted in process 0: the calls of ``hf.files.pread_into`` (the reads: one per contiguous span) and
of ``os.preadv`` (the system calls), the bytes read, the seconds ``hf.load`` takes, the bytes
the host's devices hold, its peak resident memory (VmHWM), and whether the host's blocks hold
the file's values (every shard of process 0 against a memory map of the file). ``--rev``
measures ``replicator/models/hf.py`` as of a git revision (the rest of the tree as it is), e.g.
the row-by-row reader before it read spans. Per layer = (4 layers - 2 layers) / 2; the 80-layer
figures are extrapolated from it (reads and bytes grow exactly linearly with the layers).

    python benchmarks/hf_load.py --layers 4                  # the working tree's hf.load
    python benchmarks/hf_load.py --layers 4 --rev 305e37f    # hf.py as of a revision
    python benchmarks/hf_load.py --table                     # 2 and 4 layers, both; the table
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import pathlib
import struct
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "vocab_size": 32000,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
FILE_BYTES = 10 * 10**9  # Hugging Face's shards of Llama 2 70B are ~10 GB each
FILLED = 64 * 1024  # the bytes of random values at the start of each tensor
PROCESSES, DEVICES = 8, 8  # hosts, and devices per host: 64 devices


def tensors(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint's tensors in Hugging Face's order: (name, shape)."""
    d, f, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    kv = CONFIG["num_key_value_heads"] * d // CONFIG["num_attention_heads"]
    layer = [
        ("input_layernorm.weight", (d,)),
        ("self_attn.q_proj.weight", (d, d)),
        ("self_attn.k_proj.weight", (kv, d)),
        ("self_attn.v_proj.weight", (kv, d)),
        ("self_attn.o_proj.weight", (d, d)),
        ("post_attention_layernorm.weight", (d,)),
        ("mlp.gate_proj.weight", (f, d)),
        ("mlp.up_proj.weight", (f, d)),
        ("mlp.down_proj.weight", (d, f)),
    ]
    out = [("model.embed_tokens.weight", (v, d))]
    out += [(f"model.layers.{i}.{n}", s) for i in range(layers) for n, s in layer]
    return [*out, ("model.norm.weight", (d,)), ("lm_head.weight", (v, d))]


def write_checkpoint(directory: pathlib.Path, layers: int) -> int:
    """The sparse checkpoint (see the module docstring); returns its tensors' bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    files: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors(layers):
        nbytes = math.prod(shape) * 2
        if files[-1] and size + nbytes > FILE_BYTES:
            files.append([])
            size = 0
        files[-1].append((name, shape))
        size += nbytes
    rng = np.random.default_rng(0)
    weight_map, total = {}, 0
    for k, group in enumerate(files):
        file = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        header, start = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in group:
            nbytes = math.prod(shape) * 2
            header[name] = {
                "dtype": "BF16",
                "shape": list(shape),
                "data_offsets": [start, start + nbytes],
            }
            start += nbytes
            weight_map[name] = file
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        with open(directory / file, "wb") as out:
            out.write(struct.pack("<Q", len(text)) + text)
            base = out.tell()
            for name, _ in group:
                begin = header[name]["data_offsets"][0]
                values = rng.standard_normal(FILLED // 2).astype(np.float32)
                out.seek(base + begin)
                out.write((values.view(np.uint32) >> 16).astype(np.uint16).tobytes())  # bf16
            out.truncate(base + start)
        total += start
    (directory / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": layers}))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


class _Reads(types.SimpleNamespace):
    """What the benchmark reaches into: ``load``, the module whose ``pread`` (its attribute
    ``pread_name``) makes every read, and ``tensors`` and ``describe``."""


def hf_module(rev: str | None) -> _Reads:
    """``replicator.models.hf``'s parts, or its file's as of git revision ``rev`` (one module,
    before it became a package)."""
    from replicator.models import hf
    from replicator.models.families import FAMILIES
    from replicator.models.hf import files, leaves

    if rev is None:  # the benchmark's checkpoint is a Llama's (CONFIG)
        describe = functools.partial(leaves.describe, family=FAMILIES[CONFIG["model_type"]])
        return _Reads(
            load=hf.load, owner=files, pread_name="pread_into", tensors=files.tensors,
            describe=describe,
        )  # fmt: skip
    show = lambda name: subprocess.run(
        ["git", "show", f"{rev}:replicator/models/{name}.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    source, checks = show("hf"), show("hf_checks")
    modules = {}
    for name, text in (("hf_checks", checks), ("hf", source)):  # hf with that hf_checks
        path = pathlib.Path(tempfile.mkdtemp()) / f"{name}_at_rev.py"
        path.write_text(
            text.replace(
                "from replicator.models import hf_checks,", "from replicator.models import"
            )
        )
        spec = importlib.util.spec_from_file_location(f"replicator.models.{name}_at_rev", path)
        modules[name] = importlib.util.module_from_spec(spec)
        modules[name].hf_checks = modules.get("hf_checks")
        spec.loader.exec_module(modules[name])
    old = modules["hf"]
    return _Reads(
        load=old.load, owner=old, pread_name="_pread_into", tensors=old._tensors,
        describe=old._describe,
    )  # fmt: skip


def check_values(hf, directory: pathlib.Path, params) -> bool:
    """Every block process 0's devices hold equals the file's values (read by a memory map)."""
    import jax

    tensors = hf.tensors(directory)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        plan = hf.describe(path, leaf.ndim, "check")
        n = plan.lead
        counts = leaf.shape[:n]
        for shard in leaf.addressable_shards:
            index = tuple(shard.index) + (slice(None),) * (leaf.ndim - len(shard.index))
            got = np.asarray(shard.data)
            for position in np.ndindex(*got.shape[:n]):
                layer = tuple(s.indices(c)[0] + p for s, c, p in zip(index, counts, position))
                name = (
                    plan.name.format(i=int(np.ravel_multi_index(layer, counts))) if n else plan.name
                )
                t = tensors[name]
                whole = np.memmap(t.file, t.dtype, "r", t.offset, t.shape)
                want = whole.T if plan.transposed else whole
                if not np.array_equal(got[position], np.asarray(want[index[n:]], np.float32)):
                    return False
    return True


def layout(layers: int) -> list:
    """The parameters' placement ``replicator train configs/llama2_70b.yaml`` gives (with
    ``layers`` layers) on 64 devices, from shapes by the CLI's job code (in this process's 64
    CPU devices): ``[keys, shape, dtype, spec]`` per leaf."""
    import jax

    from replicator.cli import config as cli_config
    from replicator.cli import jobs

    cfg = cli_config.load(ROOT / "configs/llama2_70b.yaml", [f"model.layers={layers}"])
    _, _, state, _ = jobs.abstract_job(cfg)
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state["job"]["params"])[0]:
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]  # not .value
        out.append([keys, list(leaf.shape), str(leaf.dtype), list(leaf.sharding.spec)])
    return out


def placed(leaves: list) -> dict:
    """`layout`'s leaves as the target of ``hf.load``: shapes with their ``NamedSharding`` on
    the mesh the CLI builds over every process's devices (``mesh: {data: -1}``)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    import replicator as rp

    mesh = rp.Replicator(mesh_shape={"data": -1}).mesh
    target: dict = {}
    for keys, shape, dtype, spec in leaves:
        spec = PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in spec))
        node = target
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
    return target


def worker(args: argparse.Namespace) -> None:
    import replicator as rp

    rp.distributed.initialize()
    import jax

    flag = pathlib.Path(args.out + ".done")
    if jax.process_index() != 0:  # the other hosts: their devices are the mesh's, idle
        while not flag.exists():
            time.sleep(0.5)
        return
    hf = hf_module(args.rev)
    counts = {"reads": 0, "syscalls": 0, "bytes": 0}
    pread_into, preadv = getattr(hf.owner, hf.pread_name), os.preadv

    def counting_read(fd, offset, buffer):
        counts["reads"] += 1
        counts["bytes"] += len(buffer)
        pread_into(fd, offset, buffer)

    def counting_preadv(fd, buffers, offset):
        counts["syscalls"] += 1
        return preadv(fd, buffers, offset)

    setattr(hf.owner, hf.pread_name, counting_read)
    os.preadv = counting_preadv
    try:
        target = placed(json.loads(pathlib.Path(args.layout).read_text()))
        start, cpu = time.perf_counter(), time.process_time()
        params = jax.block_until_ready(hf.load(args.dir, target))
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
        leaves = jax.tree.leaves(params)
        held = sum(s.data.nbytes for leaf in leaves for s in leaf.addressable_shards)
        exact = check_values(hf, pathlib.Path(args.dir), params) if args.check else None
        result = {**counts, "seconds": seconds, "cpu_seconds": cpu, "held": held}
        result |= {"peak_rss": peak, "exact": exact}
        result["devices"] = [d.id for d in jax.local_devices()]
        pathlib.Path(args.out).write_text(json.dumps(result))
    finally:
        flag.touch()


def run(layers: int, rev: str | None, directory: pathlib.Path, check: bool) -> dict:
    """One measurement: the checkpoint of ``layers`` layers loaded by process 0 of 8."""
    total = write_checkpoint(directory, layers)
    out = pathlib.Path(tempfile.mkdtemp()) / "result.json"
    place = [sys.executable, __file__, "--layout", "--layers", str(layers), "--out", str(out)]
    subprocess.run(place, cwd=ROOT, check=True)
    cmd = [sys.executable, "-m", "replicator.launch", "-n", str(PROCESSES)]
    cmd += ["--devices-per-process", str(DEVICES), "--", sys.executable, __file__, "--worker"]
    cmd += ["--layers", str(layers), "--dir", str(directory), "--out", str(out)]
    cmd += ["--layout", str(out) + ".layout"]
    cmd += ["--rev", rev] * bool(rev) + ["--no-check"] * (not check)
    subprocess.run(cmd, cwd=ROOT, check=True)
    found = json.loads(out.read_text())
    return {"layers": layers, "rev": rev or "working tree", "tensor_bytes": total} | found


def table(results: list[dict]) -> str:
    """Per layer (4 - 2 layers, halved), the rest (embedding, norm, head), and 80 layers."""
    lines = [
        "| code | layers | reads | preadv calls | GB read | GB held | s | CPU s | peak RSS GB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['rev']} | {r['layers']} | {r['reads']:,} | {r['syscalls']:,} | "
            f"{r['bytes'] / 1e9:.3f} | {r['held'] / 1e9:.3f} | {r['seconds']:.1f} | "
            f"{r['cpu_seconds']:.1f} | {r['peak_rss'] / 1e9:.2f} |"
        )
    keys = ("reads", "bytes", "seconds", "cpu_seconds")
    lines += ["", "| code | per layer | reads | GB read | s | CPU s |", "|---|---|---|---|---|---|"]
    for rev in dict.fromkeys(r["rev"] for r in results):
        runs = {r["layers"]: r for r in results if r["rev"] == rev}
        if not {2, 4} <= set(runs):
            continue
        per = {k: (runs[4][k] - runs[2][k]) / 2 for k in keys}
        for what, row in (("one layer", per), ("80 layers", {
                k: runs[2][k] + 78 * per[k] for k in keys})):  # fmt: skip
            lines.append(
                f"| {rev} | {what} | {row['reads']:,.0f} | {row['bytes'] / 1e9:.3f} | "
                f"{row['seconds']:.1f} | {row['cpu_seconds']:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="of Llama 2 70B's 80")
    p.add_argument("--rev", help="measure replicator/models/hf.py as of this git revision")
    p.add_argument("--table", action="store_true", help="2 and 4 layers, --before and now")
    p.add_argument("--before", default="305e37f", help="--table's revision to compare with")
    p.add_argument("--dir", default=None, help="where to write the sparse checkpoint")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the values")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--layout", nargs="?", const="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.layout == "":  # in a process of its own, with 64 CPU devices
        import jax

        jax.config.update("jax_num_cpu_devices", 64)
        jax.config.update("jax_platforms", "cpu")
        pathlib.Path(args.out + ".layout").write_text(json.dumps(layout(args.layers)))
        return None
    directory = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="llama2-70b-sparse-"))
    plan = [(n, r) for n in (2, 4) for r in (args.before, None)] if args.table else []
    results = []
    for layers, rev in plan or [(args.layers, args.rev)]:
        results.append(run(layers, rev, directory / f"{layers}", args.check))
        print(json.dumps(results[-1]), flush=True)
    print(table(results))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
