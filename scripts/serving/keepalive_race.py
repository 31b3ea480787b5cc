"""Shows the client-side keep-alive race behind `ClientOSError: Can not write request body`.

    python scripts/serving/keepalive_race.py [--trials 10]

Starts the shipped tiny pair's DFLASH server (CPU), then, per trial and for two aiohttp clients,
sends one request, leaves its connection idle until just before the server's keep-alive
(`SGLANG_TIMEOUT_KEEP_ALIVE`, 5 s) runs out, blocks the client's event loop across that moment
(as a busy machine does), and sends the next request:

* aiohttp's default connector keeps idle connections for 15 s, so it reuses the connection
  the server has closed meanwhile, and the POST fails: `ServerDisconnectedError` when the close
  is seen after the request is written (these short requests), `ClientOSError: Can not write
  request body` when it is seen between the headers and the body (the soak's long prompts);
* `lib.client.connector()` opens a new connection per request, so every request succeeds.

Prints the failures of each client; the exit code is 0 when the default one fails at least once
and ours never does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

import aiohttp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from scripts.serving.lib import client, server  # noqa: E402

SERVER_KEEP_ALIVE = float(os.environ.get("SGLANG_TIMEOUT_KEEP_ALIVE", "5"))
PAYLOAD = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


async def trial(url: str, make_connector) -> str:
    """'ok', or the error of the request sent after the server's keep-alive ran out."""
    async with aiohttp.ClientSession(connector=make_connector()) as session:
        async with session.post(url + "/generate", json=PAYLOAD) as response:
            await response.read()
        await asyncio.sleep(SERVER_KEEP_ALIVE - 0.3)
        time.sleep(0.6)  # the loop is busy while the server closes the idle connection
        try:
            async with session.post(url + "/generate", json=PAYLOAD) as response:
                await response.read()
            return "ok"
        except aiohttp.ClientError as error:
            return repr(error)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args(argv)
    target, draft = server.default_models()
    config = server.ServerConfig("dflash", target, draft, None, "cpu", [], {})
    log = os.path.join(tempfile.mkdtemp(prefix="dflash-keepalive-"), "server.log")
    failures = {
        "aiohttp default (keep-alive, 15 s idle)": 0,
        "client.connector() (a connection per request)": 0,
    }
    with server.ServerProcess(config, log) as proc:
        for k in range(args.trials):
            for name, make in zip(failures, (lambda: aiohttp.TCPConnector(limit=0), client.connector)):
                outcome = asyncio.run(trial(proc.url, make))
                failures[name] += outcome != "ok"
                print(f"trial {k + 1}: {name}: {outcome}", flush=True)
    for name, count in failures.items():
        print(f"{name}: {count}/{args.trials} failed")
    default, ours = failures.values()
    return 0 if default > 0 and ours == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
