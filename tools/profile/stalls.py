"""Where a kernel's warps wait, instruction by instruction: a summary of Nsight Compute's
warp-state samples from the source page of one profiled launch, exported as CSV.

    ncu --clock-control none -k regex:wgmma --launch-skip 2 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters -o stalls -f \\
        python3 tools/profile/run_once.py matmul --precision bf16 --epilogue gelu
    ncu -i stalls.ncu-rep --page source --csv --print-source sass > stalls.csv
    python3 tools/profile/stalls.py stalls.csv

A sample names the instruction a warp is at and why it did not issue (or that it did). The
summary adds them up by the kind of instruction (the tensor cores' HGMMA and their waits, the
mbarrier waits of the copy engine's stages, the named barriers, the special-function unit,
shared-memory stores, ...) and lists the instructions with the most, each with its stall
reasons: enough to tell a mainloop that waits on its copies from an epilogue that waits on its
barriers or its MUFU. The column names are matched loosely, as Nsight Compute's versions
spell them differently; every column the file has is listed first.
"""
import argparse
import csv
import re
import sys
from collections import defaultdict

KINDS = (                       # (kind, opcodes that start with one of these), first match
    ("tensor cores", ("HGMMA", "WARPGROUP")),
    ("mbarrier waits", ("SYNCS",)),
    ("named barriers", ("BAR",)),
    ("special-function unit", ("MUFU",)),
    ("shared stores", ("STS", "STSM")),
    ("shared loads", ("LDS", "LDSM")),
    ("global loads", ("LDG",)),
    ("copy engine", ("UTMA", "UBLKCP", "UTMASTG", "UTMALDG", "UTMACMDFLUSH")),
    ("branches", ("BRA", "BSYNC", "BSSY", "WARPSYNC", "EXIT", "NANOSLEEP", "YIELD")),
    ("float32 math", ("FFMA", "FMUL", "FADD", "FMNMX", "F2FP", "FSETP", "FSEL")),
)


def rows_of(path):
    """The source page's table: (header, rows), skipping anything before the header line."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines)
                  if "Source" in line and ("Address" in line or "#" in line)), None)
    if start is None:
        sys.exit(f"{path}: no header with 'Source' and 'Address' (not a --page source csv?)")
    table = list(csv.reader(lines[start:]))
    return table[0], [row for row in table[1:] if len(row) == len(table[0])]


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def column(header, *words):
    """The first column whose name holds all of `words` (any case), or None."""
    for i, name in enumerate(header):
        if all(w.lower() in name.lower() for w in words):
            return i
    return None


def kind_of(source):
    op = re.sub(r"^@!?U?P\w+\s+", "", source.strip()).split(" ")[0]
    for kind, prefixes in KINDS:
        if op.startswith(prefixes):
            return kind
    return "other"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    header, rows = rows_of(args.csv)
    print(f"columns: {' | '.join(header)}")
    source = column(header, "source")
    address = column(header, "address")
    samples = next((i for i in (column(header, "sampling", "all"), column(header, "samples"),
                                column(header, "stall")) if i is not None), None)
    if source is None or samples is None:
        sys.exit("no source or warp-sampling column")
    reasons = [i for i, name in enumerate(header) if i != samples
               and re.search(r"stall|sampl", name, re.I) and "not-issued" not in name.lower()]
    total = sum(number(row[samples]) for row in rows) or 1.0
    print(f"{len(rows)} instructions, {total:.0f} samples ({header[samples]})")
    by_kind = defaultdict(float)
    for row in rows:
        by_kind[kind_of(row[source])] += number(row[samples])
    for kind, n in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:24s} {n:10.0f}  {100 * n / total:5.1f}%")
    print(f"the {args.top} instructions with the most samples:")
    for row in sorted(rows, key=lambda r: -number(r[samples]))[:args.top]:
        n = number(row[samples])
        why = sorted(((number(row[i]), header[i]) for i in reasons if number(row[i]) > 0),
                     reverse=True)[:3]
        where = row[address] if address is not None else ""
        print(f"  {where:>8s} {100 * n / total:5.1f}%  {row[source].strip()[:60]:60s} "
              + ", ".join(f"{name} {100 * v / n:.0f}%" for v, name in why if n))


if __name__ == "__main__":
    main()
