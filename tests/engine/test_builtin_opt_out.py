"""SGLANG_DFLASH_IMPL=builtin hands DFLASH back to SGLang's own worker."""

import pytest

from sglang_dflash import plugin
from tests.support import engines


@pytest.mark.sglang
def test_builtin_opt_out_reaches_sglangs_own_dflash(tiny, monkeypatch):
    """With SGLANG_DFLASH_IMPL=builtin, SGLang's own DFLASH argument handling runs: on CPU it
    refuses the device, which our implementation accepts."""
    monkeypatch.setenv(plugin.IMPL_ENV, "builtin")
    with pytest.raises(
        ValueError, match="DFLASH speculative decoding is not supported by .* on device 'cpu'"
    ):
        engines.shutdown(engines.start(*tiny.pair("a"), 8))
