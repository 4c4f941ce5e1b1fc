"""The training log (JSON) and its plot: loss and per-position acceptance curves.

  python -m specsplit.training.report runs/head/train_log.json   # redraw the PNG from a log
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write_log(path: Path, log: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(log, indent=1))
    tmp.replace(path)


def plot(log: dict, png: Path) -> bool:
    """Draw the curves; False (and a note on stderr) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no plot (redraw later with python -m specsplit.training.report)",
              file=sys.stderr)
        return False
    train, val = log["history"]["train"], log["history"]["val"]
    if not train:
        return False
    k = len(train[0]["acc_k"])
    steps = [r["step"] for r in train]
    colors = plt.cm.viridis([i / max(k - 1, 1) for i in range(k)])
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    ax.plot(steps, [r["loss"] for r in train], color="black", lw=2, label="weighted total")
    for i in range(k):
        ax.plot(steps, [r["loss_k"][i] for r in train], color=colors[i], lw=1, label=f"step {i} (position {i + 1})")
    ax.set(xlabel="training step", ylabel="loss", title="TTT loss per unrolled step", yscale="log")
    ax.legend(fontsize=7, ncol=2)
    ax = axes[1]
    for i in range(k):
        ax.plot(steps, [r["acc_k"][i] for r in train], color=colors[i], lw=1, label=f"position {i + 1}")
        if val:
            ax.plot([r["step"] for r in val], [r["acc_k"][i] for r in val], "o", color=colors[i], ms=3)
    ax.set(xlabel="training step", ylabel="acceptance (argmax match)", ylim=(0, 1),
           title="per-position acceptance (lines: train, dots: held out)")
    ax.legend(fontsize=7, ncol=2)
    ax = axes[2]
    last = val[-1] if val else train[-1]
    xs = range(1, k + 1)
    ax.bar([x - 0.2 for x in xs], last["acc_k"], width=0.4, label="per position")
    ax.bar([x + 0.2 for x in xs], last["chain_k"], width=0.4, label="chained (all before accepted)")
    ax.set(xlabel="draft position", ylabel="rate", ylim=(0, 1), xticks=list(xs),
           title=f"final ({'held out' if val else 'train'}): tau at {k} steps ~ {last['tau_est']:.2f}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    path = Path(sys.argv[1])
    png = path.with_name("train_curves.png")
    if plot(json.loads(path.read_text()), png):
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
