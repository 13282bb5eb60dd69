"""The exit codes the trainer process (`python -m trainer`, and the rank launcher for several ranks) ends with,
which the daemon reads to decide between stopping and restarting, and passes on as its own. Here, torch-free, so
that both sides import the one definition (the daemon may import nothing else of trainer/)."""

EXIT_OK = 0
"""Done, or stopped on request after a checkpoint."""
EXIT_USAGE = 2
"""A problem the user can fix in the config, the data or the models, reported as ERROR lines: no restart (a
restart would find it again)."""
EXIT_OUT_OF_MEMORY = 12
"""ENOMEM's number: out of device memory, not recovered by the trainer's own relief (offloading more, splitting
micro-batches). The daemon counts the restart as an "oom" one."""
