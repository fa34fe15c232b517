"""Encode speed of localchat's RWKV World tokenizer against the reference TRIE_TOKENIZER.

Run: `python bench/bench_world_tokenizer.py [--mb-per-part 1.0] [--repeat 3]`. The corpus is built
from text already on this machine (Python's own sources for code and English, gettext catalogs
for Russian, Chinese and Japanese, Python's CJK test texts) and topped up with generated text,
so it needs no download beyond the `rwkv` wheel the tests use.
"""

from __future__ import annotations

import argparse
import gettext
import glob
import importlib.util
import random
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def _load_module(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _catalog_text(lang: str) -> str:
    """Translated messages of the gettext catalogs installed for `lang`."""
    texts = []
    for path in sorted(glob.glob(f"/usr/share/**/{lang}/LC_MESSAGES/*.mo", recursive=True)):
        try:
            with open(path, "rb") as f:
                catalog = gettext.GNUTranslations(f)
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        texts.extend(v for v in catalog._catalog.values() if isinstance(v, str))
    return "\n".join(texts)


def _python_sources() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "".join(p.read_text("utf-8", errors="replace") for p in sorted(stdlib.glob("*.py")))


def _cjk_test_texts() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((stdlib / "test" / "cjkencodings").glob("*-utf8.txt"))
    return "".join(p.read_text("utf-8", errors="replace") for p in files)


def _generated(rng: random.Random, alphabet: str, words: int) -> str:
    return " ".join(
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9))) for _ in range(words)
    )


def build_corpus(mb_per_part: float) -> dict[str, str]:
    """Corpus parts by name, each about `mb_per_part` MB of UTF-8 (repeated when short)."""
    rng = random.Random(0)
    parts = {
        "code+english (stdlib .py)": _python_sources(),
        "russian (gettext)": _catalog_text("ru"),
        "chinese (gettext)": _catalog_text("zh_CN"),
        "japanese (gettext)": _catalog_text("ja"),
        "cjk test texts": _cjk_test_texts(),
        "random unicode + emoji": _generated(
            rng,
            "".join(
                map(
                    chr,
                    [
                        *range(0x20, 0x7F),
                        *range(0x4E00, 0x4F00),
                        *range(0x1F600, 0x1F650),
                        *range(0x400, 0x450),
                    ],
                )
            ),
            200_000,
        ),
    }
    fallback = _generated(rng, "абвгдежзийклмнопрстуфхцчшщыэюя日本語中文字", 200_000)
    size = int(mb_per_part * 1e6)
    corpus = {}
    for name, text in parts.items():
        text = text or fallback
        while len(text.encode("utf-8")) < size:
            text += "\n" + text
        corpus[name] = text.encode("utf-8")[:size].decode("utf-8", errors="ignore")
    return corpus


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of `repeat` runs of `fn`, in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    """Print one row per corpus part: MB, ours and reference MB/s, speedup, equality."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb-per-part", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from localchat.engine.tokenizer_world import WorldTokenizer

    fixtures = _load_module("localchat_test_fixtures", REPO / "tests" / "fixtures.py")
    pkg = fixtures.rwkv_package_dir() / "rwkv"
    reference_module = _load_module("rwkv_reference_tokenizer", pkg / "rwkv_tokenizer.py")
    vocab = pkg / "rwkv_vocab_v20230424.txt"

    start = time.perf_counter()
    ours = WorldTokenizer(vocab)
    ours_load = time.perf_counter() - start
    start = time.perf_counter()
    ours.encode("")  # compiles the matcher
    ours_compile = time.perf_counter() - start
    start = time.perf_counter()
    reference = reference_module.TRIE_TOKENIZER(str(vocab))
    reference_load = time.perf_counter() - start

    corpus = build_corpus(args.mb_per_part)
    print(f"python {sys.version.split()[0]}, best of {args.repeat}")
    print(
        f"setup: ours {ours_load:.2f} s load + {ours_compile:.2f} s first-encode compile, "
        f"reference {reference_load:.2f} s"
    )
    header = f"{'corpus part':28} {'MB':>6} {'ours MB/s':>10} {'ref MB/s':>9} {'ratio':>6}  equal"
    print(header)
    print("-" * len(header))
    total_mb = total_ours = total_ref = 0.0
    all_equal = True
    for name, text in corpus.items():
        mb = len(text.encode("utf-8")) / 1e6
        t_ours = best_seconds(lambda t=text: ours.encode(t), args.repeat)
        t_ref = best_seconds(lambda t=text: reference.encode(t), args.repeat)
        equal = ours.encode(text) == reference.encode(text)
        all_equal &= equal
        total_mb, total_ours, total_ref = total_mb + mb, total_ours + t_ours, total_ref + t_ref
        print(
            f"{name:28} {mb:6.2f} {mb / t_ours:10.2f} {mb / t_ref:9.2f} "
            f"{t_ref / t_ours:5.2f}x  {equal}"
        )
    print("-" * len(header))
    print(
        f"{'all':28} {total_mb:6.2f} {total_mb / total_ours:10.2f} {total_mb / total_ref:9.2f} "
        f"{total_ref / total_ours:5.2f}x  {all_equal}"
    )
    if not all_equal:
        sys.exit(1)


if __name__ == "__main__":
    main()
