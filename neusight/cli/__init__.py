"""Hydra command-line apps; the only place NeuSightError is caught (one line on stderr, exit code 2)."""
