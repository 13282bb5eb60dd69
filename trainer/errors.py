"""The errors a user can fix from the config or the data: reported as one line, exit code 2."""

from trainer.checkpoint import CheckpointError
from trainer.data import DataError
from trainer.models import ModelLoadError
from trainer.offload.engine import WorkerThreadsError
from trainer.rewards import CustomRewardError, UnknownDataSource
from trainer.rollout.prompts import PromptTooLong


class RunSetupError(Exception):
    """The run cannot start as configured; the message names the setting to change."""


USER_ERRORS = (CheckpointError, DataError, ModelLoadError, CustomRewardError, UnknownDataSource, PromptTooLong,
               RunSetupError, WorkerThreadsError)
