"""Episode loops: the student plays environments and yields trajectories."""
