"""Imported first by the agent's rank template (multiprocessing's forkserver): the template
dies with the agent that started it, and its ranks (PR_SET_PDEATHSIG) with the template.

Without this the template would outlive a killed agent for as long as a rank runs, since
each rank holds the template's keep-alive pipe until it closes it.
"""

import signal

from gpufleet import _environ, _process

_process.die_with_parent(signal.SIGKILL, _environ.parent_pid())
