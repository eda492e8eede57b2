"""Parameters of CI's quick asv pass.

CI sets ``ATTNNB_ASV_SKIP_SLOW`` and runs every benchmark once
(``asv run --quick``), each parameter combination in a process of its own;
there the lists below keep one size each (dense and differential attention
float32 only, dense attention causal only), to stay within CI's time budget.
Recorded histories (``record_history.sh``) leave the variable unset and run
every parameter.
"""

import os

QUICK = bool(os.environ.get("ATTNNB_ASV_SKIP_SLOW"))


def choose(full, quick):
    """``quick`` in CI's quick pass, else ``full``."""
    return quick if QUICK else full
