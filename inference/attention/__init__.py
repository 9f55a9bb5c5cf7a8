"""Paged attention: the step's metadata, the torch reference and the backends."""
