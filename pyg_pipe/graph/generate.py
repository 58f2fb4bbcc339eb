"""Offline graph generators and dataset loaders: learnable node-classification graphs made locally."""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor
from torch_geometric.data import Data

__all__ = ["sbm_graph", "powerlaw_graph", "karate_club", "load_dataset"]

# Scale of the class-mean vectors (standard deviation of each entry). Chosen so that with
# ``feature_noise=1`` an MLP on the node features alone gets roughly half of the nodes right on an
# 8-class graph (measured: 0.52 test accuracy on sbm_graph(), 0.59 on powerlaw_graph()), while a
# 2-layer GCN, which averages over homophilous neighbourhoods, reaches 0.99 / 0.97.
_MEAN_SCALE = 0.3


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _generator(seed: int) -> torch.Generator:
    if not isinstance(seed, int):
        raise TypeError(f"`seed` must be an int, got {type(seed).__name__}")
    return torch.Generator().manual_seed(seed)


def _check_common(num_nodes: int, num_classes: int, avg_degree: float, homophily: float,
                  num_features: int) -> None:
    if num_nodes < 2:
        raise ValueError(f"`num_nodes` must be at least 2, got {num_nodes}")
    if not 1 <= num_classes <= num_nodes:
        raise ValueError(f"`num_classes` must be in [1, num_nodes={num_nodes}], got {num_classes}")
    if avg_degree < 0:
        raise ValueError(f"`avg_degree` must be non-negative, got {avg_degree}")
    if not 0.0 <= homophily <= 1.0:
        raise ValueError(f"`homophily` is a fraction of edges and must be in [0, 1], got {homophily}")
    if num_features < 1:
        raise ValueError(f"`num_features` must be at least 1, got {num_features}")


def _balanced_labels(num_nodes: int, num_classes: int, gen: torch.Generator) -> Tensor:
    """Class labels with class sizes differing by at most one, randomly placed: LongTensor [N]."""
    return torch.randperm(num_nodes, generator=gen) % num_classes


def _class_features(y: Tensor, num_classes: int, num_features: int, feature_noise: float,
                    gen: torch.Generator) -> Tensor:
    """Features = class mean + isotropic Gaussian noise: FloatTensor [N, num_features]."""
    if feature_noise < 0:
        raise ValueError(f"`feature_noise` must be non-negative, got {feature_noise}")
    means = _MEAN_SCALE * torch.randn(num_classes, num_features, generator=gen)
    noise = torch.randn(y.numel(), num_features, generator=gen)
    return (means[y] + feature_noise * noise).to(torch.float32)


def _split_masks(num_nodes: int, train_ratio: float, val_ratio: float,
                 gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Random disjoint train/val/test masks (BoolTensor [N] each); test gets the remainder."""
    if not (0.0 <= train_ratio <= 1.0 and 0.0 <= val_ratio <= 1.0 and train_ratio + val_ratio <= 1.0):
        raise ValueError(
            f"`train_ratio` ({train_ratio}) and `val_ratio` ({val_ratio}) must be in [0, 1] and sum "
            "to at most 1; the test split gets the remainder")
    perm = torch.randperm(num_nodes, generator=gen)
    n_train = int(round(train_ratio * num_nodes))
    n_val = min(int(round(val_ratio * num_nodes)), num_nodes - n_train)
    masks = []
    for lo, hi in ((0, n_train), (n_train, n_train + n_val), (n_train + n_val, num_nodes)):
        mask = torch.zeros(num_nodes, dtype=torch.bool)
        mask[perm[lo:hi]] = True
        masks.append(mask)
    return masks[0], masks[1], masks[2]


def _sample_class_edges(y: Tensor, num_classes: int, weight: Tensor, num_pairs: int,
                        homophily: float, gen: torch.Generator) -> Tensor:
    """Sample distinct undirected pairs with a given fraction inside class blocks.

    Both endpoints of a pair are drawn with probability proportional to ``weight`` (uniform weights
    give a stochastic block model, power-law weights a degree-corrected one / Chung-Lu graph).
    For an intra-class pair the second endpoint is drawn from the first one's class, for an
    inter-class pair from all other classes. Self loops and repeated pairs are rejected and
    re-drawn, so the cost is O(num_pairs log num_pairs), never O(N^2).

    Args:
        y: LongTensor [N], class of each vertex.
        num_classes: number of classes C.
        weight: FloatTensor [N], positive sampling weight of each vertex.
        num_pairs: wanted number of undirected pairs.
        homophily: wanted fraction of pairs inside a class.
        gen: random generator.

    Returns:
        LongTensor [2, M] with ``row < col`` in every column; M equals ``num_pairs`` unless the
        graph cannot hold that many distinct pairs (then as many as could be found).
    """
    n = y.numel()
    order = torch.argsort(y, stable=True)                        # vertices grouped by class
    sizes = torch.bincount(y, minlength=num_classes)
    cum = torch.cumsum(weight[order].to(torch.float64), 0)      # cumulative weight, class-grouped
    total = float(cum[-1])
    class_w = torch.zeros(num_classes, dtype=torch.float64).index_add_(0, y, weight.to(torch.float64))
    class_w0 = torch.cumsum(class_w, 0) - class_w                # weight before each class block
    start = torch.cumsum(sizes, 0) - sizes                       # first position of each class block

    intra_max = int((sizes * (sizes - 1) // 2).sum())
    inter_max = n * (n - 1) // 2 - intra_max
    want_intra = int(round(homophily * num_pairs))
    want = {True: min(want_intra, intra_max), False: min(num_pairs - want_intra, inter_max)}

    def draw(count: int, intra: bool) -> Tensor:
        pos_u = torch.searchsorted(cum, torch.rand(count, generator=gen, dtype=torch.float64) * total,
                                   right=True).clamp_(max=n - 1)
        cu = y[order[pos_u]]
        r = torch.rand(count, generator=gen, dtype=torch.float64)
        if intra:
            pos_v = torch.searchsorted(cum, class_w0[cu] + r * class_w[cu], right=True)
            pos_v = torch.minimum(torch.maximum(pos_v, start[cu]), start[cu] + sizes[cu] - 1)
        else:
            t = r * (total - class_w[cu])
            t = torch.where(t >= class_w0[cu], t + class_w[cu], t)  # skip u's own class block
            pos_v = torch.searchsorted(cum, t, right=True).clamp_(max=n - 1)
        u, v = order[pos_u], order[pos_v]
        keep = (u != v) & ((y[u] == y[v]) == intra)              # guards against float rounding
        u, v = u[keep], v[keep]
        return torch.minimum(u, v) * n + torch.maximum(u, v)    # canonical pair key

    pairs = []
    for intra in (True, False):
        target = want[intra]
        keys = torch.empty(0, dtype=torch.long)
        for _ in range(64):                                      # rejection rounds
            missing = target - keys.numel()
            if missing <= 0:
                break
            extra = draw(int(missing * 1.1) + 16, intra)
            keys = torch.unique(torch.cat([keys, extra]))
        if keys.numel() > target:                                # random subset of exact size
            keys = keys[torch.randperm(keys.numel(), generator=gen)[:target]]
        pairs.append(keys)
    keys = torch.cat(pairs)
    return torch.stack([keys // n, keys % n])


def _undirected(pairs: Tensor, num_nodes: int) -> Tensor:
    """Both directions of each pair, sorted by (row, col): LongTensor [2, 2M]."""
    row = torch.cat([pairs[0], pairs[1]])
    col = torch.cat([pairs[1], pairs[0]])
    perm = torch.argsort(row * num_nodes + col)
    return torch.stack([row[perm], col[perm]])


def _make_data(x: Tensor, edge_index: Tensor, y: Tensor, train_ratio: float, val_ratio: float,
               gen: torch.Generator) -> Data:
    train_mask, val_mask, test_mask = _split_masks(y.numel(), train_ratio, val_ratio, gen)
    return Data(x=x, edge_index=edge_index, y=y, train_mask=train_mask, val_mask=val_mask,
                test_mask=test_mask, num_nodes=y.numel())


# ---------------------------------------------------------------------------------------------
# generators
# ---------------------------------------------------------------------------------------------


def sbm_graph(num_nodes: int = 2000, num_classes: int = 8, avg_degree: float = 10.0,
              homophily: float = 0.8, num_features: int = 32, feature_noise: float = 1.0,
              seed: int = 0, *, train_ratio: float = 0.6, val_ratio: float = 0.2) -> Data:
    """Stochastic block model with class-correlated features, for node classification.

    Vertices get balanced random classes (the blocks). ``num_nodes * avg_degree / 2`` distinct
    undirected edges are sampled with uniformly random endpoints, a fraction ``homophily`` of them
    inside a block and the rest between blocks. Features are a random per-class mean vector plus
    Gaussian noise of standard deviation ``feature_noise``; at the default noise the features
    alone are a weak signal (an MLP reaches roughly half accuracy on 8 classes) and aggregating
    neighbours, as a GNN does, is needed to do well. Sampling is vectorised: 50k nodes with 1M
    edges take well under a few seconds.

    Args:
        num_nodes: number of vertices N (>= 2).
        num_classes: number of classes / blocks C.
        avg_degree: target mean degree; the result has about ``N * avg_degree`` directed edges.
        homophily: fraction of undirected edges whose endpoints share a class, in [0, 1].
        num_features: feature width F.
        feature_noise: standard deviation of the feature noise (0 makes features noiseless).
        seed: seed of the local random generator; equal seeds give equal graphs.
        train_ratio, val_ratio: fractions of vertices in the train and val masks; test gets the rest.

    Returns:
        ``Data`` with ``x`` float32 [N, F], ``edge_index`` int64 [2, E] (undirected: both
        directions, sorted, no self loops, no duplicates), ``y`` int64 [N] and disjoint bool masks
        ``train_mask`` / ``val_mask`` / ``test_mask`` [N].
    """
    _check_common(num_nodes, num_classes, avg_degree, homophily, num_features)
    gen = _generator(seed)
    y = _balanced_labels(num_nodes, num_classes, gen)
    num_pairs = int(round(num_nodes * avg_degree / 2))
    pairs = _sample_class_edges(y, num_classes, torch.ones(num_nodes), num_pairs, homophily, gen)
    edge_index = _undirected(pairs, num_nodes)
    x = _class_features(y, num_classes, num_features, feature_noise, gen)
    return _make_data(x, edge_index, y, train_ratio, val_ratio, gen)


def powerlaw_graph(num_nodes: int = 2000, avg_degree: float = 10.0, exponent: float = 2.5,
                   num_classes: int = 8, homophily: float = 0.7, num_features: int = 32,
                   seed: int = 0, *, feature_noise: float = 1.0, train_ratio: float = 0.6,
                   val_ratio: float = 0.2) -> Data:
    """Degree-heterogeneous (Chung-Lu style) graph with class structure, for node classification.

    Each vertex gets an expected degree from a power law, ``w_i ~ (i + 1) ** (-1 / (exponent - 1))``
    shuffled over the vertices and scaled to mean ``avg_degree`` (capped at
    ``sqrt(N * avg_degree)`` so hubs stay simple-graph feasible). Edge endpoints are drawn with
    probability proportional to ``w``; a fraction ``homophily`` of the edges joins vertices of the
    same class. Features and masks are made as in :func:`sbm_graph`. 100k nodes with 2M directed
    edges take a few seconds. Low-weight vertices may end up isolated (a few percent).

    Args:
        num_nodes: number of vertices N (>= 2).
        avg_degree: target mean degree; the result has about ``N * avg_degree`` directed edges.
        exponent: power-law exponent gamma of the degree distribution, > 2 (2.1 – 3 is typical).
        num_classes: number of classes C.
        homophily: fraction of undirected edges whose endpoints share a class, in [0, 1].
        num_features: feature width F.
        seed: seed of the local random generator.
        feature_noise: standard deviation of the feature noise.
        train_ratio, val_ratio: fractions of vertices in the train and val masks; test gets the rest.

    Returns:
        ``Data`` with the same fields and guarantees as :func:`sbm_graph`.
    """
    _check_common(num_nodes, num_classes, avg_degree, homophily, num_features)
    if exponent <= 2.0:
        raise ValueError(f"`exponent` must be > 2 for a finite mean degree, got {exponent}")
    gen = _generator(seed)
    y = _balanced_labels(num_nodes, num_classes, gen)
    ranks = torch.arange(1, num_nodes + 1, dtype=torch.float64)
    w = ranks.pow(-1.0 / (exponent - 1.0))
    w = w * (max(avg_degree, 1e-12) / w.mean())
    w = w.clamp(max=math.sqrt(num_nodes * max(avg_degree, 1.0)))
    w = w[torch.randperm(num_nodes, generator=gen)]
    num_pairs = int(round(num_nodes * avg_degree / 2))
    pairs = _sample_class_edges(y, num_classes, w, num_pairs, homophily, gen)
    edge_index = _undirected(pairs, num_nodes)
    x = _class_features(y, num_classes, num_features, feature_noise, gen)
    return _make_data(x, edge_index, y, train_ratio, val_ratio, gen)


def karate_club(seed: int = 0) -> Data:
    """Zachary's karate club (bundled with PyG, no download) with val/test masks added.

    Keeps PyG's ``train_mask`` (one labelled vertex per community, 4 in all) and splits the other
    30 vertices at random into ``val_mask`` (15) and ``test_mask`` (15).

    Args:
        seed: seed of the local random generator used for the val/test split.

    Returns:
        ``Data`` with ``x`` float32 [34, 34] (one-hot), ``edge_index`` int64 [2, 156], ``y`` int64
        [34] (4 classes) and disjoint bool masks.
    """
    from torch_geometric.datasets import KarateClub

    data = KarateClub()[0]
    gen = _generator(seed)
    rest = (~data.train_mask).nonzero().view(-1)
    rest = rest[torch.randperm(rest.numel(), generator=gen)]
    half = rest.numel() // 2
    val_mask = torch.zeros_like(data.train_mask)
    test_mask = torch.zeros_like(data.train_mask)
    val_mask[rest[:half]] = True
    test_mask[rest[half:]] = True
    return Data(x=data.x.float(), edge_index=data.edge_index.long(), y=data.y.long(),
                train_mask=data.train_mask.clone(), val_mask=val_mask, test_mask=test_mask,
                num_nodes=data.num_nodes)


# ---------------------------------------------------------------------------------------------
# loader
# ---------------------------------------------------------------------------------------------

_PLANETOID = {"cora": "Cora", "citeseer": "CiteSeer", "pubmed": "PubMed"}
_OFFLINE = ("sbm", "powerlaw", "karate")
_ONLINE = tuple(_PLANETOID) + ("flickr", "reddit", "ogbn-arxiv", "ogbn-products")


def _load_ogb(name: str, root: str) -> Data:
    try:
        from ogb.nodeproppred import PygNodePropPredDataset
    except ImportError as e:
        raise ImportError(f"load_dataset('{name}') needs the `ogb` package: pip install ogb") from e
    dataset = PygNodePropPredDataset(name=name, root=root)
    data = dataset[0]
    split = dataset.get_idx_split()
    n = data.num_nodes
    masks = {}
    for key, ogb_key in (("train_mask", "train"), ("val_mask", "valid"), ("test_mask", "test")):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[split[ogb_key]] = True
        masks[key] = mask
    return Data(x=data.x.float(), edge_index=data.edge_index.long(), y=data.y.view(-1).long(),
                num_nodes=n, **masks)


def load_dataset(name: str, root: str = "data", **kwargs) -> Data:
    """Load a node-classification graph by name.

    Offline (generated here, no download): ``"sbm"`` (:func:`sbm_graph`), ``"powerlaw"``
    (:func:`powerlaw_graph`), ``"karate"`` (:func:`karate_club`); ``kwargs`` go to the generator.
    Online (downloaded into ``root`` on first use, needs an internet connection): ``"cora"``,
    ``"citeseer"``, ``"pubmed"`` (PyG ``Planetoid``), ``"flickr"`` (PyG ``Flickr``),
    ``"reddit"`` (PyG ``Reddit``), ``"ogbn-arxiv"``, ``"ogbn-products"`` (``ogb`` package);
    ``kwargs`` go to the PyG dataset class (ignored for OGB).

    Args:
        name: dataset name, case-insensitive.
        root: directory where downloaded datasets are cached.
        **kwargs: forwarded as described above.

    Returns:
        A single ``Data`` with ``x``, ``edge_index``, ``y`` and ``train_mask`` / ``val_mask`` /
        ``test_mask``.

    Raises:
        ValueError: unknown ``name``.
        ImportError / RuntimeError: an online dataset whose package is missing or whose download
            failed; the message says what is needed.
    """
    key = name.lower()
    if key == "sbm":
        return sbm_graph(**kwargs)
    if key == "powerlaw":
        return powerlaw_graph(**kwargs)
    if key == "karate":
        return karate_club(**kwargs)
    if key not in _ONLINE:
        raise ValueError(f"unknown dataset `name`={name!r}; choose one of {_OFFLINE + _ONLINE}")

    try:
        if key.startswith("ogbn-"):
            return _load_ogb(key, root)
        from torch_geometric import datasets as pyg_datasets

        if key in _PLANETOID:
            dataset = pyg_datasets.Planetoid(root, _PLANETOID[key], **kwargs)
        elif key == "flickr":
            dataset = pyg_datasets.Flickr(os.path.join(root, "Flickr"), **kwargs)
        else:
            dataset = pyg_datasets.Reddit(os.path.join(root, "Reddit"), **kwargs)
        return dataset[0]
    except ImportError:
        raise
    except Exception as e:  # download / parsing failures
        raise RuntimeError(
            f"could not load dataset {name!r} into root={root!r}: it is downloaded on first use and "
            "needs an internet connection (or a copy already placed under `root`). Offline, use "
            f"one of the generated graphs {_OFFLINE}. Cause: {type(e).__name__}: {e}") from e
