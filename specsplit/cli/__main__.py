"""python -m specsplit.cli: the `specsplit` command."""

import sys

from specsplit.cli.main import main

sys.exit(main())
