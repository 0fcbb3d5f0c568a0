"""Hugging Face checkpoints on a mesh: load shard by shard, save back, pipeline stages.

* ``from_pretrained(path, mesh, *, axis="tensor", plan="auto", dtype=None)``: a checkpoint
  directory onto a mesh, tensor parallel, each process reading only its blocks;
* ``save_pretrained(path, apply_fn, params, mesh)``: a directory ``transformers`` loads, written
  from every process's blocks without gathering the model in one process;
* ``pipeline_stages(apply_fn, specs, mesh, ...)``: the model cut where its ``base_model_pp_plan``
  says, as the functions ``fpar.pipeline.pipeline`` runs;
* ``remat(apply_fn, policy=None)``: recompute each decoder layer in the backward (all layouts);
* ``lean(apply_fn)``: the model's RMSNorms and SwiGLU MLPs keep what fused kernels keep.

``transformers`` and ``safetensors`` are imported when these are called, not with ``fpar``.
"""

from ._files import CheckpointFormatError as CheckpointFormatError
from ._lean import lean as lean
from ._load import from_pretrained as from_pretrained
from ._pipeline import Stages as Stages
from ._pipeline import pipeline_stages as pipeline_stages
from ._remat import remat as remat
from ._save import save_pretrained as save_pretrained

__all__ = [
    "CheckpointFormatError",
    "Stages",
    "from_pretrained",
    "lean",
    "pipeline_stages",
    "remat",
    "save_pretrained",
]
