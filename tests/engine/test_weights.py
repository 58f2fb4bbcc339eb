"""Weight gradients across ranks (:mod:`pyg_pipe.engine.runtime.weights`): what the drains produce inside
:meth:`GradientSum.collecting` is summed over the ranks that computed parts of it, once per backward pass,
while what the same backward accumulates outside (a regulariser computed alike on every rank) is not; and
:func:`sync_module_state` gives every rank the owner stage's copy of every parameter and buffer.

Real gloo processes: one launch of 2 ranks builds a 2-way grid (one stage; a stage's own parameters are
partial over its ways) and a 2-stage grid (a parameter used by both stages is partial over all ranks).
"""
import torch
from torch import nn

from pyg_pipe.engine import Comm
from pyg_pipe.engine.plan.grid import RankGrid
from pyg_pipe.engine.runtime.weights import GradientSum, sync_module_state
from tests.dist import run_distributed

CPU = torch.device("cpu")


def _data(rank, call=0):
    g = torch.Generator().manual_seed(100 * rank + call)
    return torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g)


def _part(model, rank, call=0):
    """What one rank's drain computes: the loss of its own rows."""
    x, y = _data(rank, call)
    return ((model(x) - y) ** 2).sum()


def _regulariser(model):
    return 0.1 * sum((p ** 2).sum() for p in model.parameters())


def _ways(rank, world):
    """2 ways of one stage: a stage's own parameters are summed over its ways."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    comm = Comm(CPU, timeout=60)
    grid = RankGrid(rank, world, 1, 2)
    grads = GradientSum(model, {}, grid, comm)
    assert grads.needed and grid.stage_group is not None

    # the model called twice in the step (two drains), a regulariser before and one after them
    _regulariser(model).backward()
    reg = [p.grad.clone() for p in model.parameters()]
    with grads.collecting():
        _part(model, rank, 0).backward()
    for r, p in zip(reg, model.parameters()):   # the drain's part is set aside until reduce()
        torch.testing.assert_close(p.grad, r, rtol=0, atol=0, msg="collecting() left its part in .grad")
    with grads.collecting():
        _part(model, rank, 1).backward()
    _regulariser(model).backward()
    comm.counting = True
    grads.reduce()
    comm.counting = False

    ref = nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    for r in range(world):
        for call in (0, 1):
            _part(ref, r, call).backward()
    _regulariser(ref).backward()
    _regulariser(ref).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6, msg=f"way {rank}: gradient of {name}")

    # summed once: one all-reduce of all 8 gradient values, counted as a ring all-reduce (2·(W-1)·n·b / W)
    assert comm.bytes["weight_allreduce"] == 8 * 4, dict(comm.bytes)
    # the parts are consumed: a second reduce adds nothing more
    before = [p.grad.clone() for p in model.parameters()]
    grads.reduce()
    for b, p in zip(before, model.parameters()):
        torch.testing.assert_close(p.grad, b, rtol=0, atol=0)
    return grid


def _own_parameter_one_way_used(rank, world):
    """A stage's own parameter that only way 0's drain reached this step (way 1's rows never use it)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    grads = GradientSum(model, {}, RankGrid(rank, world, 1, 2), Comm(CPU, timeout=60))
    with grads.collecting():
        if rank == 0:
            _part(model, 0).backward()
    grads.reduce()
    ref = nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    _part(ref, 0).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, f"way {rank}: {name} has no gradient, way 0 has one (the ways' copies diverge)"
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


class TwoStages(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.shared = nn.Linear(3, 3)     # used at both depths: stages {0, 1}
        self.last = nn.Linear(3, 2)
        self.spare = nn.Linear(3, 3)      # shared by plan, used by stage 0 only in this step

    def stage0(self, x):
        return self.spare(self.shared(self.first(x)).relu())

    def stage1(self, h):
        return self.last(self.shared(h).relu())


STAGES = {"first.weight": {0}, "first.bias": {0}, "shared.weight": {0, 1}, "shared.bias": {0, 1},
          "last.weight": {1}, "last.bias": {1}, "spare.weight": {0, 1}, "spare.bias": {0, 1}}


def _stages(rank, world):
    """2 stages, one way: a parameter used by both stages is summed over all ranks; a stage's own
    parameters (one way) are not touched."""
    torch.manual_seed(0)
    model = TwoStages()
    comm = Comm(CPU, timeout=60)
    grid = RankGrid(rank, world, 2, 1)
    grads = GradientSum(model, STAGES, grid, comm)
    assert grads.needed and grid.stage_group is None
    x, y = _data(0)
    h = model.stage0(x).detach().requires_grad_()  # what stage 1 would receive
    with grads.collecting():
        if rank == 0:
            model.stage0(x).sum().backward()      # stage 0's part (its output's gradient taken as ones)
        else:
            ((model.stage1(h) - y) ** 2).sum().backward()
    _regulariser(model).backward()                # outside: alike on both ranks, never summed
    grads.reduce()

    ref = TwoStages()
    ref.load_state_dict(model.state_dict())
    ref.stage0(x).sum().backward()
    ((ref.stage1(h.detach()) - y) ** 2).sum().backward()
    ref_grads = {n: q.grad for n, q in ref.named_parameters()}
    reg = {n: torch.autograd.grad(_regulariser(ref), q)[0] for n, q in ref.named_parameters()}
    alone = TwoStages()                            # this rank's part only
    alone.load_state_dict(model.state_dict())
    (alone.stage0(x).sum() if rank == 0 else ((alone.stage1(h.detach()) - y) ** 2).sum()).backward()
    for name, p in model.named_parameters():
        if len(STAGES[name]) > 1:      # shared: both stages' parts on both ranks (spare: stage 0's only)
            want = ref_grads[name] + reg[name]
        elif STAGES[name] == {rank}:   # this stage's own (one way): its own part, not summed over stages
            want = dict(alone.named_parameters())[name].grad + reg[name]
        else:                          # the other stage's own: only the regulariser reached it here
            want = reg[name]
        torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=1e-6, msg=f"rank {rank}: gradient of {name}")
    return grid


def _shared_parameter_no_rank_used(rank, world):
    """A parameter both stages use by plan, which no drain reached this step (a branch not taken)."""
    model = TwoStages()
    grads = GradientSum(model, STAGES, RankGrid(rank, world, 2, 1), Comm(CPU, timeout=60))
    with grads.collecting():
        x, _ = _data(rank)
        model.last(model.first(x)).sum().backward()     # neither shared nor spare
    grads.reduce()
    for name in ("shared.weight", "spare.bias"):
        p = dict(model.named_parameters())[name]
        assert p.grad is None, f"rank {rank}: {name} got a gradient of zeros; one process leaves it None"


def _sync(rank, world, grid):
    """sync_module_state: every parameter and buffer from its owner stage's rank, on every rank."""
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with torch.no_grad():
        for i, t in enumerate(list(model.parameters()) + list(model.buffers())):
            t.fill_(10 * (rank + 1) + i)
    owners = {"0.weight": 1, "1.running_mean": 1, "1.num_batches_tracked": 1}   # the rest: stage 0
    sync_module_state(model, owners, grid.owner_ranks, comm=Comm(CPU, timeout=60))
    named = dict(model.named_parameters())
    named.update(dict(model.named_buffers()))
    for i, name in enumerate(list(dict(model.named_parameters())) + list(dict(model.named_buffers()))):
        owner_rank = grid.owner_ranks[owners.get(name, 0)]
        want = torch.full_like(named[name], 10 * (owner_rank + 1) + i)
        torch.testing.assert_close(named[name], want, rtol=0, atol=0, msg=f"rank {rank}: {name}")
    assert named["1.num_batches_tracked"].dtype == torch.long


def _worker(rank, world):
    _ways(rank, world)
    grid = _stages(rank, world)
    assert grid.owner_ranks == [0, 1]
    _sync(rank, world, grid)


def test_partial_gradients_are_summed_once_over_their_ranks_and_the_model_gathered_from_its_owners():
    run_distributed(_worker, 2, timeout=120)


def test_an_own_parameter_only_one_way_used_gets_the_sum_on_every_way():
    run_distributed(_own_parameter_one_way_used, 2, timeout=60)


def test_a_shared_parameter_no_rank_used_keeps_no_gradient():
    run_distributed(_shared_parameter_no_rank_used, 2, timeout=60)


def test_a_single_rank_needs_no_sum():
    """1 x 1 grid: nothing is partial; collecting() and reduce() leave the gradients as autograd made them."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    grads = GradientSum(model, {"weight": {0}, "bias": {0}}, RankGrid(0, 1, 1, 1), Comm(CPU))
    assert not grads.needed
    with grads.collecting():
        _part(model, 0).backward()
    grads.reduce()
    ref = nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    _part(ref, 0).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
