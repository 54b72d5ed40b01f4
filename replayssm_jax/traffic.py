"""Memory-traffic model (placeholder, filled below)."""
