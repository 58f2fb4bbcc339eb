import time, statistics, sys, torch, contextlib
import torch.nn.functional as F
from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from pyg_pipe.engine import engine as eng
from pyg_pipe.graph import sbm_graph
from pyg_pipe.models import gcnii
torch.set_num_threads(1)
nodes, chunks, streaming = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "stream"
data = sbm_graph(nodes, num_classes=4, avg_degree=8, num_features=16, seed=0)
torch.manual_seed(0)
model = gcnii(16, 16, 4, num_layers=16, dropout=0.0)
engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, streaming=streaming), Comm(torch.device("cpu")), num_stages=1)
def step():
    out = model(data.x, data.edge_index)
    F.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()
engine.install()
for _ in range(3): step()
frozen = eng.older_objects_frozen
res = {"frozen": [], "not": []}
for r in range(3):
    for mode in res:
        eng.older_objects_frozen = frozen if mode == "frozen" else contextlib.nullcontext
        t = time.perf_counter()
        for _ in range(30): step()
        res[mode].append((time.perf_counter() - t) / 30 * 1e3)
print(sys.argv[1:], {k: [round(x, 1) for x in v] for k, v in res.items()})
