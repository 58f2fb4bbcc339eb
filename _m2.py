import torch, faulthandler
faulthandler.enable()
from _adv3 import CASES
from tests.zoo import zoo_graph
from tests.harness import check_mode
from tests.dist import run_distributed
def w(rank, world):
    import tests.harness as h; old = h._agree
    h._agree = lambda o: (print(rank, "RAW", o[:900], flush=True), old(o))[1]
    import faulthandler; faulthandler.enable()
    torch.set_default_dtype(torch.float64)
    x, g, y, mask = zoo_graph()
    ei = g["edge_index"]; srt = ei[:, torch.argsort(ei[1] * x.size(0) + ei[0])]
    print(rank, check_mode("graph_parallel", CASES["median"], dict(x=x, edge_index=srt), y, mask, world)[:300], flush=True)
if __name__ == "__main__":
    run_distributed(w, 2, timeout=200)
