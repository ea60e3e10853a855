"""The one error type of the checkpoint package."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (invalid, incompatible, or none found); the message says why."""
