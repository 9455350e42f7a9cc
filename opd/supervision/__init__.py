"""Teacher supervision: the teacher's view of each turn and its scores of the student's tokens."""
