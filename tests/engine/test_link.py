"""The stage link (:class:`pyg_pipe.engine.runtime.link.StageLink`): values crossing a pipeline cut arrive per chunk
with their structure (a tensor, a tuple with ``None`` in it, a list, an LSTM-like ``(1, rows, d)`` state),
the structure and shapes are told once (later steps send raw tensors only), a value that changes shape or is
not a tensor is refused naming it, and gradients come back only for the tensors the receiving stage
back-propagated into, so the sending stage back-propagates exactly what one process would.

Stage 0 (rank 0) and stage 1 (rank 1) on real gloo processes; the Comm records which sends carried headers.
"""
import pytest
import torch
from torch import nn

from pyg_pipe import UnsupportedModelError
from pyg_pipe.engine import Comm
from pyg_pipe.engine.runtime.link import StageLink
from tests.dist import run_distributed

ROWS = {0: 5, 1: 3}           # rows per chunk
D = 4


class RecordingComm(Comm):
    """The real transport, remembering the category of every send (``None``: an uncounted header)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.categories = []
        self.objects = 0

    def send(self, tensor, dst, category="other"):
        self.categories.append(category)
        super().send(tensor, dst, category)

    def send_object(self, obj, dst):
        self.objects += 1
        super().send_object(obj, dst)


class Stage0(nn.Module):
    """What stage 0 computes for a chunk: every kind of value crossing the cut."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(1.5))
        self.b = nn.Parameter(torch.tensor(-0.5))
        self.c = nn.Parameter(torch.tensor(2.0))      # only in a value stage 1 does not use
        self.d = nn.Parameter(torch.tensor(0.25))     # likewise
        self.e = nn.Parameter(torch.tensor(0.75))

    def forward(self, x):
        rows = x.size(0)
        return {"h": self.a * x,                                               # the activation
                "pair": (torch.sin(self.b * x), None, self.c * x),
                "lst": [self.d * x[:, :2], torch.arange(rows)],                # a float and an integer leaf
                "state": (self.e * x).unsqueeze(0)}                            # (1, rows, d)


def stage1(v):
    """Stage 1 uses h, pair[0], the integer leaf and state, not pair[2] nor lst[0]."""
    h, (p0, none, _), (_, idx), s = v["h"], v["pair"], v["lst"], v["state"]
    assert none is None
    return (h * p0).sum() + (s[0] ** 2)[idx.flip(0)].mul(torch.linspace(0, 1, h.size(0)).view(-1, 1)).sum()


def inputs(step, chunk):
    g = torch.Generator().manual_seed(10 * step + chunk)
    return torch.randn(ROWS[chunk], D, generator=g)


def _nbytes(*ts):
    return sum(t.numel() * t.element_size() for t in ts)


def _worker(rank, world):
    torch.set_default_dtype(torch.float64)
    comm = RecordingComm(torch.device("cpu"), timeout=60)
    link = StageLink(comm, prev=None if rank == 0 else 0, next=1 if rank == 0 else None)
    model = Stage0()
    ref = Stage0()
    names = ["h", "pair", "lst", "state"]
    for step in range(2):
        comm.categories, comm.objects = [], 0
        comm.reset_counters()
        comm.counting = True
        if rank == 0:
            sent = {}
            for chunk in (0, 1):                                             # fill
                sent[chunk] = model(inputs(step, chunk))
                link.send(chunk, sent[chunk], activation="h")
            comm.flush()
            headers = comm.objects
            link.expect_grads(sent[1])                                       # drain, chunks in reverse
            model.zero_grad(set_to_none=True)
            for chunk in (1, 0):
                roots, grads = link.recv_grads(chunk, sent[chunk])
                assert len(roots) == 3, f"gradients for h, pair[0] and state only, got {len(roots)}"
                torch.autograd.backward(roots, grads)
            comm.flush()
            # one process: stage 1 applied directly to stage 0's values
            ref.zero_grad(set_to_none=True)
            for chunk in (0, 1):
                stage1(ref(inputs(step, chunk))).backward()
            for name, p in model.named_parameters():
                q = dict(ref.named_parameters())[name]
                if q.grad is None:
                    assert p.grad is None, f"step {step}: {name} got a gradient stage 1 never sent"
                else:
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=f"step {step}: {name}")
            assert model.c.grad is None and model.d.grad is None and model.a.grad is not None
            floats = [_nbytes(v["h"]) for v in sent.values()]
            others = [_nbytes(v["pair"][0], v["pair"][2], *v["lst"], v["state"]) for v in sent.values()]
            assert comm.bytes["stage_activations"] == sum(floats), dict(comm.bytes)
            assert comm.bytes["carried"] == sum(others), dict(comm.bytes)
            assert comm.bytes["stage_gradients"] == 0
        else:
            received = {}
            losses = []
            for chunk in (0, 1):
                received[chunk] = link.recv(chunk, names, requires_grad=True)
                v = received[chunk]
                assert v["pair"][1] is None and isinstance(v["pair"], tuple) and isinstance(v["lst"], list)
                assert v["state"].shape == (1, ROWS[chunk], D) and v["lst"][1].dtype == torch.long
                assert not v["lst"][1].requires_grad and v["h"].requires_grad
                want = ref(inputs(step, chunk))
                for got_leaf, want_leaf in [(v["h"], want["h"]), (v["pair"][0], want["pair"][0]),
                                            (v["pair"][2], want["pair"][2]), (v["lst"][0], want["lst"][0]),
                                            (v["lst"][1], want["lst"][1]), (v["state"], want["state"])]:
                    torch.testing.assert_close(got_leaf, want_leaf.detach(), rtol=0, atol=0, msg=f"chunk {chunk}")
                losses.append(stage1(v))
            headers = 0
            for i, chunk in enumerate((1, 0)):
                losses[chunk].backward()
                link.send_grads(chunk, received[chunk], "h", first=i == 0)
            comm.flush()
            assert received[0]["pair"][2].grad is None and received[0]["lst"][0].grad is None
            used = [_nbytes(v["pair"][0], v["state"]) for v in received.values()]
            assert comm.bytes["stage_gradients"] == _nbytes(received[0]["h"], received[1]["h"]), dict(comm.bytes)
            assert comm.bytes["carried"] == sum(used), dict(comm.bytes)
            assert comm.bytes["stage_activations"] == 0
        comm.counting = False
        told = comm.categories.count(None)
        if step == 0:
            assert rank == 1 or headers == 2 * len(names), f"structure told once per chunk and value: {headers}"
        else:
            # rank 0 sends only raw tensors; rank 1 only the has-gradient mask, once per step
            assert (headers, told) == (0, 0 if rank == 0 else 1), (rank, headers, comm.categories)

    if rank == 0:
        comm.categories, comm.objects = [], 0   # refused on the sender, before anything is sent
        with pytest.raises(UnsupportedModelError, match=r"Value 'state' crossing the pipeline cut changed shape "
                                                        r"between steps \(\[\(\(1, 5, 4\), torch.float64\)\] -> "
                                                        r"\[\(\(1, 6, 4\)"):
            link.send(0, {"state": torch.zeros(1, ROWS[0] + 1, D)}, "h")
        with pytest.raises(UnsupportedModelError, match=r"Value 'meta' crosses a pipeline cut but holds a int.*"
                                                        r"pass it as a tensor"):
            link.send(2, {"meta": (torch.ones(2), 3)}, "h")
        with pytest.raises(UnsupportedModelError, match=r"Value 'adj' crossing a pipeline cut is a sparse tensor"):
            link.send(3, {"adj": torch.eye(3).to_sparse()}, "h")
        assert comm.categories == [] and comm.objects == 0, "something was sent for a refused value"


def test_values_cross_the_cut_per_chunk_and_only_used_tensors_get_gradients():
    run_distributed(_worker, 2, timeout=120)
