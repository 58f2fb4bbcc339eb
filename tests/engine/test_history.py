"""Historical embeddings: which version of a row a read sees, pending gradients, and checkpoints.

Protects the T2 rule (the rows written this step, else the snapshot's; a snapshot taken at steps
divisible by the period and whenever a buffer has none; ``renew()`` forcing a new one; no period,
no restore), ``index_add`` accumulation of the gradients of fresh reads, one history per call of
the model, and that a checkpoint restores buffers, snapshot and ``initialised`` while a state of an
older format leaves every call to be refilled by an exact pass.
"""
import io

import torch

from pyg_pipe.engine.runtime.history import CallHistory, HistoryStore

CPU = torch.device("cpu")
KEY = "conv#0.0:x"


def col(*values):
    """A ``[n, 1]`` column of rows."""
    return torch.tensor(values, dtype=torch.float32).view(-1, 1)


def seen(h, key=KEY, n=4):
    return h.read(key, torch.arange(n), col(0)).view(-1).tolist()


# ---------------------------------------------------------------------------------------------- rows
def test_a_buffer_starts_as_zeros_with_the_rows_trailing_shape_and_dtype():
    h = CallHistory(5, CPU)
    like = torch.ones(2, 3, 2, dtype=torch.float64)
    buf = h.buffer(KEY, like)
    assert buf.shape == (5, 3, 2) and buf.dtype == torch.float64
    assert not buf.any()
    assert h.buffer(KEY, torch.ones(1, 7)) is buf          # created once


def test_write_stores_a_row_range_and_read_returns_those_rows():
    h = CallHistory(5, CPU)
    h.write(KEY, 1, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    got = h.read(KEY, torch.tensor([2, 0, 1]), torch.zeros(1, 2))
    assert got.tolist() == [[3.0, 4.0], [0.0, 0.0], [1.0, 2.0]]


def test_write_ids_stores_rows_at_scattered_vertices():
    h = CallHistory(5, CPU)
    h.write_ids(KEY, torch.tensor([4, 0]), col(7, 8))
    assert seen(h, n=5) == [8.0, 0.0, 0.0, 0.0, 7.0]


def test_writes_are_detached_and_reads_are_copies():
    h = CallHistory(3, CPU)
    rows = torch.ones(3, 1, requires_grad=True) * 2
    h.write(KEY, 0, rows)
    assert not h.buffers[KEY].requires_grad
    got = h.read(KEY, torch.arange(3), col(0))
    got += 100
    assert seen(h, n=3) == [2.0, 2.0, 2.0]


def test_sites_and_arguments_have_separate_buffers():
    h = CallHistory(2, CPU)
    h.write("conv#0.0:x", 0, col(1, 2))
    h.write("conv#0.0:edge_attr", 0, col(5, 6))
    assert seen(h, "conv#0.0:x", 2) == [1.0, 2.0]
    assert seen(h, "conv#0.0:edge_attr", 2) == [5.0, 6.0]


# ---------------------------------------------------------------------------------------------- snapshots (T2)
def test_reads_see_this_steps_rows_else_the_snapshot_of_the_last_multiple_of_the_period():
    h = CallHistory(4, CPU)
    h.begin_step(0, 2)                      # nothing to snapshot yet
    h.write(KEY, 0, col(10, 10, 10, 10))    # the exact pass fills every row
    h.begin_step(1, 2)                      # no snapshot yet: one is taken although 1 % 2 != 0
    assert seen(h) == [10, 10, 10, 10]
    h.write(KEY, 0, col(11, 11))            # chunk 0 of step 1
    assert seen(h) == [11, 11, 10, 10]
    h.begin_step(2, 2)                      # 2 % 2 == 0: snapshot of what step 1 left
    assert seen(h) == [11, 11, 10, 10]
    h.write(KEY, 2, col(12, 12))
    assert seen(h) == [11, 11, 12, 12]
    h.begin_step(3, 2)                      # restored: step 2's rows 2, 3 are gone
    assert seen(h) == [11, 11, 10, 10]
    h.write(KEY, 0, col(13, 13))
    h.begin_step(4, 2)                      # snapshot again, keeps step 3's rows
    h.write(KEY, 2, col(14, 14))
    h.begin_step(5, 2)
    assert seen(h) == [13, 13, 10, 10]


def test_with_period_one_every_step_sees_what_the_last_step_left():
    h = CallHistory(2, CPU)
    h.write(KEY, 0, col(1, 1))
    for step, value in enumerate((2, 3, 4)):
        h.begin_step(step, 1)
        h.write(KEY, step % 2, col(value))
    h.begin_step(3, 1)
    assert seen(h, n=2) == [4, 3]


def test_smoothing_reads_a_moving_average_that_restarts_after_a_refill():
    """``s_t = γ·s_{t-1} + (1-γ)·h_t`` for the rows a step starts with; this step's writes read as written;
    an exact refill (``renew``) restarts the average; the start rows replays read are the smoothed ones."""
    h = CallHistory(2, CPU)
    h.write(KEY, 0, col(8, 8))                     # the exact pass
    h.begin_step(0, None, smoothing=0.5)           # the average starts at the exact rows
    assert seen(h, n=2) == [8, 8]
    h.write(KEY, 0, col(4))                        # chunk 0 of step 0; row 1 is read stale
    assert seen(h, n=2) == [4, 8]
    h.begin_step(1, None, keep_start=True, smoothing=0.5)
    assert seen(h, n=2) == [6, 8]                  # 0.5·8 + 0.5·4
    assert h.read_start(KEY, torch.arange(2), col(0)).view(-1).tolist() == [6, 8]
    h.write(KEY, 1, col(0))
    h.begin_step(2, None, smoothing=0.5)
    assert seen(h, n=2) == [6, 4]
    h.renew()                                      # a refill: the average restarts from the buffers
    h.write(KEY, 0, col(1, 1))
    h.begin_step(3, None, smoothing=0.5)
    assert seen(h, n=2) == [1, 1]


def test_without_a_period_the_buffers_are_never_restored():
    h = CallHistory(3, CPU)
    h.begin_step(0, None)
    h.write(KEY, 0, col(1, 1, 1))
    for step, value in enumerate((2, 3, 4), start=1):
        h.begin_step(step, None)
        h.write(KEY, step - 1, col(value))
    h.begin_step(4, None)
    assert seen(h, n=3) == [2, 3, 4]
    assert h.snapshot == {}


def test_a_buffer_first_written_mid_period_gets_a_snapshot_at_the_next_step():
    h = CallHistory(2, CPU)
    h.write("a", 0, col(1, 1))
    h.begin_step(0, 4)                      # snapshot of "a"
    h.write("b", 0, col(5, 5))              # a new buffer appears during step 0
    h.begin_step(1, 4)                      # "b" has no snapshot: the buffers are copied, not restored
    assert seen(h, "b", 2) == [5, 5]
    h.write("b", 0, col(6, 6))
    h.write("a", 0, col(2, 2))
    h.begin_step(2, 4)                      # now both have one: restored
    assert seen(h, "b", 2) == [5, 5]
    assert seen(h, "a", 2) == [1, 1]


def test_renew_makes_the_next_step_take_a_new_snapshot_instead_of_restoring():
    h = CallHistory(2, CPU)
    h.write(KEY, 0, col(1, 1))
    h.begin_step(0, 10)
    h.write(KEY, 0, col(7, 7))              # e.g. refilled by an exact pass
    h.renew()
    assert h.snapshot == {}
    h.begin_step(1, 10)                     # would restore [1, 1] without renew()
    assert seen(h, n=2) == [7, 7]
    h.write(KEY, 0, col(8, 8))
    h.begin_step(2, 10)                     # the renewed snapshot is the anchor
    assert seen(h, n=2) == [7, 7]


def test_a_snapshot_is_a_copy_not_a_view_of_the_buffer():
    h = CallHistory(2, CPU)
    h.write(KEY, 0, col(1, 1))
    h.begin_step(0, 3)
    h.write(KEY, 0, col(9, 9))
    assert h.snapshot[KEY].view(-1).tolist() == [1, 1]


# ---------------------------------------------------------------------------------------------- pending gradients
def taken(h, start, end, width=1, dtype=torch.float32, into=None):
    """What ``take_grad`` adds to zeros (or to ``into``) for rows ``start .. end-1``."""
    into = torch.zeros(end - start, width, dtype=dtype) if into is None else into
    h.take_grad(KEY, start, end, into)
    return into


def test_add_grad_accumulates_with_index_add_semantics():
    h = CallHistory(4, CPU)
    h.add_grad(KEY, torch.tensor([0, 2, 0]), torch.tensor([[1.0, 1.0], [2.0, 0.0], [3.0, -1.0]]))
    h.add_grad(KEY, torch.tensor([3, 2]), torch.tensor([[0.5, 0.5], [1.0, 1.0]]))
    assert taken(h, 0, 4, 2).tolist() == [[4.0, 0.0], [0.0, 0.0], [3.0, 1.0], [0.5, 0.5]]
    assert taken(h, 0, 4, into=torch.ones(4, 2)).tolist() == [[5.0, 1.0], [1.0, 1.0], [4.0, 2.0], [1.5, 1.5]]


def test_take_grad_returns_the_owners_row_range():
    h = CallHistory(4, CPU)
    h.add_grad(KEY, torch.tensor([1, 3]), col(5, 6))
    assert taken(h, 2, 4).view(-1).tolist() == [0.0, 6.0]
    assert taken(h, 1, 2).view(-1).tolist() == [5.0]


def test_take_grad_adds_nothing_when_nothing_reached_the_key():
    h = CallHistory(4, CPU)
    h.add_grad("other", torch.tensor([0]), col(1))
    assert taken(h, 0, 4).view(-1).tolist() == [0.0] * 4


def test_pending_gradients_keep_the_gradients_dtype():
    h = CallHistory(2, CPU)
    h.add_grad(KEY, torch.tensor([1]), torch.ones(1, 3, dtype=torch.float64))
    assert h.grads[KEY].dtype == torch.float64
    g = taken(h, 0, 2, 3, torch.float64)
    assert g.view(-1).tolist() == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]


def test_clear_grads_and_a_new_step_drop_pending_gradients():
    h = CallHistory(2, CPU)
    h.add_grad(KEY, torch.tensor([0]), col(1))
    h.clear_grads()
    assert taken(h, 0, 2).view(-1).tolist() == [0.0, 0.0]
    h.add_grad(KEY, torch.tensor([0]), col(1))
    h.begin_step(1, None)
    assert taken(h, 0, 2).view(-1).tolist() == [0.0, 0.0]


def test_pending_gradients_do_not_touch_the_rows():
    h = CallHistory(2, CPU)
    h.write(KEY, 0, col(1, 2))
    h.add_grad(KEY, torch.tensor([0, 1]), col(10, 10))
    assert seen(h, n=2) == [1, 2]


# ---------------------------------------------------------------------------------------------- per call
def test_each_call_of_the_model_has_its_own_history():
    store = HistoryStore(3, CPU)
    first, second = store.of(0), store.of(1)
    assert store.of(0) is first and first is not second
    first.write(KEY, 0, col(1, 1, 1))
    second.write(KEY, 0, col(2, 2, 2))
    second.add_grad(KEY, torch.tensor([0]), col(9))
    assert seen(first, n=3) == [1, 1, 1]
    assert seen(second, n=3) == [2, 2, 2]
    assert taken(first, 0, 3).view(-1).tolist() == [0.0] * 3
    assert first.num_nodes == second.num_nodes == 3 and not first.initialised


# ---------------------------------------------------------------------------------------------- checkpoints
def _filled_store():
    store = HistoryStore(3, CPU)
    a = store.of(0)
    a.write(KEY, 0, col(1, 2, 3))
    a.begin_step(0, 5)                      # snapshot [1, 2, 3]
    a.write(KEY, 0, col(4))                 # buffer [4, 2, 3]
    a.initialised = True
    b = store.of(1)
    b.write("other", 0, torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.float64))
    return store


def test_a_call_history_round_trips_buffers_snapshot_and_initialised():
    src = _filled_store().of(0)
    dst = CallHistory(3, CPU)
    dst.load_state_dict(src.state_dict())
    assert dst.initialised is True
    assert seen(dst, n=3) == [4, 2, 3]
    assert dst.snapshot[KEY].view(-1).tolist() == [1, 2, 3]
    dst.begin_step(1, 5)                    # the restored snapshot is the anchor
    assert seen(dst, n=3) == [1, 2, 3]


def test_a_loaded_history_does_not_share_memory_with_the_state():
    src = _filled_store().of(0)
    state = src.state_dict()
    dst = CallHistory(3, CPU)
    dst.load_state_dict(state)
    state["buffers"][KEY].fill_(0)
    state["snapshot"][KEY].fill_(0)
    assert seen(dst, n=3) == [4, 2, 3]
    assert dst.snapshot[KEY].view(-1).tolist() == [1, 2, 3]


def test_a_state_without_buffers_is_never_initialised():
    h = CallHistory(2, CPU)
    h.load_state_dict({"buffers": {}, "snapshot": {}, "initialised": True})
    assert h.initialised is False


def test_a_store_round_trips_every_call_through_torch_save():
    src = _filled_store()
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    dst = HistoryStore(3, CPU)
    dst.load_state_dict(torch.load(buf))
    assert sorted(dst.calls) == [0, 1]
    assert dst.of(0).initialised is True
    assert dst.of(1).initialised is False
    assert seen(dst.of(0), n=3) == [4, 2, 3]
    assert torch.equal(dst.of(1).buffers["other"], src.of(1).buffers["other"])
    assert dst.of(1).buffers["other"].dtype == torch.float64


def test_call_numbers_saved_as_strings_load_as_the_same_calls():
    state = {"calls": {str(k): v for k, v in _filled_store().state_dict()["calls"].items()}}
    dst = HistoryStore(3, CPU)
    dst.load_state_dict(state)
    assert sorted(dst.calls) == [0, 1]
    assert dst.of(0).initialised is True


def test_loading_replaces_the_histories_held_before():
    dst = HistoryStore(3, CPU)
    dst.of(5).write(KEY, 0, col(9, 9, 9))
    dst.load_state_dict(_filled_store().state_dict())
    assert sorted(dst.calls) == [0, 1]


def test_a_state_of_an_older_format_leaves_every_call_uninitialised():
    old = _filled_store().of(0).state_dict()          # {"buffers": ..., "snapshot": ..., "initialised": ...}
    dst = HistoryStore(3, CPU)
    dst.of(0).initialised = True
    dst.load_state_dict({"buffers": old["buffers"], "snapshot": old["snapshot"]})
    assert dst.calls == {}
    assert dst.of(0).initialised is False and dst.of(0).buffers == {}
    assert dst.of(1).initialised is False


def test_an_empty_or_none_calls_entry_leaves_every_call_uninitialised():
    for state in ({}, {"calls": None}, {"calls": {}}):
        dst = HistoryStore(3, CPU)
        dst.load_state_dict(state)
        assert dst.of(0).initialised is False


# ---------------------------------------------------------------------------------------------- history_dtype
def test_rows_kept_in_bf16_are_read_in_the_dtype_they_stand_for():
    h = CallHistory(4, CPU, dtype=torch.bfloat16)
    rows = torch.tensor([[1.0 + 2 ** -10, 3.0], [0.1, -7.25]])
    h.write(KEY, 1, rows)
    assert h.buffer(KEY, rows).dtype == torch.bfloat16
    got = h.read(KEY, torch.tensor([1, 2]), rows)
    assert got.dtype == torch.float32 and torch.equal(got, rows.to(torch.bfloat16).float())
    out = torch.empty(2, 2)
    assert h.read(KEY, torch.tensor([1, 2]), rows, out=out) is out and torch.equal(out, got)
    h.begin_step(0, period=2, keep_start=True)
    assert h.snapshot[KEY].dtype == torch.bfloat16
    assert torch.equal(h.read_start(KEY, torch.tensor([2]), rows), got[1:])
    h.add_grad(KEY, torch.tensor([1]), torch.ones(1, 2))
    assert h.grads[KEY].dtype == torch.float32            # gradients keep theirs
    ints = torch.tensor([[3], [4]])
    h.write("k:index", 0, ints)
    assert h.buffer("k:index", ints).dtype == torch.long  # only floating-point rows are narrowed


def test_a_checkpoint_resumed_with_another_history_dtype_keeps_rows_in_the_new_one():
    h = CallHistory(3, CPU)
    h.write(KEY, 0, torch.tensor([[1.0 + 2 ** -10], [2.0], [3.0]]))
    h.initialised = True
    buf = io.BytesIO()
    torch.save(h.state_dict(), buf)
    buf.seek(0)
    h16 = CallHistory(3, CPU, dtype=torch.bfloat16)
    h16.load_state_dict(torch.load(buf))
    assert h16.initialised and h16.buffers[KEY].dtype == torch.bfloat16
    assert seen(h16, n=3) == [1.0, 2.0, 3.0]


# ---------------------------------------------------------------------------------------------- pending parts
def test_pending_parts_sum_as_a_buffer_of_every_held_row_does_folded_or_not():
    """The one-way drain keeps the gradients of fresh reads as the rows read, one part per reader; an owner's
    backward gets zeros plus each part in the order they came, the same bits as a buffer of every held row that
    ``index_add``-s them in turn. Parts coming to more rows than the owner holds are folded into one buffer of its
    held rows on the way (so an owner never costs more), with the same result; nothing is left held after."""
    from pyg_pipe.engine.runtime.pending import Pending
    g = torch.Generator().manual_seed(0)
    held = 5
    reads = [(torch.tensor([0, 3]), 1.0), (torch.tensor([1, 3, 4]), 0.5), (torch.tensor([0, 2, 3]), 1.0)]
    grads = [torch.randn(r.numel(), 3, generator=g) for r, _ in reads]
    dense = torch.zeros(held, 3)
    for (rows, alpha), grad in zip(reads, grads):
        dense.index_add_(0, rows, grad, alpha=alpha)
    for fold_after in (None, 1):  # 2 + 3 + 3 rows > 5 held: the third part folds; held=8: never
        p = Pending()
        h = held if fold_after else 8
        for (rows, alpha), grad in zip(reads, grads):
            p.add("site", [(10, h, rows, grad)], alpha)
        assert p.peak > 0 and ((p.parts[("site", 10)][0] is not None) == bool(fold_after))
        got = p.take("site", 10, h, torch.zeros(1, 3))
        assert torch.equal(got[:held], dense) and p.bytes == 0 and not p.parts
    assert p.take("site", 10, held, torch.zeros(1, 3)) is None  # taken once
