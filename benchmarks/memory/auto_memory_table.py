"""``num_chunks="auto"`` under ``memory_budget``: the first step's estimate (made before it) against the memory
model's counted peak of the same step after it (:mod:`pyg_pipe.engine.plan.memory_cost`) and the budget, from the
JSON files of ``benchmarks/speed/gnnpipe_epoch.py --chunks auto --recompute on --memory-budget B --out F``.

    python benchmarks/memory/auto_memory_table.py docs/results/auto_memory/*.json

Prints one Markdown row per file: the time model's count, the count chosen, the estimate, and per rank the
counted peak after the first step (resident + state + activations + transient, replaying) and estimate ÷ it.
"""
import json
import re
import sys

MB = 2 ** 20


def row(path: str) -> str:
    r = json.load(open(path))
    s = r["setting"]
    ranks = r["gnnpipe_cauto"]
    notes = ranks[0]["notes"]
    timed = next(int(m.group(1)) for n in notes for m in [re.search(r"'auto': (\d+) chunks? \(", n)] if m)
    line = next(n for n in notes if "the first step with" in n)
    chosen = int(re.search(r"the first step with (\d+) chunks", line).group(1))
    budget = int(re.search(r"room for (\d+) MB", line).group(1))
    fits = "fits" if ": it fits" in line else "does not fit"
    checks = ranks[0]["memory_check"]["ranks"]
    est = checks[0]["first_step_estimate_bytes"]
    counted = [c["replay_peak_bytes"] - c["other_bytes"] for c in checks]
    return (f"| {s['model']}, {s['graph']}, {s['procs']} processes | {budget} | {timed} | {chosen} ({fits}) | "
            f"{est / MB:.0f} | {' / '.join(f'{c / MB:.0f}' for c in counted)} | "
            f"{' / '.join(f'{est / c:.2f}' for c in counted)} |")


if __name__ == "__main__":
    print("| setting | budget MB | time model's count | chosen | estimate MB | counted after the step, per rank | "
          "estimate ÷ counted |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for p in sys.argv[1:]:
        print(row(p))
