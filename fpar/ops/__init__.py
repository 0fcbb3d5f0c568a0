"""Parallel layers built from fpar.shard-level pieces (tensor, sequence and data parallel).

Every layer is a pure per-device function, called *inside* ``fpar.shard``, that names its mesh
axis with ``axis=``; parameters are plain tensor dicts, and ``*_specs`` / ``init_*`` give their
``fpar.P`` and ``fpar.init`` leaves.

* Megatron 1D (``_megatron.py``): ``column_linear``, ``row_linear``, ``mlp``, ``attention``,
  ``vocab_embedding``, ``vocab_cross_entropy``.
* Sequence parallel (``_sequence.py``): Megatron-SP ``sp_column_linear``, ``sp_gather_matmul``, ``sp_row_linear``,
  ``sp_mlp``, ``sp_attention``, ``sp_vocab_embedding``; ``ulysses_attention``; ``ring_attention``,
  ``ring_self_attention``.
* A GPT (``_gpt.py``): ``layer_norm``, ``gpt_block``, ``sp_gpt_block``, ``gpt``, ``gpt_loss``, and
  ``mlp_specs``, ``attention_specs``, ``layer_norm_specs``, ``gpt_block_specs``, ``gpt_specs``,
  ``init_mlp``, ``init_attention``, ``init_layer_norm``, ``init_gpt_block``, ``init_gpt``.
* Colossal-AI multi-dimensional TP (``_summa.py``, ``_summa_3d.py``): 2D SUMMA ``summa_matmul``,
  ``linear_2d``, ``layer_norm_2d``, ``mlp_2d``; 2.5D ``linear_2p5d`` ...; 3D ``linear_3d`` ...; and
  ``specs_2d`` / ``specs_2p5d`` / ``specs_3d`` giving every operand's ``P``.
* Mixture of experts (``_moe.py``): ``moe`` (top-k, dropless or with a capacity factor, expert
  parallel over exact-count ``all_to_all`` on a real mesh, grouped matmuls, expert-TP),
  ``moe_specs``, ``init_moe``; the transformer block with a MoE MLP, ``moe_block``, is in ``_gpt.py``.
* Any ``nn.Module`` / Hugging Face model as it is (``_tensor_parallel.py``): ``tensor_parallel``
  (Megatron plan applied to the module's own forward) and its ``TensorParallelFn``.
* A decoder layer's pointwise pieces that keep what fused kernels keep (``_lean.py``):
  ``rms_norm`` (its input and a number a row, not float32 copies), ``swiglu`` (``gate`` and
  ``up``, not ``silu(gate)`` too).
* Configuration (``_layout.py``): ``tensor_layout`` / ``TensorLayout`` map a Colossal-AI style
  tensor-parallel config onto mesh axis names and shapes.

Example:
  >>> mesh = fpar.make_mesh((2, 4), ("data", "tensor"))
  >>> params = fpar.init(fpar.ops.init_gpt(256, 64, 2, 64), mesh, fpar.ops.gpt_specs(2), seed=0)
  >>> def loss(params, ids, targets):
  ...     tok = fpar.ops.gpt_loss(params, ids, targets, axis="tensor", n_heads=4)
  ...     return fpar.pmean(tok.mean(), "data")
  >>> step = fpar.shard(loss, mesh, in_specs=(fpar.ops.gpt_specs(2), P("data"), P("data")), out_specs=P())
"""

from ._dropout import dropout as dropout
from ._gpt import attention_specs as attention_specs
from ._gpt import gpt as gpt
from ._gpt import gpt_block as gpt_block
from ._gpt import gpt_block_specs as gpt_block_specs
from ._gpt import gpt_loss as gpt_loss
from ._gpt import gpt_specs as gpt_specs
from ._gpt import init_attention as init_attention
from ._gpt import init_gpt as init_gpt
from ._gpt import init_gpt_block as init_gpt_block
from ._gpt import init_layer_norm as init_layer_norm
from ._gpt import init_mlp as init_mlp
from ._gpt import layer_norm as layer_norm
from ._gpt import layer_norm_specs as layer_norm_specs
from ._gpt import mlp_specs as mlp_specs
from ._gpt import moe_block as moe_block
from ._gpt import sp_gpt_block as sp_gpt_block
from ._layout import TensorLayout as TensorLayout
from ._layout import tensor_layout as tensor_layout
from ._lean import rms_norm as rms_norm
from ._lean import swiglu as swiglu
from ._megatron import attention as attention
from ._megatron import column_linear as column_linear
from ._megatron import mlp as mlp
from ._megatron import row_linear as row_linear
from ._megatron import vocab_cross_entropy as vocab_cross_entropy
from ._megatron import vocab_embedding as vocab_embedding
from ._moe import init_moe as init_moe
from ._moe import moe as moe
from ._moe import moe_specs as moe_specs
from ._sequence import ring_attention as ring_attention
from ._sequence import ring_self_attention as ring_self_attention
from ._sequence import sp_attention as sp_attention
from ._sequence import sp_column_linear as sp_column_linear
from ._sequence import sp_gather_matmul as sp_gather_matmul
from ._sequence import sp_mlp as sp_mlp
from ._sequence import sp_row_linear as sp_row_linear
from ._sequence import sp_vocab_embedding as sp_vocab_embedding
from ._sequence import ulysses_attention as ulysses_attention
from ._summa import TensorParallelSpecs as TensorParallelSpecs
from ._summa import layer_norm_2d as layer_norm_2d
from ._summa import layer_norm_2p5d as layer_norm_2p5d
from ._summa import linear_2d as linear_2d
from ._summa import linear_2p5d as linear_2p5d
from ._summa import mlp_2d as mlp_2d
from ._summa import mlp_2p5d as mlp_2p5d
from ._summa import specs_2d as specs_2d
from ._summa import specs_2p5d as specs_2p5d
from ._summa import summa_matmul as summa_matmul
from ._summa_3d import layer_norm_3d as layer_norm_3d
from ._summa_3d import linear_3d as linear_3d
from ._summa_3d import mlp_3d as mlp_3d
from ._summa_3d import specs_3d as specs_3d
from ._tensor_parallel import TensorParallelFn as TensorParallelFn
from ._tensor_parallel import tensor_parallel as tensor_parallel

__all__ = [
    "TensorLayout",
    "TensorParallelFn",
    "TensorParallelSpecs",
    "attention",
    "attention_specs",
    "column_linear",
    "dropout",
    "gpt",
    "gpt_block",
    "gpt_block_specs",
    "gpt_loss",
    "gpt_specs",
    "init_attention",
    "init_gpt",
    "init_gpt_block",
    "init_layer_norm",
    "init_mlp",
    "init_moe",
    "layer_norm",
    "layer_norm_2d",
    "layer_norm_2p5d",
    "layer_norm_3d",
    "layer_norm_specs",
    "linear_2d",
    "linear_2p5d",
    "linear_3d",
    "mlp",
    "mlp_2d",
    "mlp_2p5d",
    "mlp_3d",
    "mlp_specs",
    "moe",
    "moe_block",
    "moe_specs",
    "ring_attention",
    "ring_self_attention",
    "rms_norm",
    "row_linear",
    "sp_attention",
    "sp_column_linear",
    "sp_gather_matmul",
    "sp_gpt_block",
    "sp_mlp",
    "sp_row_linear",
    "sp_vocab_embedding",
    "specs_2d",
    "specs_2p5d",
    "specs_3d",
    "summa_matmul",
    "swiglu",
    "tensor_layout",
    "tensor_parallel",
    "ulysses_attention",
    "vocab_cross_entropy",
    "vocab_embedding",
]
