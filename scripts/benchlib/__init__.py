"""Shared pieces of the benchmark scripts: statistics, HTTP client, prompts, server launcher, reports."""
