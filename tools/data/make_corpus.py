"""A synthetic corpus of any size for measuring `prepare`: documents cut from the embedded tiny
Shakespeare, every 5th line swapped for a line of other scripts (Greek, Cyrillic, CJK, Arabic,
Devanagari, Hangul, emoji, accented Latin) and every 50th for random code points, so the text
is not only English words a piece cache has seen.

    python tools/data/make_corpus.py OUT --megabytes 2000 [--format jsonl|jsonl.gz|txt]
                                     [--seed 0]

jsonl: OUT/corpus-000.jsonl, ... of 256 MB each, one {"text": ...} a line; txt: OUT/000/00000.txt,
... one document a file. Documents are 2 to 20 kB of UTF-8; the same seed gives the same corpus.
"""
import argparse
import gzip
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nanoandrea.data import DEFAULT_CORPUS  # noqa: E402

OTHER_SCRIPTS = [
    "Ελληνικά: η γρήγορη καφέ αλεπού πηδά πάνω από τον σκύλο.",
    "Русский: съешь же ещё этих мягких французских булок, да выпей чаю.",
    "中文：敏捷的棕色狐狸跳过了懒狗。日本語：いろはにほへと ちりぬるを。",
    "العربية: نص قصير للاختبار مع أرقام ١٢٣ و 456.",
    "हिन्दी: यह एक छोटा परीक्षण वाक्य है।", "한국어: 다람쥐 헌 쳇바퀴에 타고파.",
    "emoji 😀🎉🚀👩‍👩‍👧‍👦 🇰🇷 and marks ✓ ✗ → ∑ ∞", "naïve café déjà vu, Ångström, Øresund, ß",
]
MEGABYTE = 1_000_000


def documents(seed=0):
    """An endless stream of documents (str), the same for the same seed."""
    rng = random.Random(seed)
    lines = DEFAULT_CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)
    while True:
        start, count = rng.randrange(len(lines)), rng.randrange(40, 400)
        picked = []
        for n, line in enumerate(lines[start:start + count]):
            if n % 50 == 49:
                line = "".join(chr(rng.choice([rng.randrange(0x20, 0x7F), rng.randrange(0xA0, 0xD800),
                                                rng.randrange(0xE000, 0x10FFFF)]))
                               for _ in range(rng.randrange(5, 60))) + "\n"
            elif n % 5 == 4:
                line = rng.choice(OTHER_SCRIPTS) + "\n"
            picked.append(line)
        yield "".join(picked)


def write_corpus(out, megabytes, kind="jsonl", seed=0, file_megabytes=256):
    """Write about `megabytes` of UTF-8 text as `kind` files under out; returns (files, bytes
    of text)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written, files, file, in_file = 0, [], None, 0
    for n, document in enumerate(documents(seed)):
        if written >= megabytes * MEGABYTE:
            break
        size = len(document.encode())
        if kind == "txt":
            path = out / f"{n // 1000:03d}" / f"{n:05d}.txt"
            path.parent.mkdir(exist_ok=True)
            path.write_text(document, encoding="utf-8")
            files.append(path)
        else:
            if file is None or in_file >= file_megabytes * MEGABYTE:
                if file is not None:
                    file.close()
                path = out / f"corpus-{len(files):03d}.{kind}"
                file = (gzip.open(path, "wt", encoding="utf-8", compresslevel=1) if
                        kind == "jsonl.gz" else open(path, "w", encoding="utf-8"))
                files.append(path)
                in_file = 0
            file.write(json.dumps({"text": document}, ensure_ascii=False) + "\n")
            in_file += size
        written += size
    if file is not None:
        file.close()
    return files, written


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--megabytes", type=float, default=100)
    parser.add_argument("--format", default="jsonl", choices=["jsonl", "jsonl.gz", "txt"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    files, written = write_corpus(args.out, args.megabytes, args.format, args.seed)
    print(f"{args.out}: {len(files)} file(s), {written / MEGABYTE:,.1f} MB of text")


if __name__ == "__main__":
    main()
