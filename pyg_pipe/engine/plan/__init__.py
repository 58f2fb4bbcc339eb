"""The plan: what is decided once for a graph and a model, agreed by every rank and saved in checkpoints.

``plan.py``       the immutable :class:`~.plan.Plan` (grid, chunks, stage split, parameter owners), how it is
                  decided, and the structural refusals
``norms.py``      graph-wide norms with several chunks per way: historical statistics, per chunk, or refused
``grid.py``       the rank grid: rank ``s·W + w`` runs stage ``s`` for way ``w``
``schedule.py``   the clock table, and the one definition of fresh / stale reads (T1, T3)
``formulas.py``   the bytes each mode should send (the tests hold the transport's counts against them)
"""
