"""slabnet's pytest plugin (placeholder; see below)."""
