"""What the experiment scripts share (robustness, privacy_tradeoff, async_vs_sync): matplotlib set up for files,
a figure finished and saved, the report written and printed."""
from __future__ import annotations

import os

from .._optional import require


def pyplot(feature: str):
    """matplotlib.pyplot on the file-only Agg backend (a one-line error naming the extra when it is missing)."""
    require("matplotlib", "sim", feature)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str, *, legend_ax=None) -> None:
    """Legend (on ``legend_ax`` when given), tight layout, PNG at 110 dpi, figure closed."""
    import matplotlib.pyplot as plt

    if legend_ax is not None:
        legend_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: str, name: str, lines: list) -> str:
    """``lines`` joined into ``out/name`` and printed; returns the text."""
    text = "\n".join(lines)
    with open(os.path.join(out, name), "w") as f:
        f.write(text)
    print(text)
    return text
