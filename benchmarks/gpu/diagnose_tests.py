"""Why two GPU tests failed in the seventh GPU run (one H100): prints only.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/gpu/diagnose_tests.py

1. ``test_gradients_kept_in_host_memory_give_the_device_sums_bit_for_bit[*-cuda]``: is the device run itself
   reproducible (the same training twice, every buffer on the device)? CUDA's ``index_add_`` and PyG's scatter add
   with atomics, in no fixed order; and with ``torch.use_deterministic_algorithms`` on, is the host tier then bit
   for bit the device's?
2. ``test_captured_training_equals_uncaptured[gcnii-adj_t-True-recomputed]``: the capture failed with "operation
   failed due to a previous error during capture", so an earlier failure inside the capture was swallowed. Every
   exception raised while the stream captures is recorded (``sys.monitoring``, Python 3.12), with where it was
   raised; also as a pytest plugin, for the test in the order the suite runs it (below).
"""
from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402


def _train(name: str, tier, deterministic: bool):
    from tests.engine.test_stream import three_steps
    return three_steps(name, "cuda", tier, deterministic)[0]


def _gap(a, b) -> str:
    d = max(float((p - q).abs().max()) for p, q in zip(a, b))
    return f"max |diff| {d:.3g}, bit for bit: {all(torch.equal(p, q) for p, q in zip(a, b))}"


def tiers() -> None:
    from tests.engine.test_stream import EXACT
    for name in EXACT:
        for det in (False, True):
            try:
                dev1, dev2, host = _train(name, None, det), _train(name, None, det), _train(name, "host", det)
                print(f"[tiers] {name} deterministic={det}: device vs device: {_gap(dev1, dev2)}; "
                      f"device vs host tier: {_gap(dev1, host)}", flush=True)
            except Exception as exc:  # noqa: BLE001 - a diagnosis prints what it finds
                print(f"[tiers] {name} deterministic={det}: {type(exc).__name__}: {exc}", flush=True)


def _monitor(raised: list) -> None:
    """Records in ``raised`` every exception raised while the current stream captures a CUDA graph (but the
    streaming's own barrier signal, which is control flow), with the stack where it was raised (at most 12)."""
    mon = getattr(sys, "monitoring", None)
    if mon is None:
        print("(no sys.monitoring before Python 3.12: exceptions inside the capture are not recorded)")
        return
    tool = mon.DEBUGGER_ID
    mon.use_tool_id(tool, "diagnose")

    def on_raise(code, offset, exc):
        if len(raised) < 12 and type(exc).__name__ != "_Barrier" and torch.cuda.is_current_stream_capturing():
            raised.append((f"{type(exc).__name__}: {str(exc)[:300]}", "".join(traceback.format_stack(limit=16)[:-1])))
    mon.register_callback(tool, mon.events.RAISE, on_raise)
    mon.set_events(tool, mon.events.RAISE)


RAISED: list = []


def capture() -> None:
    from tests.engine.test_capture import _adj_t, _both
    from tests.models import gcnii
    _monitor(RAISED)
    for recompute in (True, False):
        RAISED.clear()
        torch.set_default_dtype(torch.float64)
        try:
            runs = _both(lambda: gcnii(8, 12, 3, 4), _adj_t, fused=True, recompute=recompute)
            c = runs[1][2]
            print(f"[capture] recompute={recompute}: off={c.off!r} captures={c.captures} replays={c.replays}",
                  flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"[capture] recompute={recompute}: {type(exc).__name__}: {exc}", flush=True)
        finally:
            torch.set_default_dtype(torch.float32)
        _print_raised(print)


def _print_raised(say) -> None:
    for i, (what, where) in enumerate(RAISED[:6]):
        say(f"  raised while capturing #{i}: {what}\n{where}")


# as a pytest plugin (``python -m pytest -m gpu tests/engine/test_capture.py -p benchmarks.gpu.diagnose_tests``): the
# exceptions raised inside captures, printed after each test that failed (into RAISED_LOG, default stdout)
def pytest_configure(config) -> None:
    _monitor(RAISED)


def pytest_runtest_setup(item) -> None:
    RAISED.clear()


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" and report.failed:
        path = os.environ.get("RAISED_LOG")
        with (open(path, "a") if path else open(os.dup(1), "w")) as f:
            f.write(f"{report.nodeid}: {len(RAISED)} exceptions raised while capturing\n")
            _print_raised(lambda line: f.write(line + "\n"))


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("benchmarks/gpu/diagnose_tests.py: no CUDA device here; nothing to run.")
        sys.exit(0)
    which = sys.argv[1:] or ["capture", "tiers"]
    if "capture" in which:
        capture()
    if "tiers" in which:
        tiers()
