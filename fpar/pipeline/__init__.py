"""Pipeline parallelism: GPipe as a functional scan, and schedules as data run by an executor.

Two ways to pipeline a model over a ``"pipe"`` mesh axis:

* ``gpipe_scan`` inside ``fpar.shard``: a per-device scan over ticks that shifts activations
  with ``ppermute``; differentiating it gives GPipe (or, with several chunks per device, the
  looped breadth-first schedule).
* ``pipeline(stage, schedule, mesh, loss=...)``: a driver that runs a schedule (``gpipe``,
  ``one_f_one_b``, ``interleaved_1f1b``, ``zb_h1``, the V-shaped ``zb_v`` and ``dualpipe_v``,
  or your own via ``place``) action by
  action, with explicit sends and receives between neighbouring stages, on either backend.

Schedules are data (``Schedule`` of ``Action``s on a tick grid), checked by ``validate``,
measured by ``timeline``/``simulate`` and the executor, and drawn by ``draw``.
"""

from ._builders import dualpipe_v as dualpipe_v
from ._builders import gpipe as gpipe
from ._builders import interleaved_1f1b as interleaved_1f1b
from ._builders import one_f_one_b as one_f_one_b
from ._builders import place as place
from ._builders import zb_h1 as zb_h1
from ._builders import zb_v as zb_v
from ._draw import draw as draw
from ._executor import StepResult as StepResult
from ._executor import pipeline as pipeline
from ._layout import model_major as model_major
from ._layout import stage_major as stage_major
from ._scan import gpipe_scan as gpipe_scan
from ._schedule import Action as Action
from ._schedule import Schedule as Schedule
from ._schedule import ScheduleError as ScheduleError
from ._timeline import Timeline as Timeline
from ._timeline import simulate as simulate
from ._timeline import timeline as timeline
from ._validate import validate as validate

__all__ = [
    "Action",
    "Schedule",
    "ScheduleError",
    "StepResult",
    "Timeline",
    "draw",
    "dualpipe_v",
    "gpipe",
    "gpipe_scan",
    "interleaved_1f1b",
    "model_major",
    "one_f_one_b",
    "pipeline",
    "place",
    "simulate",
    "stage_major",
    "timeline",
    "validate",
    "zb_h1",
    "zb_v",
]
