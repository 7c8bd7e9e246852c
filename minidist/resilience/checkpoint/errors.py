"""What a checkpoint that cannot be used raises, and the warning for one that was skipped."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: corrupt, incomplete, or made for another model."""


class CheckpointWarning(UserWarning):
    """A damaged or foreign checkpoint was skipped; an older one (or none) is used."""
