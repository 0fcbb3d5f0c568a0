"""Imported at start-up by every Python process of a torchrun test (``torchrun_util.STACKS`` on PYTHONPATH).

SIGUSR2 then writes every thread's Python stack to the process's stderr, even while a thread
waits in C (a gloo collective, a store): ``torchrun_util.dump_stacks`` sends it to a launcher's
whole tree before a timed-out test kills it, so the failure shows where each process was.
"""

import faulthandler
import signal

faulthandler.register(signal.SIGUSR2, all_threads=True)
