"""Print a pytest-benchmark JSON as a table: median, IQR, GB/s and the ratio to the group's plain read, then a
summary of the ratios measured with interleaved calls (``baselines.interleaved_ratios``; those are the numbers to
quote: the README's speed figures come from them).

    python bench/report.py bench/out.json
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> None:
    data = json.load(open(path))
    print(f"machine: {data['machine_info'].get('cpu', {}).get('brand_raw', '?')}, "
          f"{data['machine_info'].get('cpu', {}).get('count', '?')} cores; {data['datetime']}")
    groups = defaultdict(list)
    for b in data["benchmarks"]:
        groups[b["group"]].append(b)
    for group, rows in groups.items():
        read = next((r for r in rows if r["name"].startswith("test_read")), None)
        base = read["stats"]["median"] if read else None
        print(f"\n{group}")
        print(f"{'benchmark':<44}{'median ms':>11}{'IQR ms':>9}{'GB/s':>8}{'x read':>8}")
        for r in sorted(rows, key=lambda r: r["stats"]["median"]):
            s = r["stats"]
            gbs = r["extra_info"].get("bytes", 0) / s["median"] / 1e9
            ratio = f"{s['median'] / base:>8.2f}" if base else ""
            print(f"{r['name']:<44}{s['median'] * 1e3:>11.2f}{s['iqr'] * 1e3:>9.2f}{gbs:>8.1f}{ratio}")
    summary = [(b["group"], label, value, b["extra_info"].get("rounds"))
               for b in data["benchmarks"] for label, value in b["extra_info"].get("ratios", {}).items()]
    if summary:
        print("\nSummary: ratios of calls interleaved in one loop (median over rounds; the numbers to quote)")
        print(f"{'group':<46}{'ratio':<28}{'value':>8}{'rounds':>8}")
        for group, label, value, rounds in summary:
            print(f"{group:<46}{label:<28}{value:>8.2f}{rounds:>8}")


if __name__ == "__main__":
    main(sys.argv[1])
