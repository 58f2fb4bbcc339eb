"""The runtime: what one rank runs a plan with, built at once from it and living as long as it.

``runtime.py``     :class:`~.runtime.Runtime`, built in one constructor from the plan
``program.py``     what a stage runs: the user's forward, or its part of the traced program
``history.py``     historical rows per call of the model and call site, T2 snapshots, pending gradients
``pending.py``     pending gradients of fresh reads, kept as the rows read until their owners' backward
``tiers.py``       where buffers' bytes sit: the device, host memory or memory-mapped files
``store.py``       streaming: the values between layer groups
``halo.py``        halo rows at a call site: exchange among ways, history reads, gradient routes
``ring.py``        the ring halo exchange (``halo_exchange="ring"``)
``link.py``        values crossing a stage cut per chunk, and their gradients
``weights.py``     weight gradients summed once per backward pass; the model gathered from its stages
``statistics.py``  graph-wide statistics of a run, and the historical sums of every chunk
``sites.py``       the call sites each stage meets, agreed among ways, checked on resume
``staleness.py``   the staleness meter
``timeline.py``    where a stage's time goes: compute, waits, the bubble
"""
