"""`python -m sglang_dflash.train`: the training command line (`cli.py`)."""

import sys

from sglang_dflash.train.cli import main

sys.exit(main())
