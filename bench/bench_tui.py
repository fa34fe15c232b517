"""Benchmark (not a test) of the terminal UI: decode tok/s of a reply streamed into the chat view
(the engine generating in this process while Textual renders every token) against `localchat
run` on the same model, prompt and settings; time to first paint from a cold `python` start
(imports included); and the app's memory with no model loaded.

    python bench/bench_tui.py [--model DIR | --quant q0f32] [--tokens 128] [--runs 3]
                              [--device cpu]

Without --model, the test fixture (tests/fixtures.py) is converted to --quant and cached. The
app runs headless (Textual's test driver, 120x40): it composes and renders as in a terminal, it
only skips writing to one. Each side runs in its own process; decode figures are the engine's
own (`ReplyStats.decode_tok_s`), medians over --runs replies after one warm-up reply.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PROMPT = "Write a long story about a dragon who learns to cook."

PAINT_CHILD = r"""
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

# argv after t0: model path, device, max tokens, replies, prompt
DECODE_CHILD = r"""
import asyncio, json, sys, time
model, device, tokens, replies, prompt = sys.argv[2:7]
tokens, replies = int(tokens), int(replies)
from localchat.tui.app import LocalchatApp
from localchat.tui.backend import LocalBackend
from localchat.tui.screens.chat import ChatScreen
from localchat.tui.settings import ChatSettings
from localchat.tui.widgets.prompt import PromptInput

async def until(pilot, cond, timeout=600):
    # A plain sleep between checks: pilot.pause() waits for the screen to go idle, work a user's
    # terminal session never does, and it would take CPU from the decoding being measured.
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise SystemExit("timed out")
        await asyncio.sleep(0.05)

async def main():
    backend = LocalBackend(device)
    app = LocalchatApp(model=model, backend=backend)
    out = []
    async with app.run_test(size=(120, 40)) as pilot:
        for i in range(replies + 1):  # the first one warms up
            if i:
                await pilot.press("ctrl+n")  # a new chat: the same prompt from scratch
            await until(pilot, lambda: isinstance(app.screen, ChatScreen)
                        and app.screen.model is not None and not app.screen.busy
                        and not app.screen.views)
            screen = app.screen
            screen.settings = ChatSettings(temperature=0.0, max_tokens=tokens)
            screen.query_one(PromptInput).load_text(prompt)
            screen.query_one(PromptInput).focus()
            await pilot.press("enter")
            await until(pilot, lambda: not screen.busy and screen.views
                        and screen.views[-1].role == "assistant"
                        and screen.views[-1].status != "streaming")
            st = screen.last_stats
            if i:
                out.append({"decode_tok_s": st.decode_tok_s, "ttft_s": st.ttft_s,
                            "completion_tokens": st.completion_tokens,
                            "ui_decode_tok_s": screen.stats.decode_tok_s})
    backend.close()
    print(json.dumps(out))

asyncio.run(main())
"""


def model_dir(args: argparse.Namespace) -> Path:
    """The model to bench: --model, else the test fixture converted to --quant."""
    if args.model:
        return Path(args.model)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import fixtures

    return fixtures.converted(fixtures.smollm2_hf_dir(), args.quant)


def python(code: str, *argv: str, env: dict[str, str]) -> str:
    """Run `code` in a fresh interpreter (t0 taken before any import); its last stdout line."""
    out = subprocess.run(
        [sys.executable, "-c", "import sys, time; t0 = time.time(); "
         "sys.argv = ['x', str(t0), *sys.argv[1:]]; exec(sys.stdin.read())", *argv],
        input=code, capture_output=True, text=True, env=env,
    )
    if out.returncode != 0:
        raise SystemExit(f"the benchmark child failed:\n{out.stderr[-3000:]}")
    return out.stdout.strip().splitlines()[-1]


def tui_decode(model: Path, args: argparse.Namespace, env: dict[str, str]) -> list[dict[str, Any]]:
    """Replies streamed into the chat view of a headless app."""
    return json.loads(python(DECODE_CHILD, str(model), args.device, str(args.tokens),
                             str(args.runs), PROMPT, env=env))


def run_decode(model: Path, args: argparse.Namespace, env: dict[str, str]) -> list[dict[str, Any]]:
    """The same prompt with `localchat run --json`, one process per reply (the first warms up
    the library cache and is dropped)."""
    exe = Path(sys.executable).parent / "localchat"
    results = []
    for i in range(args.runs + 1):
        out = subprocess.run(
            [str(exe), "run", str(model), PROMPT, "--temperature", "0", "--max-tokens",
             str(args.tokens), "--device", args.device, "--json"],
            capture_output=True, text=True, env=env)
        if out.returncode != 0:
            raise SystemExit(f"localchat run failed:\n{out.stderr[-3000:]}")
        if i:
            stats = json.loads(out.stdout.strip().splitlines()[-1])["stats"]
            results.append(stats)
    return results


def med(rows: list[dict[str, Any]], key: str) -> float:
    """The median of one field over the runs."""
    return float(statistics.median(r[key] for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the test fixture)")
    parser.add_argument("--quant", default="q0f32", help="the fixture's quantization")
    parser.add_argument("--tokens", type=int, default=128, help="max tokens per reply")
    parser.add_argument("--runs", type=int, default=3, help="measured replies / cold starts")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-decode", action="store_true", help="only paint and memory")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "LOCALCHAT_HOME": home}
        paint = [json.loads(python(PAINT_CHILD, env=env)) for _ in range(args.runs)]
        rows = [
            ("first paint, cold python (imports included)",
             f"median {med(paint, 'first_paint_s'):.3f} s, max "
             f"{max(r['first_paint_s'] for r in paint):.3f} s ({len(paint)} runs)"),
            ("models listed", f"median {med(paint, 'listed_s'):.3f} s"),
            ("memory, no model loaded", f"{paint[-1]['rss_mb']:.0f} MB max RSS "
             f"(TVM imported: {paint[-1]['tvm_loaded']})"),
        ]
        if not args.skip_decode:
            model = model_dir(args)
            tui = tui_decode(model, args, env)
            cli = run_decode(model, args, env)
            tui_tok, cli_tok = med(tui, "decode_tok_s"), med(cli, "decode_tok_s")
            rows += [
                (f"decode, TUI rendering ({args.device})",
                 f"{tui_tok:.1f} tok/s (engine), {med(tui, 'ui_decode_tok_s'):.1f} tok/s as "
                 f"drawn; TTFT {med(tui, 'ttft_s'):.3f} s; "
                 f"{med(tui, 'completion_tokens'):.0f} tokens"),
                (f"decode, `localchat run` ({args.device})",
                 f"{cli_tok:.1f} tok/s; TTFT {med(cli, 'ttft_s'):.3f} s; "
                 f"{med(cli, 'completion_tokens'):.0f} tokens"),
                ("TUI / run", f"{tui_tok / cli_tok:.2f}" if cli_tok else "–"),
            ]
            print(f"model: {model.name}, prompt: {PROMPT!r}, temperature 0, max {args.tokens} "
                  f"tokens, medians of {args.runs} replies after a warm-up\n")
    width = max(len(k) for k, _ in rows)
    print(f"| {'measure'.ljust(width)} | result |\n|{'-' * (width + 2)}|--------|")
    for key, value in rows:
        print(f"| {key.ljust(width)} | {value} |")


if __name__ == "__main__":
    main()
