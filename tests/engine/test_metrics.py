"""The server's Prometheus metrics against the requests it served."""

import time

import pytest


@pytest.mark.sglang
def test_server_metrics_match_requests(tiny, tmp_path):
    """The /metrics window around a batch of requests equals what their meta_info reports."""
    import requests

    from scripts.serving.lib import server
    from tests.support import engines

    target, draft = tiny.pair("a")
    extra = ["--max-total-tokens", "6144", "--enable-metrics", "--log-level", "warning"]
    # Fixed acceptance (3 tokens a step) exercises several positions, and makes steps overshoot
    # max_new_tokens, so overlap scheduling runs steps for requests already finished.
    env = {"SGLANG_SIMULATE_ACC_LEN": "3"}
    config = server.ServerConfig("dflash-fixed", target, draft, 8, "cpu", extra, env)
    with server.ServerProcess(config, str(tmp_path / "server.log")) as proc:
        time.sleep(2.0)  # start-up health checks decode too; let them be published first
        before = server.dflash_counters(server.prometheus_samples(proc.url))
        sampling = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
        body = {"input_ids": engines.prompts(6, seed=5), "sampling_params": sampling}
        metas = [o["meta_info"] for o in requests.post(proc.url + "/generate", json=body, timeout=300).json()]
        time.sleep(2.0)  # published once a second
        after = server.dflash_counters(server.prometheus_samples(proc.url))
        text = requests.get(proc.url + "/metrics", timeout=30).text

    window = server.dflash_window(before, after)
    steps = sum(m["spec_verify_ct"] for m in metas)
    assert window["verify_steps"] == steps > 0
    assert 0 <= window["discarded_steps"] <= len(metas)  # at most one extra step per request
    accepted = sum(m.get("spec_num_correct_drafts", 0) for m in metas)
    assert after["accepted_drafts"] - before["accepted_drafts"] == accepted
    hist = {}
    for meta in metas:
        for k, count in enumerate(meta["spec_correct_drafts_histogram"]):
            hist[k + 1] = hist.get(k + 1, 0) + count
    assert window["accept_length_histogram"] == {k: c for k, c in hist.items() if c} == {3: steps}
    for k in range(1, 8):  # position k accepted in a step iff the step accepted >= k drafts
        at_least_k = sum(c for length, c in hist.items() if length - 1 >= k)
        assert window["position_accept_rate"][k] == pytest.approx(at_least_k / steps)
    assert set(window["verify_width_histogram"]) == {8}  # the fixed width, every decode step
    labelled = [line for line in text.splitlines() if line.startswith("sglang:dflash_verify_steps_total{")]
    assert labelled and all('model_name="' in line and 'tp_rank="0"' in line for line in labelled)
