"""A tensor-parallel worker process, started by the engine (rank 0):

python -m ferrox.executor.worker RANK WORLD_SIZE INIT_METHOD   # engine options as JSON on stdin
"""

from __future__ import annotations

import json
import sys

from ferrox.executor.tensor_parallel import worker_main


def main() -> None:
    rank, size, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    worker_main(rank, size, init, json.loads(sys.stdin.read()))


if __name__ == "__main__":
    main()
