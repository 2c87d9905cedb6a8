"""Who am I, how was I launched, start and stop the process group.

Import the public names from :mod:`metadist`; the submodules here are ``env`` (launcher
detection), ``world`` (init/shutdown/World), ``spawn`` (launch), ``ranks`` (rank helpers) and
``resident`` (the allocator setting applied at import).
"""
