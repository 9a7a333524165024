"""``python -m bench``: the benchmark suite (see bench/suite.py)."""

import sys

from bench.suite import main

sys.exit(main())
