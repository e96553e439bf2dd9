"""Ray's private names the project relies on (filled below)."""
