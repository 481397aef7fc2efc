"""The one exception type for a run that cannot start as configured.

Why: a bad flag, a missing checkpoint or a corrupt data file is the user's to fix, not a bug;
the entry point prints its message once (rank 0), without a traceback from every rank, and exits
with status 1.  Every rank raises it (the checks are deterministic), so no rank is left waiting
in a collective for a peer that exited.
"""


class StartupError(RuntimeError):
    """The run cannot start: the message names the flag or file and what to do."""
