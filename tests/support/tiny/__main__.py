"""`python -m tests.support.tiny OUT`: target "a"'s defaults (`make_target`) and a draft
(`make_draft`) under OUT."""

import os
import sys

from tests.support.tiny import make_draft, make_target

if __name__ == "__main__":
    out = sys.argv[1]
    make_target(os.path.join(out, "target"))
    make_draft(os.path.join(out, "draft"))
    print(out)
