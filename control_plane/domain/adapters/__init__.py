"""The adapter registry: versions, the version pin, and the desired placements on engines."""
