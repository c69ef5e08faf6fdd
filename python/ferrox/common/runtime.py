"""Facts of this process fixed when ferrox is first imported (no torch).

`ferrox/__init__.py` imports this module before anything else, so the
OpenMP setting below is in place before any ferrox module imports torch.
"""

import os
import sys

__version__ = "0.1.0"

# GNU OpenMP workers otherwise spin for a long while after each torch op and
# steal the cores from the native kernels that run between ops. It only takes
# effect when ferrox is imported before torch; an explicit setting wins.
OPENMP_SPIN_LIMITED = "torch" not in sys.modules or "GOMP_SPINCOUNT" in os.environ
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
