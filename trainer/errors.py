"""The base class of the errors a user can fix: a leaf module (it imports nothing of the project), so that any
module may derive its errors from it without pulling the rest of the trainer in.

Each module keeps its own error types (CheckpointError in trainer/checkpoint.py, DataError in trainer/data, ...);
`except UserError` in trainer/main.py turns every one of them into one ERROR line and exit code 2.
"""


class UserError(Exception):
    """A problem the user can fix from the config, the data or the models: reported as one line, exit code 2."""

    rank_local = False
    """True for an error one rank can meet alone while it trains (a user's reward function that raises or hangs on
    that rank's share of the responses): with several ranks that rank prints its line, since rank 0, which prints
    the errors every rank finds, may be waiting for it and know nothing."""


class RunSetupError(UserError):
    """The run cannot start as configured; the message names the setting to change."""
