"""`python -m qtts_cli ...`: what the `qtts-jax` script runs, for callers that start it from an interpreter."""

import sys

from qtts_cli.main import main

sys.exit(main())
