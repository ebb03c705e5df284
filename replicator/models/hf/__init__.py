"""Hugging Face checkpoints in and out, one device's slice at a time.

The families are Llama, Mixtral, Qwen2, Gemma 2, Gemma 3 (text), Qwen3, Qwen3-MoE and Mistral
(`replicator.models.families`); the tables below are Llama's and Mixtral's, and each family's
module names what differs.

`load` builds every parameter as a global ``jax.Array`` whose devices each get only the slice
they hold, straight from the checkpoint's ``*.safetensors`` files (fp32, fp16 or bf16), in a
few large reads per tensor: no host holds the whole model, and the rows a process's slices
touch are read once per process.
`save` writes a directory that ``transformers.LlamaForCausalLM.from_pretrained`` (or
``MixtralForCausalLM``'s, ``Qwen2ForCausalLM``'s) reads, gathering one tensor at a time to the host.

The parameter tree (`replicator.models.gpt` with its Llama options) and the Hugging Face names.
Hugging Face stores a linear layer as ``[out, in]``; ours is ``[in, out]``, its transpose (T):

=========================  =====================  =============================================
ours                       shape                  Hugging Face
=========================  =====================  =============================================
``embed.tokens``           ``[V, d]``             ``model.embed_tokens.weight``
``blocks.ln1.scale``       ``[L, d]``             ``model.layers.{i}.input_layernorm.weight``
``blocks.attn.q``          ``[L, d, H*hd]``       ``model.layers.{i}.self_attn.q_proj`` T
``blocks.attn.k|v``        ``[L, d, KV*hd]``      ``model.layers.{i}.self_attn.{k,v}_proj`` T
``blocks.attn.out``        ``[L, H*hd, d]``       ``model.layers.{i}.self_attn.o_proj`` T
``blocks.ln2.scale``       ``[L, d]``             ``model.layers.{i}.post_attention_layernorm``
``blocks.mlp.gate|up``     ``[L, d, F]``          ``model.layers.{i}.mlp.{gate,up}_proj`` T
``blocks.mlp.down``        ``[L, F, d]``          ``model.layers.{i}.mlp.down_proj`` T
``head.norm.scale``        ``[d]``                ``model.norm.weight``
``head.w``                 ``[d, V]``             ``lm_head.weight`` T (none when tied)
=========================  =====================  =============================================

(``.weight`` left out of the names, T for transposed). With ``attention_bias`` and
``mlp_bias``, each linear leaf ``x`` has an ``x_bias`` leaf ``[L, out]`` (``..._proj.bias``).
A Qwen2 (``model_type: "qwen2"``) is named as a Llama, with the biases of ``q``, ``k`` and
``v`` only.

A Mixtral (``model_type: "mixtral"``, E experts; the GPT's Llama options with
``num_experts=E``) has the same ``embed`` and ``head``; its blocks are ``blocks.moe``:
``ln1``, ``attn`` and ``ln2`` named as above, and ``moe`` in place of ``mlp``, whose expert
leaves have an expert axis after the layers' (``[i, j]``: layer i, expert j; the names are in
``model.layers.{i}.block_sparse_moe.``):

=========================  =====================  =============================================
``blocks.moe.moe.router``  ``[L, d, E]``          ``gate`` T (``[E, d]``)
``blocks.moe.moe.gate``    ``[L, E, d, F]``       ``experts.{j}.w1`` T
``blocks.moe.moe.up``      ``[L, E, d, F]``       ``experts.{j}.w3`` T
``blocks.moe.moe.down``    ``[L, E, F, d]``       ``experts.{j}.w2`` T
=========================  =====================  =============================================

The blocks may also be a pipeline's ``stages`` (`gpt.pipeline_params`): leading axes
``[K, L/K]`` or ``[V, K, L/K]`` hold the layers in row-major order (then the expert axis, as
``[K, L/K, E, d, F]``). Mixtral has no biases. ZeRO-3's `ShardedParam` leaves load and save as
the arrays they wrap.

To train a checkpoint, read its sizes with `read_config` (`decoder_config` turns them
into a `gpt.GPTConfig`) and load it into the layout training uses:
``hf.load(path, repl.abstract(lambda: gpt.place(repl, gpt.init(config, key), config=config)))``
(``repl.abstract`` allocates nothing), or ``hf.load(path, hf.abstract(hf_config, repl, specs))``.

>>> import pathlib, tempfile, jax, numpy as np
>>> from replicator.models import hf
>>> config = {"model_type": "llama", "vocab_size": 16, "hidden_size": 8,
...           "intermediate_size": 12, "num_attention_heads": 2, "num_hidden_layers": 2}
>>> rng = np.random.default_rng(0)
>>> params = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32), hf.shapes(config))
>>> directory = pathlib.Path(tempfile.mkdtemp()) / "tiny-llama"
>>> _ = hf.save(directory, params, config)
>>> sorted(p.name for p in directory.iterdir())
['config.json', 'model.safetensors']
>>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
>>> loaded = hf.load(directory, hf.abstract(hf.read_config(directory), mesh))
>>> bool(np.array_equal(loaded["blocks"]["attn"]["q"], params["blocks"]["attn"]["q"]))
True

The modules: `configs` (``config.json`` read and checked, the tree it describes), `files` (the
safetensors files read), `leaves` (our leaves against one family's Hugging Face names: its
`Family` record's ``outer_names`` and ``layer_names``, never another family's), `reading`
(`load`), `entries` and `writing` (`save`), `checks` and `config_checks` (refusals, each in
one line).
"""

from replicator.models.hf.configs import abstract as abstract
from replicator.models.hf.configs import read_config as read_config
from replicator.models.hf.configs import shapes as shapes
from replicator.models.hf.decoder import decoder_config as decoder_config
from replicator.models.hf.reading import load as load
from replicator.models.hf.writing import save as save
