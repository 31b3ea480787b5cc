import sys

from sglang_dflash.train.cli import main

sys.exit(main())
