"""Runnable scripts (demo, load test, step benchmark, soak); `benchlib` holds their shared parts."""
