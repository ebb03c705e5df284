"""The decoder's layers, one module each, which `replicator.models.decoder` assembles into
blocks: ``norms`` (LayerNorm, RMSNorm), ``rotary`` (rotary positions and the sequence's layout),
``attention``, ``mlp`` (GELU, SwiGLU) and ``experts`` (a mixture of experts), with ``common``
(what they share). And ``batch_norm``: layers that know about replicas (the CNN's
`CrossReplicaBatchNorm`).
"""

from replicator.models.layers.batch_norm import CrossReplicaBatchNorm as CrossReplicaBatchNorm
