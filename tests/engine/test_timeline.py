"""The timeline: a chunk's waits in the first chunk of a phase are the bubble, later ones are waits, the
rest is compute; the GPipe bubble formula; Chrome trace events per rank. (The strategy's logging and
trace file: ``tests/strategies/test_gnnpipe.py``.)"""
import pytest

from pyg_pipe.engine.runtime.timeline import Timeline, bubble_share


class _Waits:
    waited = 0.0


def test_first_chunk_waits_are_the_bubble_later_ones_are_waits():
    comm = _Waits()
    tl = Timeline(comm, on=True, keep=True)
    for phase in ("fill", "drain"):
        for i, chunk in enumerate((2, 0, 1)):
            with tl.chunk(phase, chunk, first=i == 0):
                comm.waited += 0.5 if i == 0 else 0.25
    tl.end_step()
    (step,) = tl.take()
    assert step["bubble"] == pytest.approx(2 * 0.5) and step["wait"] == pytest.approx(4 * 0.25)
    assert tl.take() == [] and tl.step == 1
    events = tl.chrome_events(rank=3)
    assert {e["pid"] for e in events} == {3}
    assert sorted(e["name"] for e in events if e["tid"] == 0) == sorted(
        f"{p} c{c}" for p in ("fill", "drain") for c in (0, 1, 2))
    assert sorted(e["name"] for e in events if e["tid"] == 1) == ["bubble"] * 2 + ["wait"] * 4


def test_off_records_nothing():
    tl = Timeline(_Waits(), on=False)
    with tl.chunk("fill", 0, True):
        pass
    tl.end_step()
    assert tl.take() == []


def test_the_bubble_formula():
    assert bubble_share(1, 8) == 0
    assert bubble_share(2, 8) == pytest.approx(1 / 9)
    assert bubble_share(4, 16) == pytest.approx(3 / 19)
