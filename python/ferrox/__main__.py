import sys

from ferrox.cli import main

sys.exit(main())
