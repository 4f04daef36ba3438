"""qspec's command line (`qspec_cli.app`; one module per command)."""

import os

# OpenMP threads that spin at barriers stall for a descheduled sibling when another process
# holds a core: decode collapsed 17x on a 2-core VM beside one busy process with libgomp's
# default spin (300,000 iterations before sleeping). Sleeping at once (OMP_WAIT_POLICY=PASSIVE)
# keeps the speed under a hog but costs 24-44% on a quiet machine (every parallel region then
# wakes threads through the kernel). A short spin is the measured middle: GOMP_SPINCOUNT=1000
# kept 42-51% of the quiet speed beside a hog and cost 7-10% quiet (benchmarks/contention.py,
# docs/PERF.md). libgomp reads it when torch is first imported, so it is set here, before
# anything imports torch; a value the user set for either variable wins.
SPIN_COUNT = "1000"
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT

__version__ = "0.1.0"
