"""Shared parts of the serving scripts: statistics, HTTP client, prompts, server launcher, reports."""
