"""Corpora as they come: .txt files, .jsonl / .jsonl.gz lines, parquet rows, streamed in parts.

A corpus is a file or a folder (its .txt, .jsonl, .jsonl.gz and .parquet files, recursively, in
sorted order). A document is a .txt file, a .jsonl line's text field, or a parquet row's.
`Corpus.segments()` streams the documents as segments of at most about BLOCK characters:

    (text, start, ends)   start: "auto" where a document begins, None where it goes on, or
                          "train" / "val" where a one-document corpus changes split
                          ends:  whether the document ends with this segment

A long .txt file is cut only where GPT-2's pre-tokenizer cuts too (tokenizer.cut_before), so its
segments encode one by one to the ids of the whole file. So memory holds a few blocks whatever
the corpus's size. `Corpus.sample(limit)` is up to `limit` characters taken from windows spread
evenly through the corpus, for training a tokenizer without reading everything.
"""
import codecs
import gzip
import json
import zlib
from pathlib import Path

from .tokenizer import cut_before

BLOCK = 1 << 20                      # characters a .txt file is read in
LONGEST_UNCUT = 8 * BLOCK            # a document with no place to cut is cut here all the same
SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
SAMPLE_WINDOWS = 64                  # places in the corpus a tokenizer's sample comes from
VAL_FRACTION = 0.1                   # of the tokens held out for val (data.py)


class DataError(ValueError):
    """Bad data input; the message is one line a user can act on."""


def file_format(path) -> str | None:
    name = Path(path).name.lower()
    return next((suffix[1:] for suffix in SUFFIXES if name.endswith(suffix)), None)


def corpus_files(source) -> list[tuple[Path, str]]:
    """(path, format) of each file of a corpus; a single file without a known suffix is text."""
    source = Path(source)
    if not source.exists():
        raise DataError(f"data not found: {source}")
    if source.is_file():
        return [(source, file_format(source) or "txt")]
    files = sorted(p for p in source.rglob("*") if p.is_file() and file_format(p))
    if not files:
        raise DataError(f"no text in the folder {source} (no {', '.join(SUFFIXES)} files)")
    return [(p, file_format(p)) for p in files]


def _unreadable(path, error) -> DataError:
    reason = error.strerror if isinstance(error, OSError) and error.strerror else error
    return DataError(f"cannot read {path}: {reason}")


class Corpus:
    """A corpus's documents, streamed; what was read (bytes), skipped and replaced is counted."""

    def __init__(self, source, text_field="text", strict=False):
        self.source = source
        self.files = corpus_files(source)
        self.text_field = text_field
        self.strict = strict
        self.total_bytes = sum(path.stat().st_size for path, _ in self.files)
        self.one_document = len(self.files) == 1 and self.files[0][1] == "txt"
        self.rewind()

    def rewind(self):
        """Start the counts again, for the next pass."""
        self.bytes_read = 0          # of the files on disk (compressed bytes for .gz)
        self.skipped = {"not JSON": 0, f'no "{self.text_field}" string': 0}
        self.first_skipped = None    # "file:line" of the first line skipped
        self.replaced = {}           # path -> byte sequences that were not UTF-8
        self.has_text = False        # whether a segment so far held more than whitespace

    # --- .txt ---------------------------------------------------------------------------
    def _text_blocks(self, path, start=0):
        """Decoded blocks of a text file from byte `start` (a broken character there dropped),
        bytes that are not UTF-8 replaced by U+FFFD and counted."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            with open(path, "rb") as file:
                file.seek(start)
                while raw := file.read(BLOCK):
                    self.bytes_read += len(raw)
                    text = decoder.decode(raw)
                    if start and text.startswith("\ufffd"):
                        text, start = text.lstrip("\ufffd"), 0
                    bad = text.count("\ufffd") - raw.count(b"\xef\xbf\xbd")
                    if bad > 0:
                        self.replaced[path] = self.replaced.get(path, 0) + bad
                    yield text
                yield decoder.decode(b"", final=True)
        except OSError as error:
            raise _unreadable(path, error) from None

    def _text_segments(self, path, split_at=None):
        """One .txt document in segments cut where the pre-tokenizer cuts; with split_at (a
        character count), a forced cut there, the rest marked "val"."""
        start, carry, offset = ("train" if split_at is not None else "auto"), "", 0
        for block in self._text_blocks(path):
            carry += block
            if split_at is not None and offset + len(carry) >= split_at:
                head, carry = carry[:split_at - offset], carry[split_at - offset:]
                yield head, start, False
                offset, start, split_at = split_at, "val", None
            cut = cut_before(carry, len(carry) - 1) if len(carry) > BLOCK else None
            if cut is None and len(carry) > LONGEST_UNCUT:
                cut = BLOCK
            if cut is not None and cut < len(carry):
                yield carry[:cut], start, False
                offset, carry, start = offset + cut, carry[cut:], None
        yield carry, start, True

    def characters(self) -> int:
        """The characters of a one-document corpus (a pass over its blocks)."""
        path = self.files[0][0]
        count = sum(len(block) for block in self._text_blocks(path))
        self.rewind()
        return count

    # --- .jsonl, .jsonl.gz --------------------------------------------------------------
    def _jsonl_documents(self, path, compressed, start=0):
        try:
            with open(path, "rb") as raw:
                raw.seek(start)
                lines = gzip.GzipFile(fileobj=raw) if compressed else raw
                if start:
                    lines.readline()                     # the line the window starts inside
                seen = raw.tell()
                for number, line in enumerate(lines, 1):
                    now = raw.tell()
                    self.bytes_read, seen = self.bytes_read + now - seen, now
                    text = self._text_of(line, path, number)
                    if text is not None:
                        yield text
        except (OSError, EOFError, zlib.error) as error:
            raise _unreadable(path, error) from None

    def _text_of(self, line, path, number):
        if not line.strip():
            return None
        try:
            record = json.loads(line)
        except ValueError as error:
            return self._skip("not JSON", path, number, f"not JSON ({error})")
        text = record.get(self.text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            return self._skip(f'no "{self.text_field}" string', path, number,
                              f'no "{self.text_field}" field holding a string')
        return text

    def _skip(self, reason, path, number, message):
        if self.strict:
            raise DataError(f"{path}:{number}: {message} (--strict refuses it)")
        self.skipped[reason] += 1
        self.first_skipped = self.first_skipped or f"{path}:{number}"
        return None

    # --- parquet ------------------------------------------------------------------------
    def _parquet_documents(self, path):
        try:
            import pyarrow
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading parquet needs pyarrow "
                            f"(pip install 'nanoandrea[parquet]')") from None
        try:
            table = pq.ParquetFile(path)
            if self.text_field not in table.schema_arrow.names:
                raise DataError(f'{path}: no "{self.text_field}" column (it has '
                                f'{", ".join(table.schema_arrow.names)}; --text-field names it)')
            size, groups = path.stat().st_size, max(table.num_row_groups, 1)
            for group in range(table.num_row_groups):
                column = table.read_row_group(group, columns=[self.text_field]).column(0)
                for text in column.to_pylist():
                    if isinstance(text, str):
                        yield text
                    else:
                        self._skip(f'no "{self.text_field}" string', path, f"row group {group}",
                                   f'a row whose "{self.text_field}" is not a string')
                self.bytes_read += size // groups
        except OSError as error:
            raise _unreadable(path, error) from None
        except pyarrow.ArrowException as error:
            raise DataError(f"{path}: not a readable parquet file ({error})") from None

    def _documents(self, path, kind, start=0):
        if kind == "parquet":
            return self._parquet_documents(path)
        return self._jsonl_documents(path, kind == "jsonl.gz", start)

    # --- the corpus ---------------------------------------------------------------------
    def segments(self):
        """Every document of the corpus as (text, start, ends) segments (module docstring).
        A one-document corpus (a .txt file) is split: its last VAL_FRACTION of characters is
        the val split, as nanoGPT splits tiny Shakespeare."""
        split_at = int(self.characters() * (1 - VAL_FRACTION)) if self.one_document else None
        for path, kind in self.files:
            segments = (self._text_segments(path, split_at) if kind == "txt" else
                        ((text, "auto", True) for text in self._documents(path, kind)))
            for segment in segments:
                self.has_text = self.has_text or not segment[0].isspace() and segment[0] != ""
                yield segment

    def sample(self, limit: int) -> list[str]:
        """Texts of up to about `limit` characters from SAMPLE_WINDOWS windows spread evenly
        over the corpus's bytes; all of it when it is smaller. A window starts at its byte in a
        .txt or .jsonl file, and at the file's start in a .jsonl.gz or parquet file (they cannot
        be entered in the middle)."""
        strict, self.strict = self.strict, False    # (the pass that encodes refuses, with
        if self.total_bytes <= limit:                # the line's number)
            texts = [text for text, _, _ in self.segments()]
        else:
            window, texts, offset = limit // SAMPLE_WINDOWS, [], 0
            starts = [self.total_bytes * k // SAMPLE_WINDOWS for k in range(SAMPLE_WINDOWS)]
            for path, kind in self.files:
                size = path.stat().st_size
                mine = [s - offset for s in starts if offset <= s < offset + size]
                offset += size
                if kind in ("jsonl.gz", "parquet") and mine:
                    texts += _take(self._documents(path, kind), window * len(mine))
                for start in mine if kind in ("txt", "jsonl") else ():
                    read = (self._text_blocks(path, start) if kind == "txt"
                            else self._documents(path, kind, start))
                    texts += _take(read, window)
        self.strict = strict
        self.rewind()
        return texts

    def report_skipped(self, report):
        for path, count in self.replaced.items():
            report(f"warning: {path}: {count} byte sequence(s) that are not UTF-8 were "
                   f"replaced by U+FFFD")
        if sum(self.skipped.values()):
            counts = ", ".join(f"{n:,} {reason}" for reason, n in self.skipped.items() if n)
            report(f"warning: skipped {sum(self.skipped.values()):,} record(s) ({counts}); the "
                   f"first at {self.first_skipped} (--strict refuses them)")


def _take(texts, limit):
    """Texts from an iterator until they hold `limit` characters (the last one cut)."""
    taken, size = [], 0
    for text in texts:
        taken.append(text[:limit - size])
        size += len(taken[-1])
        if size >= limit:
            break
    return taken

