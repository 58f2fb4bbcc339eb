"""The test harness's distributed runner: a failure reported by the rank that caused it."""
import time

import pytest
import torch.multiprocessing as mp

from tests.dist import run_distributed


def _lost_peer_first(rank, world):
    if rank == 0:  # exits first, with what a rank whose peer went away raises
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")
    time.sleep(0.2)
    raise ValueError("the cause, on rank 1")


def _lost_peer_only(rank, world):
    if rank == 0:
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")


def test_the_rank_that_failed_in_substance_is_reported_over_one_that_lost_its_peer():
    with pytest.raises(mp.ProcessRaisedException, match=r"(?s)Process 1 terminated.*process 0 exited first.*the cause"):
        run_distributed(_lost_peer_first, 2, timeout=60)


def test_a_lost_peer_alone_is_reported_as_it_is():
    with pytest.raises(mp.ProcessRaisedException, match="Connection closed by peer"):
        run_distributed(_lost_peer_only, 2, timeout=60)
