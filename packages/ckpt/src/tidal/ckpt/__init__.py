"""tidal.ckpt."""
