"""The staleness meter: how far the historical rows a step read were from the rows they stood for.

With several chunks a way, a chunk reads the halo rows owned by chunks that run after it in the step
from history (:mod:`.history`): values written in an earlier step, or the T2 snapshot's. Their owners
write the fresh values later in the same fill, so once the fill is over both versions are at hand,
for free: the buffer holds the fresh rows, the start-of-step copy the rows that were read. For each
call site ``k`` (``"site:arg"``) the meter adds up, over every stale read of the step (a row read by
two chunks counts twice)::

    drift_k = ‖h_fresh − h_stale‖ / ‖h_fresh‖        (Frobenius norms over the stale rows read at k)
    stale_share = stale reads / all halo reads         (halo rows of other chunks of the way, all sites)
    age = updates between the step that computed a stale row and the step reading it
          (1 without snapshots; up to the period with T2; 0 right after an exact refill)

The drift is estimated on at most 1024 stale reads per site and step, spread evenly over each
chunk's: measuring all of them was 1.08 - 1.18 × the step in one (noisy) A/B run; sampled, the meter's
own time is 0.8 % of the step (docs/gnnpipe.md). The norms stay on the
device during the step (no host synchronisation); the engine hands the
per-step sums to whoever asks (:meth:`StalenessMeter.take`; the Lightning strategies log
``staleness/max_drift``, ``staleness/drift/<site>``, ``staleness/stale_share`` and
``staleness/mean_age`` per epoch). A fill with one chunk a way (graph parallelism, exact passes),
inference and streaming read nothing stale and record nothing. ``staleness_meter=False`` turns it off.
Historical BatchNorm statistics (``per_chunk_statistics="history"``) add a site ``statistics:<module>``:
the other chunks' sums each chunk read against their values at the end of the fill.

**Random numbers (dropout).** When the training forward draws random numbers on any rank (decided once,
after the first step, over all ranks), a stale row and its fresh version come from different dropout
masks, so ``h_fresh − h_stale`` is mostly dropout noise: at lr = 0 the reads above measure a large drift
where nothing is stale. The meter then takes its drift from *probes* instead: every ``P`` steps
(``P = snapshot_period``, or ``PROBE_PERIOD`` without snapshots) an exact pass in eval mode, no
gradients, no history written, random state left as it was, samples each site's rows (at most
``SAMPLE`` of this rank's boundary rows, evenly spaced), and::

    drift_k = ‖e_k(W_t) − e_k(W_{t−P})‖ / ‖e_k(W_t)‖     (e: the site's rows without dropout)

the change of the rows over the last ``P`` updates, which with T2 is how old the oldest rows a stale
read can get: 0 at lr = 0, whatever the dropout. Such a step's entry carries the probe's drift (the first
probe only sets the reference); other steps carry the share and age only. ``max_staleness`` then bounds
the drift a step's stale reads are expected to have, ``age × drift_k / P`` (the rows taken to move
steadily between probes: an adaptive ``max_age``). A probe costs one forward pass without gradients every
``P`` steps; training is unchanged by it (tests/engine/test_staleness.py).
"""
from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional

import torch
from torch import Tensor

log = logging.getLogger(__name__)

#: steps between probes (module docstring) when there are no snapshots to take the period from
PROBE_PERIOD = 8


class StalenessMeter:
    """Per-site drift of the stale rows a step read (module docstring). The drift is taken over at most
    ``SAMPLE`` of a site's stale reads a step (every k-th of each chunk's, the same rows every step with
    the same order; all of them when there are fewer), the share and age over all. Keeps the entries of
    at most ``KEEP`` steps not yet taken."""

    KEEP = 1000
    SAMPLE = 1024

    def __init__(self, on: bool = True):
        self.on = on
        self._sq: Dict[str, List[Tensor]] = {}      # per site: [Σ‖fresh − stale‖², Σ‖fresh‖²] this step (device)
        self._reads = [0, 0]                        # stale reads, all halo reads (host counts)
        self._age = 0.0                             # Σ age over stale reads
        self.steps: List[dict] = []
        self.seconds = 0.0                          # host time spent measuring (the whole cost on CPU)
        self.refreshes = 0                          # exact refills a bound asked for (max_age, max_staleness)
        self.last_drift = 0.0                       # the largest per-site drift of the last step (this rank)
        self.random: Optional[bool] = None          # whether a training forward draws random numbers (all ranks)
        self._drew = False                          # ... on this rank, in the first step's fills
        self._rng = None
        self._probed: Dict[int, Dict[str, Tensor]] = {}  # per call: the rows the last probe sampled, per site
        self.probes = 0                             # probes run (module docstring)
        self.period = PROBE_PERIOD                  # steps between probes
        self.rate = 0.0                             # the last probe's drift per update (this rank)

    # ------------------------------------------------------------------ random numbers and probes
    def watch(self, state: tuple) -> None:
        """Before a fill of the first step: the random ``state`` (CPU, device), to see whether the fill draws
        from it."""
        if self.on and self.random is None:
            self._rng = state

    def watched(self, now: tuple) -> None:
        """After that fill, the random state ``now``: whether it drew random numbers (dropout)."""
        if self._rng is not None:
            self._drew = self._drew or any(a is not None and not torch.equal(a, b) for a, b in zip(self._rng, now))
            self._rng = None

    def decide(self, comm, period: Optional[int]) -> None:
        """At the end of the first step: whether any rank's training forward drew random numbers (one
        all-reduce, the same answer on every rank); if so, drift comes from probes from now on and the
        first step's read drift, dropout noise, is dropped."""
        if not self.on or self.random is not None:
            return
        self.period = period or PROBE_PERIOD
        drew = torch.tensor([float(self._drew)], dtype=torch.float64, device=comm.device)
        comm.all_reduce(drew, None, "the staleness meter", op="max")
        self.random = bool(drew.item() > 0)
        if self.random:
            self._sq = {}
            log.info("pyg_pipe: the training forward draws random numbers (dropout): the staleness meter takes its "
                     "drift from an exact pass without them every %d steps (one forward pass without gradients "
                     "each), not from the rows the steps read", self.period)

    def probe_due(self, step: int) -> bool:
        """Whether a probe runs before step ``step`` (every rank decides the same)."""
        return self.on and self.random is True and step > 0 and step % self.period == 0

    def probed(self, call: int, rows: Dict[str, Tensor]) -> None:
        """A probe's sampled rows per site (float64, on the device): their drift since the call's last probe
        goes into this step's entry."""
        t0 = time.perf_counter()
        last = self._probed.get(call)
        if last is not None:
            keys = [k for k, now in rows.items() if k in last and last[k].shape == now.shape]
            if keys:
                now = [rows[k] for k in keys]
                self._add_all(keys, torch._foreach_sub(now, [last[k] for k in keys]), now)
        self._probed[call] = rows
        self.probes += 1
        self.seconds += time.perf_counter() - t0

    def measure(self, run) -> None:
        """After a fill: the drift of every stale row its chunks read (``run``: the fill's
        :class:`~..runtime.halo.HaloPass`, whose backward routes this computes, as the drain would)."""
        history = run.history
        if not self.on or not run.read_history or history is None or not run.reads:
            return
        t0 = time.perf_counter()
        age = history.age()
        sampled: Dict[tuple, tuple] = {}  # sites read by the same chunks (every layer of a model) share their rows
        keys, fresh, stale = [], [], []
        for key, chunks in run.reads.items():
            which = tuple((id(cg), lg.index) for cg, lg in chunks)
            hit = sampled.get(which)
            if hit is None:
                hit = sampled[which] = self._sampled(run, chunks)
            ids, n, reads = hit
            self._reads[0] += n
            self._reads[1] += reads
            self._age += age * n
            if ids is None or key not in history.buffers or self.random:  # (random: dropout noise, see probes)
                continue
            like = history.buffers[key]
            f, s = history.read(key, ids, like), history.read_start(key, ids, like)
            keys.append(key), fresh.append(f), stale.append(s if s.device == f.device else s.to(f.device))
        if keys:  # every site at once: a few multi-tensor kernels a step, not a dozen small ones a site
            self._add_all(keys, torch._foreach_sub(fresh, stale), fresh)
        self.seconds += time.perf_counter() - t0

    def _add_all(self, keys: List[str], diffs: List[Tensor], fresh: List[Tensor]) -> None:
        """The sites ``keys``' ``Σ‖fresh − stale‖²`` and ``Σ‖fresh‖²`` (norms accumulated in float64)."""
        norms = torch.stack([torch.stack(torch._foreach_norm(diffs, 2, dtype=torch.float64)),
                             torch.stack(torch._foreach_norm(fresh, 2, dtype=torch.float64))], 1).square_()
        for key, sq in zip(keys, norms.unbind(0)):
            acc = self._sq.get(key)
            self._sq[key] = sq if acc is None else acc + sq

    def _sampled(self, run, chunks) -> tuple:
        """The stale reads of ``chunks`` at one site: the ids measured (at most ``SAMPLE``, evenly spaced over each
        chunk's; ``None``: no stale read), how many were stale, how many halo rows were read."""
        stale = [run._route(cg, lg).stale_ids for cg, lg in chunks]
        n = sum(t.numel() for t in stale if t is not None)
        stride = -(-n // self.SAMPLE)  # ceil: at most SAMPLE rows measured per site
        ids = [t[::stride] for t in stale if t is not None]
        reads = sum(lg.halo.numel() for _, lg in chunks)
        return (torch.cat(ids) if len(ids) > 1 else ids[0]) if ids else None, n, reads

    def add(self, key: str, diff_sq: Tensor, fresh_sq: Tensor) -> None:
        """Another site's ``Σ‖fresh − stale‖²`` and ``Σ‖fresh‖²`` this step (device scalars): the historical
        BatchNorm sums (:mod:`.statistics`) report here under ``statistics:<module>``."""
        if not self.on:
            return
        sq = torch.stack([diff_sq.double(), fresh_sq.double()])
        acc = self._sq.get(key)
        self._sq[key] = sq if acc is None else acc + sq

    def end_step(self) -> None:
        """The step is over: its sums become one entry of :attr:`steps` (read on the host here, outside
        the per-chunk loop)."""
        self.last_drift = 0.0
        if not self._sq and not self._reads[1]:
            return
        t0 = time.perf_counter()
        sums = torch.stack(list(self._sq.values())).tolist() if self._sq else []   # (one copy to the host)
        sites = {k: tuple(v) for k, v in zip(self._sq, sums)}
        self.last_drift = max([(d / f) ** 0.5 if f > 0 else 0.0 for d, f in sites.values()], default=0.0)
        if self.random and sites:  # a probe's step: the drift over the last period
            self.rate = self.last_drift / self.period
        self.steps.append({"sites": sites, "stale": self._reads[0], "reads": self._reads[1], "age": self._age})
        if len(self.steps) > self.KEEP:  # nobody takes them (the engine used without a logger): the latest only
            del self.steps[:len(self.steps) - self.KEEP]
        self.seconds += time.perf_counter() - t0
        self._sq, self._reads, self._age = {}, [0, 0], 0.0

    def take(self) -> List[dict]:
        """The entries of the steps since the last call."""
        out, self.steps = self.steps, []
        return out


class SampledRows:
    """Stands in for a call's history in a probe's exact pass: keeps, per site, at most ``sample`` of the rows
    this rank writes (the boundary rows the history holds, evenly spaced), in float64. Rows other ways own
    (received) are their ranks' to sample."""

    def __init__(self, history, sample: int):
        self.history, self.sample = history, sample
        self.rows: Dict[str, Tensor] = {}
        self._pos: Dict[tuple, Tensor] = {}

    def write(self, key: str, start: int, rows: Tensor) -> None:
        n = rows.size(0)
        pos = self._pos.get((start, n))
        if pos is None:
            local = self.history.local
            held = torch.arange(n, device=rows.device) if local is None else \
                torch.nonzero(local[start:start + n] >= 0).view(-1).to(rows.device)
            pos = self._pos[(start, n)] = held[::max(1, -(-held.numel() // self.sample))]
        self.rows[key] = rows.detach().index_select(0, pos).double()

    def write_ids(self, key: str, ids: Tensor, rows: Tensor) -> None:
        pass


def summarize(steps: List[dict]) -> Dict[str, float]:
    """Per-epoch metrics from the entries of one or more ranks' steps: ``max_drift``, ``drift/<site>``
    (norms summed over the steps, then divided), ``stale_share`` and ``mean_age``."""
    sq: Dict[str, List[float]] = {}
    stale = reads = age = 0.0
    for s in steps:
        for k, (d, f) in s["sites"].items():
            acc = sq.setdefault(k, [0.0, 0.0])
            acc[0] += d
            acc[1] += f
        stale, reads, age = stale + s["stale"], reads + s["reads"], age + s["age"]
    out = {f"drift/{k}": (d / f) ** 0.5 if f > 0 else 0.0 for k, (d, f) in sorted(sq.items())}
    out["max_drift"] = max([v for k, v in out.items()], default=0.0)
    out["stale_share"] = stale / reads if reads else 0.0
    out["mean_age"] = age / stale if stale else 0.0
    return out
