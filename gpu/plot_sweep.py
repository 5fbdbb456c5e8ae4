"""Plot a dyn-disable sweep (results_big.json from gpu/dyn_device.py) as an SVG, stdlib only.

Usage: python3 gpu/plot_sweep.py RESULTS_JSON OUT_SVG [TITLE]
Total output tok/s against concurrency (log2 x axis), one line per server profile.
"""
import json
import math
import sys

COLORS = {"baseline": "#222222", "baseline-nooverlap": "#999999", "eagle3": "#1f77b4",
          "eagle3-dyn": "#d62728", "eagle3-v2": "#2ca02c", "eagle3-v2-dyn": "#ff7f0e"}


def main(src, dst, title="total output tok/s vs concurrency"):
    sweep = json.load(open(src))["sweep"]
    series = {n: [(r["conc"], r["out_tok_per_s"]) for r in rows if "out_tok_per_s" in r]
              for n, rows in sweep.items() if rows}
    W, H, L, R, T, B = 760, 440, 70, 170, 40, 50
    xs = sorted({c for pts in series.values() for c, _ in pts})
    ymax = max(v for pts in series.values() for _, v in pts) * 1.08
    fx = lambda c: L + (math.log2(c) - math.log2(xs[0])) / max(1e-9, math.log2(xs[-1]) - math.log2(xs[0])) * (W - L - R)
    fy = lambda v: H - B - v / ymax * (H - T - B)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{L}" y="22" font-size="14">{title}</text>',
           f'<line x1="{L}" y1="{H-B}" x2="{W-R}" y2="{H-B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H-B}" stroke="black"/>']
    for c in xs:
        out.append(f'<text x="{fx(c):.1f}" y="{H-B+18}" text-anchor="middle">{c}</text>')
    out.append(f'<text x="{(L+W-R)/2:.0f}" y="{H-10}" text-anchor="middle">concurrency</text>')
    step = 10 ** math.floor(math.log10(ymax / 5))
    step *= 2 if ymax / step > 10 else 1
    v = 0
    while v <= ymax:
        out.append(f'<text x="{L-6}" y="{fy(v)+4:.1f}" text-anchor="end">{int(v)}</text>')
        out.append(f'<line x1="{L}" y1="{fy(v):.1f}" x2="{W-R}" y2="{fy(v):.1f}" stroke="#eee"/>')
        v += step
    for k, (name, pts) in enumerate(series.items()):
        color = COLORS.get(name, "#8c564b")
        path = " ".join(f"{fx(c):.1f},{fy(val):.1f}" for c, val in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for c, val in pts:
            out.append(f'<circle cx="{fx(c):.1f}" cy="{fy(val):.1f}" r="3" fill="{color}"/>')
        y = T + 18 * k
        out.append(f'<line x1="{W-R+10}" y1="{y}" x2="{W-R+30}" y2="{y}" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{W-R+35}" y="{y+4}">{name}</text>')
    out.append("</svg>")
    open(dst, "w").write("\n".join(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
