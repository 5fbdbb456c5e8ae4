"""Checking a running server: the OpenAI-compatible client and the smoke test."""
