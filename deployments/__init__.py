"""How flows are deployed, and the local services launcher."""
