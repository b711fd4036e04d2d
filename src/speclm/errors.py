"""User-facing errors.

Anything a user can cause by a bad argument, a bad path or a bad file raises :class:`SpeclmError`
with a one-line message naming the problem. The CLI prints it and exits with status 2; library
callers can catch it. Everything else is a bug and is allowed to raise normally.
"""


class SpeclmError(ValueError):
    """A problem with the user's input (argument, path, file or model), described in one line."""


class CacheContractError(RuntimeError):
    """A KV cache was asked to do something inconsistent with what it holds (an engine bug)."""
