"""scripts/bench/window_ring.py: a short run (no engine), its rows and plot."""

import json
import sys

from scripts.bench import window_ring as bench


def test_a_short_run_keeps_the_ring_flat_and_writes_its_rows_and_plot(tmp_path, monkeypatch):
    out, png = tmp_path / "rows.json", tmp_path / "ring.png"
    argv = ["window_ring.py", "--window", "32", "--contexts", "64,256", "--iters", "1"]
    monkeypatch.setattr(sys, "argv", argv + ["--json", str(out), "--plot", str(png)])
    bench.main()
    rows = json.loads(out.read_text())["rows"]
    assert [r["context"] for r in rows] == [64, 256]
    # 2 layers x K and V x 2 KV heads x 64 x 4 B = 2 KiB a row: 40 rows in the ring (window 32 +
    # block 8), one a token for every token.
    assert [r["ring_kv_mib"] for r in rows] == [40 * 2048 / 2**20] * 2
    assert [r["every_token_kv_mib"] for r in rows] == [64 * 2048 / 2**20, 256 * 2048 / 2**20]
    assert png.stat().st_size > 0
