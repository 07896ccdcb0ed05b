"""tidal.actor."""
