"""What a replay matrix did, for people: a terminal table, a JSON document, PNG plots, and the target checks.

Every number comes from ``RunResult`` rows; nothing is recomputed here. Shares are of prompt tokens
(HBM + pool + recomputed = 1 exactly in every row); ``pool GB/s`` is real bytes read from the real pool over the
wall time spent in ``batch_get_into``; TTFT is simulated (cost model, including queueing at the rank).
Plots use matplotlib's Agg backend (no display needed): ``shares.png`` stacks the three shares per run, grouped
by concurrency; ``ttft.png`` draws TTFT p50 (solid) and p90 (dashed) per router against concurrency.
Cost: O(rows).
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from umbp.workload.replay import RunResult

COLORS = {"hbm": "#2f7ed8", "pool": "#8bbc21", "recomputed": "#d94a38"}


def label(r: RunResult) -> str:
    return f"{r.router} {'+pool' if r.use_pool else 'no pool'}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _secs(x: float) -> str:
    return f"{x:.1f}s" if x >= 1 else f"{1000 * x:.0f}ms"


def table(rows: Sequence[RunResult], title: str = "umbp replay"):
    from rich.table import Table

    if rows and all(r.blocks for r in rows):
        return block_table(rows, title)
    t = Table(title=title)
    for col, just in (("conc", "right"), ("router", "left"), ("pool", "left"), ("HBM", "right"),
                      ("pool", "right"), ("recomp", "right"), ("cached", "right"), ("pool GB/s", "right"),
                      ("evicted", "right"), ("TTFT p50", "right"), ("TTFT p90", "right")):
        t.add_column(col, justify=just)
    last_c = None
    for r in rows:
        if last_c is not None and r.concurrency != last_c:
            t.add_section()
        last_c = r.concurrency
        t.add_row(str(r.concurrency), r.router, "yes" if r.use_pool else "no", _pct(r.share("hbm")),
                  _pct(r.share("pool")), _pct(r.share("recomputed")), _pct(r.cached_share),
                  f"{r.pool_gbps:.2f}" if r.use_pool else "-", str(r.pages_evicted) if r.use_pool else "-",
                  _secs(r.ttft_p50_s), _secs(r.ttft_p90_s))
    return t


def block_table(rows: Sequence[RunResult], title: str):
    """Rows of a trace with blocks (Mooncake format): block hit rates against the trace's infinite-cache ceiling,
    and the simulated prefill time the caches saved."""
    from rich.table import Table

    t = Table(title=title, show_edge=False)  # 12 columns: fits 118 characters (the JSON has pool GB/s)
    for i, col in enumerate(("router", "pool", "HBM", "pool", "recomp", "cached", "ceiling", "of ceil",
                             "saved", "evicted", "TTFT p50", "TTFT p90")):
        t.add_column(col, justify="left" if i < 2 else "right", no_wrap=True)
    for r in rows:
        cached = r.hbm_blocks + r.pool_blocks
        t.add_row(r.router, "yes" if r.use_pool else "no", _pct(r.block_share("hbm")), _pct(r.block_share("pool")),
                  _pct(r.block_share("recomputed")), _pct(cached / r.blocks), _pct(r.block_share("ceiling")),
                  _pct(cached / r.ceiling_blocks) if r.ceiling_blocks else "-", _pct(r.prefill_saved),
                  str(r.pages_evicted) if r.use_pool else "-",
                  _secs(r.ttft_p50_s), _secs(r.ttft_p90_s))
    return t


def block_targets(rows: Sequence[RunResult]) -> list[dict]:
    """Checks for block rows: accounting exact, and per router what the pool adds over the local caches."""
    out = [{"target": "block accounting exact in every row (HBM + pool + recomputed = blocks)",
            "met": all(r.hbm_blocks + r.pool_blocks + r.recomputed_blocks == r.blocks for r in rows),
            "detail": f"{sum(r.blocks for r in rows)} blocks in {len(rows)} runs"},
           {"target": "token accounting exact in every row (HBM + pool + recomputed = prompt)",
            "met": all(r.hbm_tokens + r.pool_tokens + r.recomputed_tokens == r.prompt_tokens for r in rows),
            "detail": f"{sum(r.requests for r in rows)} requests checked one by one"}]
    for router in dict.fromkeys(r.router for r in rows):
        on = [r for r in rows if r.router == router and r.use_pool]
        off = [r for r in rows if r.router == router and not r.use_pool]
        if not (on and off):
            continue
        a, b = off[0], on[0]
        ca, cb = (a.hbm_blocks + a.pool_blocks) / a.blocks, (b.hbm_blocks + b.pool_blocks) / b.blocks
        out.append({"target": f"{router}: the pool caches at least what local HBM caches alone do",
                    "met": cb >= ca, "detail": f"HBM only {_pct(ca)}, with the pool {_pct(cb)}, ceiling "
                                               f"{_pct(b.block_share('ceiling'))}; prefill saved "
                                               f"{_pct(a.prefill_saved)} -> {_pct(b.prefill_saved)}"})
    return out


def targets(rows: Sequence[RunResult], recompute_max: float = 0.03, match_rel: float = 0.02) -> list[dict]:
    """The issue's targets, each with ``met`` (True/False/None when the rows cannot tell) and the numbers."""
    if rows and all(r.blocks for r in rows):
        return block_targets(rows)
    out = []
    rr = sorted((r for r in rows if r.router == "round-robin" and r.use_pool), key=lambda r: r.concurrency)
    if len(rr) >= 2:
        pool = [r.share("pool") for r in rr]
        hbm = [r.share("hbm") for r in rr]
        met = all(b > a for a, b in zip(pool, pool[1:])) and all(b < a for a, b in zip(hbm, hbm[1:]))
        out.append({"target": "round-robin with the pool: pool share grows with concurrency, HBM share falls",
                    "met": met, "detail": ", ".join(f"c{r.concurrency}: HBM {_pct(h)} pool {_pct(p)}"
                                                   for r, h, p in zip(rr, hbm, pool))})
    else:
        out.append({"target": "pool share grows with concurrency", "met": None,
                    "detail": "needs round-robin with the pool at two or more concurrencies"})
    pooled = [r for r in rows if r.use_pool]
    if pooled:
        worst = max(pooled, key=lambda r: r.share("recomputed"))
        out.append({"target": f"recomputed under {_pct(recompute_max)} with the pool",
                    "met": worst.share("recomputed") < recompute_max,
                    "detail": f"worst: {_pct(worst.share('recomputed'))} ({label(worst)}, c{worst.concurrency}); "
                              f"of which new tokens (no cache could serve): "
                              f"{_pct(1 - worst.share('ideal'))}"})
    pairs = []
    for r in rr:
        aff = [a for a in rows if a.router == "affinity" and a.use_pool and a.concurrency == r.concurrency]
        if aff:
            pairs.append((r, aff[0]))
    if pairs:
        met = all(abs(r.cached_share - a.cached_share) <= match_rel * a.cached_share for r, a in pairs)
        out.append({"target": f"round-robin with the pool within {_pct(match_rel)} of affinity in tokens served "
                              f"from cache", "met": met,
                    "detail": ", ".join(f"c{r.concurrency}: {_pct(r.cached_share)} vs {_pct(a.cached_share)}"
                                        for r, a in pairs)})
    out.append({"target": "token accounting exact in every row (HBM + pool + recomputed = prompt)",
                "met": all(r.hbm_tokens + r.pool_tokens + r.recomputed_tokens == r.prompt_tokens for r in rows),
                "detail": f"{sum(r.requests for r in rows)} requests checked one by one"})
    return out


def write_json(path: str, payload: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=1, sort_keys=True, default=str)
        fh.write("\n")
    os.replace(tmp, path)


def _configs(rows: Sequence[RunResult]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        seen.setdefault(label(r), None)
    return list(seen)


def plot_shares(rows: Sequence[RunResult], path: str, title: str = "Where prompt tokens came from") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concs = sorted({r.concurrency for r in rows})
    configs = _configs(rows)
    blocks = bool(rows) and all(r.blocks for r in rows)  # a trace with blocks: block shares, ceiling marked
    width = 0.8 / max(1, len(configs))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.9 * len(concs) * max(1, len(configs)) / 2), 4.8))
    for j, cfg in enumerate(configs):
        for i, c in enumerate(concs):
            rs = [r for r in rows if r.concurrency == c and label(r) == cfg]
            if not rs:
                continue
            r = rs[0]
            x = i + (j - (len(configs) - 1) / 2) * width
            bottom = 0.0
            if blocks:
                ax.hlines(100 * r.block_share("ceiling"), x - width / 2, x + width / 2, colors="black",
                          linestyles="dashed", label="ceiling" if (i == 0 and j == 0) else None)
            for part in ("hbm", "pool", "recomputed"):
                v = 100 * (r.block_share(part) if blocks else r.share(part))
                ax.bar(x, v, width * 0.92, bottom=bottom, color=COLORS[part],
                       label=part if (i == 0 and j == 0) else None)
                bottom += v
            ax.text(x, 101, cfg.replace(" ", "\n"), ha="center", va="bottom", fontsize=6, rotation=0)
    ax.set_xticks(range(len(concs)), [f"{c} sessions" if c else "open loop (trace timestamps)" for c in concs])
    ax.set_ylabel("% of prompt blocks" if blocks else "% of prompt tokens")
    ax.set_ylim(0, 118)
    ax.set_title(title.replace("tokens", "blocks") if blocks else title)
    if blocks:  # the bars' low parts differ by router: keep the legend off them
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), fontsize=8, ncols=4)
    else:
        ax.legend(loc="lower left", fontsize=8, ncols=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ttft(rows: Sequence[RunResult], path: str, title: str = "Simulated TTFT per router") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.6, 4.4))
    if len({r.concurrency for r in rows}) == 1:  # one load level (an open-loop trace): p50 and p90 bars per run
        names = _configs(rows)
        for j, cfg in enumerate(names):
            r = next(r for r in rows if label(r) == cfg)
            ax.bar(j - 0.2, r.ttft_p50_s, 0.4, color="C0", label="p50" if j == 0 else None)
            ax.bar(j + 0.2, r.ttft_p90_s, 0.4, color="C1", label="p90" if j == 0 else None)
        ax.set_xticks(range(len(names)), [n.replace(" ", "\n") for n in names], fontsize=7)
        ax.set_ylabel("TTFT, simulated seconds")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return
    for j, cfg in enumerate(_configs(rows)):
        rs = sorted((r for r in rows if label(r) == cfg), key=lambda r: r.concurrency)
        xs = [r.concurrency for r in rs]
        color = f"C{j}"
        ax.plot(xs, [r.ttft_p50_s for r in rs], "-o", color=color, label=f"{cfg} p50")
        ax.plot(xs, [r.ttft_p90_s for r in rs], "--", marker="x", color=color, label=f"{cfg} p90")
    ax.set_xlabel("sessions in flight (concurrency)")
    ax.set_ylabel("TTFT, simulated seconds")
    ax.set_yscale("log")
    ax.set_xticks(sorted({r.concurrency for r in rows}))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
