"""tidal.train."""
