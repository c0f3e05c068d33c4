"""specbook: runbooks, recorded baselines and the `runbook` command."""


class SpecbookError(Exception):
    """Bad input: reported as one line, exit code 2."""

    exit_code = 2


class RunFailed(SpecbookError):
    """A runbook could not run here or raised: reported as one line, exit code 3."""

    exit_code = 3


class Terminated(KeyboardInterrupt):
    """SIGTERM: unwinds as Ctrl-C does (a run's kernel and its directory are cleaned up on the way), exit 143."""


from specbook.record import record  # noqa: E402  (after the errors it may need)

__all__ = ["SpecbookError", "RunFailed", "Terminated", "record"]
