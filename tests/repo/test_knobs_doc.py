"""docs/knobs.md is the registry of environment variables (`sglang_dflash/knobs.py`), rendered."""

from sglang_dflash import knobs
from tests.support import paths


def test_the_committed_knobs_doc_is_the_generated_one():
    committed = (paths.REPO / "docs" / "knobs.md").read_text(encoding="utf-8")
    stale = "docs/knobs.md is stale: python -m sglang_dflash.knobs > docs/knobs.md"
    assert committed == knobs.markdown(), stale
