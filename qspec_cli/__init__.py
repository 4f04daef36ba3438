"""qspec's command line (`qspec_cli.main`)."""

import os

# Threads that spin at OpenMP barriers (the active wait policy) stall for a descheduled
# sibling when another process holds a core: decode collapsed 17x on a 2-core VM beside one
# busy process. Passive waiting sleeps instead; what each policy keeps under a hog, and
# costs on a quiet machine, is measured by benchmarks/contention.py (docs/PERF.md). Read by
# libgomp when torch is first imported, so it is set here, before anything imports torch; a
# value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
