"""Paying workers their earnings over Lightning (``runner``, ``lightning``)."""
