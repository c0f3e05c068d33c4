"""One exception type for bad input: the CLI prints its message as one line and exits non-zero."""


class EngineError(Exception):
    """A problem with the user's input (paths, configs, weights, arguments), not a bug in the engine."""
