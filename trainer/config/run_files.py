"""Names in a run directory that the trainer writes and the daemon's monitor reads: one definition, torch-free,
for both sides (the monitor may import nothing of trainer/ but trainer.config)."""

CHECKPOINTS_DIR = "checkpoints"
"""The checkpoint folder under the run directory (unless trainer.default_local_dir moves it)."""
LATEST_CHECKPOINT_FILE = "latest_checkpointed_iteration.txt"
"""In the checkpoint folder: the step of the newest complete checkpoint (verl's tracker file)."""
METRICS_FILE = "metrics.jsonl"
"""Under the run directory: one JSON line of verl-named metrics per step."""
