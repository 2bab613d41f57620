"""Plots of a bench/serve.py run, every mode on the same axes: output throughput, goodput, attainment, sheds, TTFT, ITL
against the request rate (Poisson points) and against concurrency (closed-loop points).

    python bench/serve_plot.py bench/out/serve_X.json      # or: python bench/serve.py --plot-only FILE

Writes serve_X_rate.png and serve_X_concurrency.png beside the JSON (only the kinds of points the run
has). Needs matplotlib; without it, says so and draws nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["plot_file"]

_KINDS = {"rate": "request rate (req/s, Poisson)", "concurrency": "concurrency (closed loop)"}


def _series(points: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    # A rate of inf (every request at once) has no place on a rate axis: its point is left out.
    return sorted((p for p in points if p.get("kind") == kind and p.get("value") is not None), key=lambda p: p["value"])


def _plot_kind(result: dict[str, Any], kind: str, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = {m: _series(r.get("points") or [], kind) for m, r in result["modes"].items()}
    modes = {m: pts for m, pts in modes.items() if pts}
    if not modes:
        return False
    fig, axes = plt.subplots(3, 2, figsize=(12, 12))
    (ax_tput, ax_goodput), (ax_good, ax_shed), (ax_ttft, ax_itl) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    offline = (result.get("offline") or {}).get("output_tok_per_s")
    for i, (mode, pts) in enumerate(modes.items()):
        c = colors[i % len(colors)]
        x = [p["value"] for p in pts]
        ax_tput.plot(x, [p["output_tok_per_s"] for p in pts], "o-", color=c, label=mode)
        ax_good.plot(x, [p["goodput"]["fraction"] for p in pts], "o-", color=c, label=mode)
        ax_goodput.plot(x, [p["goodput"]["request_per_s"] for p in pts], "o-", color=c, label=mode)
        ax_shed.plot(x, [p.get("http_status", {}).get("429", 0) for p in pts], "o-", color=c, label=mode)
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax_ttft.plot(x, [p["ttft_ms"][q] for p in pts], style, color=c, label=f"{mode} {q}")
            ax_itl.plot(x, [p["itl_ms"][q] for p in pts], style, color=c, label=f"{mode} {q}")
    if offline:  # the ceiling: the offline engine once per device the modes use
        for devices in sorted({result["modes"][m].get("devices", 1) for m in modes}):
            ax_tput.axhline(offline * devices, color="grey", ls=":", lw=1, label=f"offline engine x {devices}")
    slo = result["config"].get("slo", {})
    if slo.get("ttft_ms"):
        ax_ttft.axhline(slo["ttft_ms"], color="grey", ls=":", lw=1, label="SLO")
    if slo.get("itl_p99_ms"):
        ax_itl.axhline(slo["itl_p99_ms"], color="grey", ls=":", lw=1, label="SLO (per-request p99)")
    ax_tput.set_ylabel("output tokens/s")
    ax_good.set_ylabel("attainment (good / requests sent)")
    ax_goodput.set_ylabel("goodput (good requests/s)")
    ax_shed.set_ylabel("429 answers (shed, retries included)")
    ax_good.set_title(
        f"good: TTFT <= {slo.get('ttft_ms', 0):g} ms and per-request ITL p99 <= {slo.get('itl_p99_ms', 0):g} ms",
        fontsize=9,
    )
    ax_good.set_ylim(-0.02, 1.05)
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_itl.set_ylabel("ITL (ms)")
    for ax in (ax_ttft, ax_itl):
        ax.set_yscale("log")
    for ax in axes.flat:
        ax.set_xlabel(_KINDS[kind])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    cfg = result["config"]
    gpus = ",".join(cfg.get("gpus") or []) or "cpu"
    fig.suptitle(
        f"{cfg.get('model')} ({gpus}), {cfg.get('num')} requests/point, prompts {cfg.get('prompt_len')}, "
        f"outputs {cfg.get('output_len')}, commit {(result.get('git') or {}).get('commit', '')[:8]}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_file(json_path: Path) -> list[str]:
    """Draws the plots of one run; returns lines to print (what was written, or why nothing was)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ["plots skipped: matplotlib is not installed (pip install matplotlib, then --plot-only FILE)"]
    result = json.loads(Path(json_path).read_text())
    lines = []
    for kind in _KINDS:
        png = json_path.with_name(f"{json_path.stem}_{kind}.png")
        if _plot_kind(result, kind, png):
            lines.append(f"wrote {png}")
    return lines or ["plots skipped: no point with a finite rate or a concurrency to place on an axis"]


if __name__ == "__main__":
    for line in plot_file(Path(sys.argv[1])):
        print(line)
