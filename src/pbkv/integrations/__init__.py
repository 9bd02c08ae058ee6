"""Plug-ins that put pbkv's cache policies inside other serving engines (`vllm`)."""
