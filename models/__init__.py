"""Model code both worker roles import: checkpoints, preprocessing, towers and LMs."""
