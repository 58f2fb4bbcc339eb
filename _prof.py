import copy, time, torch, torch.nn.functional as F
from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from pyg_pipe.graph import sbm_graph
from pyg_pipe.models import gcnii
torch.set_num_threads(1)
data = sbm_graph(400, num_classes=4, avg_degree=8, num_features=16, seed=0)
torch.manual_seed(0)
model = gcnii(16, 16, 4, num_layers=16, dropout=0.0)
engine = GNNPipeEngine(model, PipelineConfig(num_chunks=16, balance="layers", streaming=False), Comm(torch.device("cpu")), num_stages=1, ways=1)
engine.install()
opt = torch.optim.SGD(model.parameters(), lr=0.0)
def step():
    out = model(data.x, data.edge_index)
    F.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()
for _ in range(5): step()
t0 = time.perf_counter()
for _ in range(150): step()
print("ms/step", (time.perf_counter() - t0) / 150 * 1e3)
