"""Helpers of the command-line tools (``bench``, ``check``, ``warmup``)."""
