"""`python -m omni_runtime.cli` is `omni-runtime`."""

import sys

from omni_runtime.cli import main

sys.exit(main())
