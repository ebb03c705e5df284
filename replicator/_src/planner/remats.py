"""What the planner's remat policies keep, offload and compute again, per token and layer.

`pricing` prices a layout's activations, FLOPs and host traffic from these widths. A policy by
activation name (`replicator._src.pipeline.remat.PRESETS`) keeps its saved projections' outputs
on the device, its offloaded ones in host memory, and computes every other projection of the
layer again in the backward pass, and attention's kernel too (its output, ``context``, is not
kept). ``False`` keeps everything, ``"dots"`` every projection's output, ``True`` the input.

This module is plain Python: no JAX, nothing compiled.
"""

from __future__ import annotations

from replicator._src.pipeline.remat import PRESETS
from replicator._src.planner import layouts

#: The policies by name the planner tries, least recomputed first.
NAMED = ("save_dot_offload_mlpwi_0", "save_dot_except_mlpwi")


def is_named(remat) -> bool:
    """Whether ``remat`` is a policy by activation name: a preset, or a config's own
    (`layouts.by_name`'s ``"name=save|offload,..."``)."""
    return isinstance(remat, str) and (remat in PRESETS or "=" in remat)


def names_of(remat: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A policy by name's ``(saved, offloaded)`` activations.

    >>> names_of("decoder_layer_input=offload,out_proj=save")
    (('out_proj',), ('decoder_layer_input',))
    """
    if remat in PRESETS:
        return PRESETS[remat]
    actions = layouts.actions_of(remat)
    saved = tuple(n for n, a in actions.items() if a == "save")
    return saved, tuple(n for n, a in actions.items() if a == "offload")


def _widths(m, model: int) -> dict[str, float]:
    """Each named activation's elements per token on one device (``model`` splits heads and
    MLP units), the MLP's for a dense layer."""
    q, kv = m.num_heads * m.head_dim / model, m.kv_heads * m.head_dim / model
    h = m.hidden / model
    layer_input = m.d_model / (model if m.residual_split else 1)
    return {"decoder_layer_input": layer_input, "query_proj": q, "key_proj": kv,
            "value_proj": kv, "qkv_proj": 0.0, "context": q, "out_proj": m.d_model,
            "mlpwi_0": h if m.gated else 0.0, "mlpwi_1": h if m.gated else 0.0,
            "mlpwi": 0.0 if m.gated else h, "mlpwo": m.d_model}  # fmt: skip


def device_and_host(m, model: int, remat: str) -> tuple[float, float]:
    """Elements per token and layer a named policy keeps on the device (the layer's input with
    what it saves) and in host memory."""
    saved, offloaded = names_of(remat)
    w = _widths(m, model)
    host = sum(w[n] for n in offloaded)
    kept_input = 0.0 if "decoder_layer_input" in offloaded else w["decoder_layer_input"]
    device = sum(w[n] for n in saved) + kept_input
    return device, host


def recomputed_params(m, model: int, remat: str) -> float:
    """Weights per layer on one device whose products a named policy computes again: the
    projections it neither saves nor offloads, a layer's on average. The MLP's count in the
    dense layers only: a mixture's experts name none of their products, so every policy
    computes them again (`pricing` adds them)."""
    saved, offloaded = names_of(remat)
    kept = set(saved) | set(offloaded)
    d, hd = m.d_model, m.head_dim
    mlp = d * m.hidden * (m.num_layers - m.moe_layers) / m.num_layers
    weights = {"query_proj": d * m.num_heads * hd, "key_proj": d * m.kv_heads * hd,
               "value_proj": d * m.kv_heads * hd, "mlpwi_0": mlp if m.gated else 0,
               "mlpwi_1": mlp if m.gated else 0, "mlpwi": 0 if m.gated else mlp}  # fmt: skip
    # the output projections are not needed again: their outputs' gradients need only inputs
    return sum(w for name, w in weights.items() if name not in kept) / model


def host_memory(layout, m, tokens: float) -> float:
    """Bytes a layout's named remat policy offloads per device: its activations in host
    memory for the micro-batch in flight (``tokens``: the device's a step)."""
    if not is_named(layout.remat):
        return 0.0
    micro = layout.microbatches if layout.stage > 1 else layout.accumulate_steps
    width = device_and_host(m, layout.model, layout.remat)[1]
    return tokens / micro * m.num_layers / layout.stage * width * m.compute_bytes
