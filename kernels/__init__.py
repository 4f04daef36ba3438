"""Attention and matmul kernels (Triton) beside their pure-PyTorch twins (`reference.py`).

Also the one limit the kernels and the engine share: a speculative round drafts at most
MAX_DRAFTS tokens, and its verify feeds them after the pending token, so a decode or verify
step hands the few-row kernels at most MAX_STEP_ROWS rows. Python imports both from here; the
C++ receives MAX_STEP_ROWS from its build (`cpu/build.py`: QSPEC_MAX_STEP_ROWS, kernels.h's
kMaxStepRows), so the two languages cannot disagree.
"""

MAX_DRAFTS = 16
MAX_STEP_ROWS = MAX_DRAFTS + 1
