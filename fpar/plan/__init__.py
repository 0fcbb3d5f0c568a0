"""Plan a layout before renting the devices: memory, traffic and time of your own step, on paper.

``abstract_mesh`` is a mesh of any size with no processes and no memory; ``estimate`` runs the
user's step over it, one simulated device per class of devices holding the same shapes, through
fpar's real-mesh engine on meta tensors and a fake process group: the per-device peak memory
(live bytes over the step), the bytes each collective sends (exactly ``fpar.comm_stats()``), and
a step time from the hardware's peak, α–β links per mesh axis, overlap as fpar schedules it and
the pipeline's bubble.  ``search`` ranks layouts; ``python -m fpar.plan`` does it for fpar's
GPT/Llama-shaped model from the command line.
"""

from ._estimate import DeviceClass as DeviceClass
from ._estimate import Estimate as Estimate
from ._estimate import PlanError as PlanError
from ._estimate import estimate as estimate
from ._hardware import PRESETS as PRESETS
from ._hardware import Hardware as Hardware
from ._models import MODELS as MODELS
from ._models import Layout as Layout
from ._models import Model as Model
from ._models import model_step as model_step
from ._paper import abstract_mesh as abstract_mesh
from ._search import Result as Result
from ._search import ranking as ranking
from ._search import search as search

__all__ = [
    "MODELS",
    "PRESETS",
    "DeviceClass",
    "Estimate",
    "Hardware",
    "Layout",
    "Model",
    "PlanError",
    "Result",
    "abstract_mesh",
    "estimate",
    "model_step",
    "ranking",
    "search",
]
