"""A small GPT-style decoder, written for pipeline parallelism, and text to train it on.

The text is byte-level: Python's standard library, shipped with the package.

The parameters are plain pytrees. The transformer blocks are *stacked*: every leaf of
``params["blocks"]`` has a leading layer axis, so `replicator.pipeline.stack_stages` splits them
into stages and `stage_fn` runs one stage as a ``lax.scan`` over its layers. The embedding and
the head (final LayerNorm and output matrix) stay outside the stages: the embedding produces the
pipeline's input and its gradient flows back from ``g_inputs``; the head is ``loss_fn``'s
``head_params``. `loss` is the whole model on one device: the oracle.

For tensor parallelism each dimension of each parameter has a role (`LOGICAL_AXES`), and one
table maps roles to mesh axes (`MEGATRON_RULES`: attention heads and MLP hidden units over
``model``); `place` and `place_pipeline` put the parameters on a mesh by it.

The same machinery runs the Llama family (`replicator.models.llama`): `GPTConfig`'s ``norm``,
``position``, ``mlp``, ``num_kv_heads``, ``bias`` and ``tie_embeddings`` choose RMSNorm, rotary
positions, a SwiGLU MLP, grouped-query attention (separate ``q``, ``k``, ``v`` matrices), no
biases and a head tied to the token table; the defaults are GPT-2's.

The parts live in modules of their own, which this one gathers:

* ``config``: `GPTConfig` and `RopeScaling`, the decoder's options;
* ``layers``: the decoder's layers, one module each: ``norms``, ``rotary`` (rotary positions,
  `rope_frequencies`, and the sequence's layout, `sequence_order`), ``self_attention`` (and
  ``masked_attention``: sliding windows and soft caps), ``mlp``, ``moe_mlp`` and ``head``
  (`output_head`, `head_logits`, `head_loss`);
* ``decoder``: the layers assembled: `init`, `embed`, `block`, `moe_block`, `blocks`,
  `stage_fn`, `apply` and `loss`;
* ``placement``: the parameters on a mesh: `LOGICAL_AXES`, `MEGATRON_RULES`,
  `partition_specs`, `place`, `place_pipeline`, and ZeRO-3's `zero_stacked` and `zero_split`;
* ``pipelined``: `pipeline_value_and_grad`;
* ``sizes``: `num_params`, `model_shape` and `flops_per_token`;
* ``text``: `stdlib_text` and `token_batches`.

>>> import jax, replicator as rp
>>> from replicator.models import gpt
>>> config = gpt.GPTConfig(vocab_size=256, seq_len=16, d_model=32, num_heads=4, num_layers=4)
>>> params = gpt.init(config, jax.random.key(0))
>>> params["blocks"]["attn"]["qkv"].shape      # stacked over 4 layers
(4, 32, 96)
>>> batch = next(gpt.token_batches(b"hello world, " * 50, batch_size=2, seq_len=16))
>>> round(float(gpt.loss(params, batch["tokens"], batch["targets"], config=config)), 1)
5.5
"""

from replicator._src.core.deprecation import moved_names as _moved_names
from replicator.models.config import MLPS as MLPS
from replicator.models.config import NORMS as NORMS
from replicator.models.config import POSITIONS as POSITIONS
from replicator.models.config import GPTConfig as GPTConfig
from replicator.models.config import RopeScaling as RopeScaling
from replicator.models.decoder import apply as apply
from replicator.models.decoder import block as block
from replicator.models.decoder import blocks as blocks
from replicator.models.decoder import blocks_and_stats as blocks_and_stats
from replicator.models.decoder import embed as embed
from replicator.models.decoder import head_logits as head_logits
from replicator.models.decoder import head_loss as head_loss
from replicator.models.decoder import init as init
from replicator.models.decoder import loss as loss
from replicator.models.decoder import loss_and_stats as loss_and_stats
from replicator.models.decoder import moe_block as moe_block
from replicator.models.decoder import output_head as output_head
from replicator.models.decoder import stage_fn as stage_fn
from replicator.models.layers.rotary import rope_frequencies as rope_frequencies
from replicator.models.layers.rotary import sequence_order as sequence_order
from replicator.models.pipelined import pipeline_value_and_grad as pipeline_value_and_grad
from replicator.models.placement import LOGICAL_AXES as LOGICAL_AXES
from replicator.models.placement import MEGATRON_RULES as MEGATRON_RULES
from replicator.models.placement import logical_axes_for as logical_axes_for
from replicator.models.placement import partition_specs as partition_specs
from replicator.models.placement import pipeline_params as pipeline_params
from replicator.models.placement import place as place
from replicator.models.placement import place_pipeline as place_pipeline
from replicator.models.placement import zero_split as zero_split
from replicator.models.placement import zero_stacked as zero_stacked
from replicator.models.sizes import flops_per_token as flops_per_token
from replicator.models.sizes import model_shape as model_shape
from replicator.models.sizes import num_params as num_params
from replicator.models.text import stdlib_text as stdlib_text
from replicator.models.text import token_batches as token_batches

__getattr__ = _moved_names(
    "replicator.models.gpt", {"logical_axes": "replicator.models.gpt.logical_axes_for"}
)  # renamed: one release
