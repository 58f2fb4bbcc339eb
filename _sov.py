import copy, time, statistics, sys, torch
import torch.nn.functional as F
from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from pyg_pipe.graph import sbm_graph
from pyg_pipe.models import gcnii
torch.set_num_threads(1)
data = sbm_graph(400, num_classes=4, avg_degree=8, num_features=16, seed=0)
torch.manual_seed(0)
model = gcnii(16, 16, 4, num_layers=16, dropout=0.0)
plain = copy.deepcopy(model)
engine = GNNPipeEngine(model, PipelineConfig(num_chunks=16, streaming=True), Comm(torch.device("cpu")), num_stages=1)
def step(m):
    t0 = time.perf_counter()
    out = m(data.x, data.edge_index)
    F.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()
    return time.perf_counter() - t0
engine.install()
for _ in range(3): step(model)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 15
if sys.argv[2:] == ["profile"]:
    for _ in range(n): step(model)
    sys.exit()
times = {"plain": [], "engine": []}
for _ in range(n):
    engine.uninstall(); times["plain"].append(step(plain)); engine.install(); times["engine"].append(step(model))
t = {k: statistics.median(v) * 1e3 for k, v in times.items()}
print(t, "ms per (chunk, layer):", (t["engine"] - t["plain"]) / 256)
