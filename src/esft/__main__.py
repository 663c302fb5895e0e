"""`python -m esft ...`: the same as the `esft` command."""

import sys

from esft.cli import main

sys.exit(main())
