"""Streaming (NGra) on one device: the model runs layer group by layer group over all chunks, so every read
is fresh and training equals one process at any learning rate, with the values between groups in a
memory tier. The conv zoo and the model shapes run in this mode in ``test_zoo.py`` / ``test_models.py``;
here: the replays of the backward reproduce the forward bit for bit (dropout), barrier sites (a propagate
of values computed inside a group), the byte budget, two calls per step, and the knob's decisions.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import APPNP, GAT, GCN, DeepGCNLayer, GCNConv, MessagePassing

from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from pyg_pipe.engine.step import stream
from pyg_pipe.engine.plan.shape import decide_shape
from pyg_pipe.model.inputs import CallInputs
from tests.harness import ranges
from tests.models import GCNIIStack, gcnii
from tests.zoo import zoo_graph


def _engine(model, device: str = "cpu", **cfg):
    cfg.setdefault("partition", ranges)
    cfg.setdefault("num_chunks", 4)
    return GNNPipeEngine(model, PipelineConfig(**cfg), Comm(torch.device(device)), num_stages=1)


class ResGCNPlus(nn.Module):
    """DeepGCNLayer ``res+``: the conv propagates ``act(norm(x))``, computed inside its group (a barrier)."""

    def __init__(self, layers=3, dropout=0.2, ckpt=False):
        super().__init__()
        self.enc = nn.Linear(8, 12)
        self.blocks = nn.ModuleList(DeepGCNLayer(GCNConv(12, 12), nn.LayerNorm(12), nn.ReLU(), block="res+",
                                                 dropout=dropout, ckpt_grad=ckpt) for _ in range(layers))
        self.out = nn.Linear(12, 3)

    def forward(self, x, edge_index):
        x = self.enc(x)
        for block in self.blocks:
            x = block(x, edge_index)
        return self.out(x)


class Hops(nn.Module):
    """APPNP's K hops in one module: every hop after the first reads rows computed inside the group."""

    def __init__(self, dropout=0.2):
        super().__init__()
        self.lin, self.prop, self.out = nn.Linear(8, 12), APPNP(K=3, alpha=0.1, dropout=dropout), nn.Linear(12, 3)

    def forward(self, x, edge_index):
        return self.out(self.prop(self.lin(x).relu(), edge_index))


#: with dropout (the random numbers of every pass and replay must agree)
RANDOM = {
    "GCN-dropout": lambda: GCN(8, 12, 3, 3, dropout=0.3),
    "GAT-attention-dropout": lambda: GAT(8, 12, 3, 3, heads=2, dropout=0.3),
    "GCNII-dropout": GCNIIStack,
    "ResGCN+": ResGCNPlus,
    "ResGCN+-checkpointed": lambda: ResGCNPlus(ckpt=True),
    "APPNP-hops": Hops,
}


def _loss(model, x, ei, y, mask, seed):
    torch.manual_seed(seed)
    out = model(x, ei)
    return F.cross_entropy(out[mask], y[mask]), out


@pytest.mark.parametrize("name", list(RANDOM))
def test_replays_reproduce_the_forward_and_gradients_match_finite_differences(name, monkeypatch):
    """With dropout one process cannot be matched draw for draw. Instead: every replay in the backward
    produces exactly the rows the forward stored, and the gradient equals finite differences of the
    streamed loss itself (a fixed seed fixes the masks; float64), for parameters of the first and the
    last layers, so every group's backward, barrier phases included, is on the path."""
    torch.set_default_dtype(torch.float64)
    try:
        x, g, y, mask = zoo_graph(sizes=(16, 40, 40))
        ei = g["edge_index"]
        torch.manual_seed(0)
        model = RANDOM[name]()
        engine = _engine(model)
        engine.install()
        checked = []
        roots = stream._roots

        def checking(record, group, rec, lg):
            produced = {k: v for k, v in rec.sent.items() if k not in record.received[group]}
            for key, value in produced.items():
                if key in record.store.rows:
                    assert torch.equal(value.detach(), record.store.rows[key][lg.start:lg.end]), (name, group, key)
                    checked.append(key)
            return roots(record, group, rec, lg)

        monkeypatch.setattr(stream, "_roots", checking)
        try:
            loss, _ = _loss(model, x, ei, y, mask, seed=1)
            loss.backward()
            assert engine.plan.streaming and (checked or len(engine.plan.sizes or ()) <= 1)
            params = list(model.parameters())
            eps = 1e-6
            with torch.no_grad():
                for p in (params[0], params[-1]):
                    for i in torch.randperm(p.numel(), generator=torch.Generator().manual_seed(2))[:3].tolist():
                        flat = p.view(-1)
                        keep = flat[i].item()
                        flat[i] = keep + eps
                        up = _loss(model, x, ei, y, mask, seed=1)[0].item()
                        flat[i] = keep - eps
                        down = _loss(model, x, ei, y, mask, seed=1)[0].item()
                        flat[i] = keep
                        numeric = (up - down) / (2 * eps)
                        got = 0.0 if p.grad is None else p.grad.view(-1)[i].item()
                        assert abs(numeric - got) < 1e-6, (name, numeric, got)
        finally:
            engine.uninstall()
    finally:
        torch.set_default_dtype(torch.float32)


#: without dropout, to compare with one process
EXACT = {"GCNII": lambda: gcnii(8, 12, 3, 4), "ResGCN+": lambda: ResGCNPlus(dropout=0.0),
         "APPNP-hops": lambda: Hops(dropout=0.0)}


@pytest.mark.parametrize("name,tier", [(n, "disk") for n in EXACT] + [("GCNII", "host")])
def test_training_equals_one_process_with_every_buffer_on_disk(name, tier):
    """Three Adam steps streamed with every buffer in a memory-mapped file (0 bytes on the device) give one
    process's outputs, losses and parameters; the store never kept a buffer on the device. The chunks' inputs
    were read ahead from the tier (prefetched while the chunk before ran)."""
    x, g, y, mask = zoo_graph(sizes=(16, 40, 40))
    ei = g["edge_index"]
    torch.manual_seed(0)
    model = EXACT[name]()
    ref = copy.deepcopy(model)
    engine = _engine(model, offload=tier, offload_budget=0)
    engine.install()
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=0.02), torch.optim.Adam(ref.parameters(), lr=0.02)
    try:
        for _ in range(3):
            loss, out = _loss(model, x, ei, y, mask, 0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ref_loss, ref_out = _loss(ref, x, ei, y, mask, 0)
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
            assert abs(loss.item() - ref_loss.item()) < 1e-6
            assert engine.runtime.tiers.on_device == 0 and (tier == "host" or engine.runtime.tiers._count > 0)
        if name != "APPNP-hops":  # (one layer group: its barrier site's rows are all it reads from the tier)
            assert sum(s.prefetched for s in engine.runtime.stores.values()) > 0
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, atol=1e-5, rtol=0)
        with torch.no_grad():
            torch.testing.assert_close(model(x, ei), ref(x, ei), atol=1e-5, rtol=0)
    finally:
        engine.uninstall()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", list(EXACT))
def test_gradients_kept_in_host_memory_give_the_device_sums_bit_for_bit(name, device):
    """With every buffer in host memory, the gradients of the values between layer groups are not summed on the
    host: each chunk's part is kept, and the owner's rows are summed on the device when read, in the order the parts
    came (ResGCN+ adds gradients by ids at its barrier sites too). Three Adam steps give every parameter bit for bit
    as with every buffer on the device. On a GPU the parts go to pinned host memory by DMA on the side stream and come
    back the same way (neither run captured as CUDA graphs, so that both make the same calls). On a GPU both runs use
    PyTorch's deterministic algorithms: CUDA's ``index_add_`` and PyG's scatter add with atomics in no fixed order, so
    without them the device run differs from itself (measured on an H100: two runs 3e-8 to 1.2e-7 apart, and bit for
    bit with them, host tier included: ``benchmarks/gpu/diagnose_tests.py``)."""
    runs = [three_steps(name, device, tier, deterministic=device == "cuda") for tier in (None, "host")]
    (params, summed, _), (params_host, summed_host, folds) = runs
    assert summed == 0 and (summed_host > 0 or name == "APPNP-hops")  # (one layer group: no value between groups)
    # GCNII's x0 gets a gradient part from every chunk in each of its 4 groups: summed into one buffer every 2
    assert folds > 0 or name != "GCNII"
    assert all(torch.equal(p, q) for p, q in zip(params, params_host))


def three_steps(name: str, device: str, tier, deterministic: bool = False):
    """Three Adam steps of ``EXACT[name]`` streamed in 4 chunks on ``device`` with every buffer between layer groups
    in ``tier`` (``None``: on the device), uncaptured, optionally under PyTorch's deterministic algorithms: the
    parameters after them, how many gradient reads the stores summed on the device, and how many times they summed
    kept parts into one buffer (``Store._fold``)."""
    x, g, y, mask = zoo_graph(sizes=(16, 40, 40))
    x, y, mask, ei = x.to(device), y.to(device), mask.to(device), g["edge_index"].to(device)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic or before, warn_only=True)
    torch.manual_seed(0)
    model = EXACT[name]().to(device)
    engine = _engine(model, device, offload=tier, offload_budget=0 if tier else None, cuda_graphs=False)
    engine.install()
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    try:
        for _ in range(3):
            loss, _ = _loss(model, x, ei, y, mask, 0)
            opt.zero_grad()
            loss.backward()
            opt.step()
        summed = sum(s.summed for s in engine.runtime.stores.values())
        folds = sum(s.folds for s in engine.runtime.stores.values())
    finally:
        engine.uninstall()
        torch.use_deterministic_algorithms(before)
    return [p.detach().clone() for p in model.parameters()], summed, folds


def test_a_budget_keeps_buffers_on_the_device_up_to_it():
    x, g, y, mask = zoo_graph(sizes=(16, 40, 40))
    ei = g["edge_index"]
    torch.manual_seed(0)
    model = gcnii(8, 12, 3, 4)
    budget = 3 * x.size(0) * 12 * 4   # three hidden values of every vertex
    engine = _engine(model, offload="disk", offload_budget=budget)
    engine.install()
    try:
        peak = 0
        for _ in range(2):
            out = model(x, ei)
            peak = max(peak, engine.runtime.tiers.on_device)
            F.cross_entropy(out[mask], y[mask]).backward()
            assert engine.runtime.tiers.on_device == 0   # everything freed at the end of the step
        assert 0 < peak <= budget and engine.runtime.tiers._count > 0
    finally:
        engine.uninstall()


def test_a_model_called_twice_per_step_streams_each_call():
    """An encoder run on the graph and on a corrupted copy (DGI-style) in one step."""
    x, g, y, mask = zoo_graph(sizes=(16, 40, 40))
    ei = g["edge_index"]
    torch.manual_seed(0)
    model = GCN(8, 12, 3, 3)
    ref = copy.deepcopy(model)
    engine = _engine(model)
    engine.install()
    try:
        perm = torch.randperm(x.size(0), generator=torch.Generator().manual_seed(3))
        for m, in [(model,), (ref,)]:
            a, b = m(x, ei), m(x[perm], ei)
            (F.cross_entropy(a[mask], y[mask]) + (b - a).pow(2).mean()).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=0)
        assert sorted(engine.runtime.stores) == [0, 1]
    finally:
        engine.uninstall()


def test_the_knob_decides_from_the_devices_and_refuses_several():
    assert PipelineConfig(num_chunks=4).streams(1)
    assert PipelineConfig(offload="disk").streams(1)
    assert not PipelineConfig().streams(1)                      # one chunk on one device: nothing to stream
    assert not PipelineConfig(num_chunks=4).streams(2)          # a pipeline
    assert not PipelineConfig(num_chunks=4, streaming=False).streams(1)
    with pytest.raises(ValueError, match="streaming="):
        PipelineConfig(streaming="yes").validate()
    x, g, _, _ = zoo_graph()
    inputs = CallInputs((x, g["edge_index"]), {})
    with pytest.raises(ValueError, match="streaming=True runs on one device"):
        decide_shape(GCN(8, 12, 3, 3), inputs, 2, None, None, 1, None, True)
    shape = decide_shape(GCN(8, 12, 3, 3), inputs, 1, None, None, 1, None, True)
    assert shape.streaming and len(shape.groups) == 3


def test_single_stage_history_stays_available_without_streaming():
    x, g, y, mask = zoo_graph()
    torch.manual_seed(0)
    model = GCN(8, 12, 3, 3)
    engine = _engine(model, streaming=False)
    engine.install()
    try:
        model(x, g["edge_index"]).sum().backward()
        assert not engine.plan.streaming and engine.runtime.history.of(0).initialised
    finally:
        engine.uninstall()


def test_a_new_tensor_of_the_same_graph_each_step_is_not_cut_again():
    """Lightning moves the batch to the device every step, so the model gets a new ``adj_t`` of the same graph
    each time: the chunks' local adjacencies cut from the first are kept (compared once per call), and a graph
    with other edge values is cut again. Both train as plain PyG does."""
    from torch_geometric.utils import to_torch_csr_tensor
    torch.set_default_dtype(torch.float64)
    try:
        x, g, y, mask = zoo_graph()
        n = x.size(0)
        ei, w = g["edge_index"], g["edge_weight"]

        def adj(weight):
            return to_torch_csr_tensor(ei.flip(0), weight, size=(n, n))
        torch.manual_seed(0)
        model = GCN(8, 12, num_layers=3, out_channels=3)
        ref = copy.deepcopy(model)
        engine = _engine(model)
        engine.install()
        cuts = []
        try:
            for weight in (w, w, w, w * 2):
                got = model(x, adj(weight.clone()))
                want = ref(x, adj(weight.clone()))
                torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
                cuts.append({k: v[2] for k, v in engine.runtime.adjacency.items() if isinstance(v, tuple)})
        finally:
            engine.uninstall()
        assert cuts[0] and all(cuts[1][k] is v and cuts[2][k] is v for k, v in cuts[0].items())
        assert all(cuts[3][k] is not v for k, v in cuts[0].items())
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("name", list(RANDOM))
def test_kept_activations_train_bit_for_bit_as_replays(name, monkeypatch):
    """``recompute=False`` keeps each chunk's activations from the forward to the backward (no replay; groups
    with barrier sites are still replayed), ``"auto"`` decides after the first step (here: keep, the graph is
    small): three steps with dropout give the same weights bit for bit as replaying (``True``), with fewer
    runs of the chunks."""
    x, g, y, mask = zoo_graph(sizes=(16, 40, 40))
    ei = g["edge_index"]
    torch.manual_seed(0)
    base = RANDOM[name]()
    weights, runs, keeps = {}, {}, {}
    for recompute in (True, False, "auto"):
        model = copy.deepcopy(base)
        engine = _engine(model, recompute=recompute)
        count = []
        run = stream._run
        monkeypatch.setattr(stream, "_run", lambda *a, **k: count.append(1) or run(*a, **k))
        engine.install()
        try:
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            for step in range(3):
                loss, _ = _loss(model, x, ei, y, mask, seed=step)
                opt.zero_grad()
                loss.backward()
                opt.step()
        finally:
            engine.uninstall()
            monkeypatch.setattr(stream, "_run", run)
        weights[recompute] = [p.detach().clone() for p in model.parameters()]
        runs[recompute], keeps[recompute] = len(count), engine.runtime.stream_keep
    assert keeps == {True: False, False: True, "auto": True}
    for other in (False, "auto"):
        assert all(torch.equal(a, b) for a, b in zip(weights[True], weights[other])), (name, other)
    assert runs[False] <= runs["auto"] <= runs[True]
    if not name.startswith(("ResGCN+", "APPNP")):  # (every group of those has a barrier site: all replayed)
        assert runs[False] < runs["auto"] < runs[True]


@pytest.mark.parametrize("name", ["GCNII", "GCN"])
def test_calls_that_propagate_their_inputs_compute_rows_only_after_their_first_chunk(name):
    """Streamed layers receive their inputs with true halo rows. A call whose propagates read exactly those inputs
    at edge sources (GCN2Conv) runs on the whole local graph on the first chunk only, which marks it; every other
    chunk, and from the second step every chunk, computes its rows only (the propagate's output has the chunk's
    rows, not its local vertices). A call that reads something it computed first (GCNConv's ``lin(x)``) keeps the
    whole local graph. Either way three Adam steps on ``adj_t`` equal one device (float64, a graph of three
    components, 4 chunks with halos)."""
    from torch_geometric.utils import to_torch_csr_tensor
    torch.set_default_dtype(torch.float64)
    try:
        x, g, y, mask = zoo_graph(sizes=(16, 40, 40))
        adj = to_torch_csr_tensor(g["edge_index"].flip(0), size=(x.size(0), x.size(0)))
        torch.manual_seed(0)
        model = gcnii(8, 12, 3, 4) if name == "GCNII" else GCN(8, 12, num_layers=3, out_channels=3, cached=True)
        ref = copy.deepcopy(model)
        sizes = []  # per step: the row counts the layers' propagates returned
        for conv in (m for m in model.modules() if isinstance(m, MessagePassing)):
            conv.register_propagate_forward_hook(lambda module, inputs, out: sizes[-1].add(out.size(0)))

        def train(m):
            opt, outs = torch.optim.Adam(m.parameters(), lr=0.02), []
            for _ in range(3):
                sizes.append(set())
                out = m(x, adj)
                F.cross_entropy(out[mask], y[mask]).backward()
                opt.step()
                opt.zero_grad()
                outs.append(out.detach())
            return outs
        engine = _engine(model)
        engine.install()
        try:
            streamed = train(model)
        finally:
            engine.uninstall()
        sizes, chunks = sizes[:3], engine.runtime.graph.chunks
        for a, b in zip(streamed, train(ref)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    finally:
        torch.set_default_dtype(torch.float32)
    rows, local = {lg.rows for lg in chunks}, {lg.num_local for lg in chunks}
    assert not rows & local  # (every chunk has a halo)
    if name == "GCNII":
        assert sizes[0] == rows | {chunks[0].num_local} and sizes[1] == sizes[2] == rows
    else:
        assert sizes[0] == sizes[1] == sizes[2] == local


@pytest.mark.parametrize("guess", ["seen", "rows alone"])
def test_values_no_layer_propagates_are_read_without_their_halo(guess, monkeypatch):
    """A chunk reads a value's halo rows only where a layer of the group propagated that value on the chunks before
    (GCN2Conv propagates ``x`` but reads ``x_0`` at its own rows): from the second step on, ``x_0`` comes as the
    chunk's rows alone. A guess that turns out wrong costs a second read, never a value: with every value read
    as rows alone at first (``rows alone``), each layer asking for the halo afterwards, three Adam steps still
    equal one device (float64, a graph of three components, 4 chunks, every one with a halo; streaming with
    replays and with kept activations)."""
    from pyg_pipe.engine.step.direct import DirectCalls
    if guess == "rows alone":
        monkeypatch.setattr(DirectCalls, "wants_halo", lambda self, g, name: False)
    torch.set_default_dtype(torch.float64)
    try:
        x, g, y, mask = zoo_graph(sizes=(16, 40, 40))
        torch.manual_seed(0)
        model = gcnii(8, 12, 3, 4)
        ref = copy.deepcopy(model)

        def train(m):
            opt, outs = torch.optim.Adam(m.parameters(), lr=0.02), []
            for _ in range(3):
                out = m(x, g["edge_index"])
                F.cross_entropy(out[mask], y[mask]).backward()
                opt.step()
                opt.zero_grad()
                outs.append(out.detach())
            return outs
        for keep in (False, True):  # kept activations, replays
            model = copy.deepcopy(ref)
            engine = _engine(model, recompute=keep)
            engine.install()
            try:
                streamed = train(model)
            finally:
                engine.uninstall()
            for a, b in zip(streamed, train(copy.deepcopy(ref))):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
            halos = engine.runtime.direct.halos
            if guess == "seen":  # per group after the first: x propagated, x_0 read at its rows only
                assert sorted(halos.values()).count(False) == sorted(halos.values()).count(True) == 3, halos
    finally:
        torch.set_default_dtype(torch.float32)
