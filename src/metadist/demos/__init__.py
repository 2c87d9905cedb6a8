"""Runnable demos shipped with the package (``metadist demo``)."""
