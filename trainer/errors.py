"""The base class of the errors a user can fix: a leaf module (it imports nothing of the project), so that any
module may derive its errors from it without pulling the rest of the trainer in.

Each module keeps its own error types (CheckpointError in trainer/checkpoint.py, DataError in trainer/data, ...);
`except UserError` in trainer/main.py turns every one of them into one ERROR line and exit code 2.
"""


class UserError(Exception):
    """A problem the user can fix from the config, the data or the models: reported as one line, exit code 2."""


class RunSetupError(UserError):
    """The run cannot start as configured; the message names the setting to change."""
