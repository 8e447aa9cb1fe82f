"""What a run keeps on disk: every file written whole or appended, and checkpoint files."""
