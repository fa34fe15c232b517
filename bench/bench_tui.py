"""Benchmark (not a test) of the terminal UI: time to first paint from a cold `python` start
(imports included) and the app's memory with no model loaded.

    python bench/bench_tui.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import asyncio, json, resource, sys, time
t0 = float(sys.argv[1])
from localchat.tui.app import LocalchatApp
from localchat.tui.screens.models import ModelsScreen
from textual.widgets import DataTable

async def main():
    app = LocalchatApp()
    async with app.run_test(size=(120, 40)) as pilot:
        while not (isinstance(app.screen, ModelsScreen)
                   and app.screen.query_one(DataTable).region.height > 0):
            await pilot.pause(0.005)
        painted = time.time() - t0
        while not app.screen.loaded:
            await pilot.pause(0.01)
        listed = time.time() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"first_paint_s": painted, "listed_s": listed, "rss_mb": rss,
                      "tvm_loaded": "tvm" in sys.modules}))

asyncio.run(main())
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as home:
        for _ in range(args.runs):
            out = subprocess.run(
                [sys.executable, "-c", "import sys, time; t0 = time.time(); "
                 "sys.argv = ['x', str(t0)]; exec(sys.stdin.read())"],
                input=CHILD, capture_output=True, text=True, check=True,
                env={**__import__("os").environ, "LOCALCHAT_HOME": home},
            )
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    paint = [r["first_paint_s"] for r in results]
    listed = [r["listed_s"] for r in results]
    print(f"first paint (cold python, imports included): median {statistics.median(paint):.3f} s"
          f", max {max(paint):.3f} s over {len(paint)} runs")
    print(f"models listed: median {statistics.median(listed):.3f} s")
    print(f"memory with no model loaded: {results[-1]['rss_mb']:.0f} MB max RSS; "
          f"TVM imported: {results[-1]['tvm_loaded']}")


if __name__ == "__main__":
    main()
