"""``pyg_pipe.memory.PeakMemory``: a process's peak over a stretch of work, net of what it held at the start."""
import torch

from pyg_pipe.memory import PeakMemory


def test_the_peak_counts_what_was_allocated_since_the_start_and_not_before():
    held = torch.ones(10_000_000)                # 40 MB held before: not counted
    meter = PeakMemory().start()
    t = torch.ones(25_000_000)                   # 100 MB touched, then freed
    del t
    peak = meter.net_bytes()
    assert 80e6 < peak < 160e6, peak
    again = PeakMemory().start()
    if again.exact:                              # (where the kernel lets the mark be reset)
        assert again.net_bytes() < 20e6          # a new start forgets the earlier peak
    del held
