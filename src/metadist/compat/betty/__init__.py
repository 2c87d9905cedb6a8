"""Betty's API on metadist: ``from betty.X import Y`` becomes
``from metadist.compat.betty.X import Y`` and nothing else changes.

The modules mirror Betty's (``engine``, ``configs``, ``problems``, ``envs``, ``logging``);
names, signatures, defaults and semantics are Betty's, computed by metadist's own Problem and
Engine, so every Betty strategy name runs exactly at any world size. Where Betty's meaning
cannot be kept, construction raises and says what to write instead. docs/meta-learning.md
("Coming from Betty") lists the differences that remain.
"""

__version__ = "0.2.1"
