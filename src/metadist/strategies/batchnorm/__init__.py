"""BatchNorm on several ranks: which statistics a layer normalises with (``statistics.py``),
the synchronised layer (``sync.py``), the decision at every ``F.batch_norm`` call of a
set-up model (``calls.py``), and each rank's running-statistics updates combined at the
step (``running_stats.py``).
"""
