"""`python -m dflash` runs the command line."""

import sys

from dflash.cli import main

sys.exit(main())
