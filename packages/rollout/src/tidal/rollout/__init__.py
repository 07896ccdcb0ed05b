"""tidal.rollout."""
