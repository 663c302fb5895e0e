"""Engines hold the weights, perturb/restore/update them in place and generate text."""
