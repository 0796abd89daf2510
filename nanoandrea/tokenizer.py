"""Tokenizers: text <-> integer ids, the first and last step of the model.

Two tokenizers share one interface (train, encode, decode, vocab_size, to_dict, from_dict):

- CharTokenizer: one id per character of the training corpus. Tiny vocabulary, long sequences,
  cannot encode a character it has not seen.
- BPETokenizer: byte-level byte-pair encoding exactly as GPT-2 does it. Text is UTF-8 bytes, so
  every string can be encoded; frequent byte sequences are merged into single tokens.

On disk both are one small JSON file, tokenizer.json (format in docs/tokenizer.md).
"""
import heapq
import json
import os
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import regex

from .files import shareable

FORMAT_NAME = "nanoandrea-tokenizer"
FORMAT_VERSION = 1

# GPT-2's pre-tokenizer: splits text into pieces (a letter run with its leading space, a number
# run, a punctuation run, whitespace, English contractions). BPE merges never cross these borders.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The same pattern as tiktoken's own "gpt2" encoding writes it, the contractions one group: the
# same pieces (no contraction is the start of another, so at most one of them matches), found a
# tenth faster by tiktoken's regex engine, which tries one alternative for an apostrophe, not seven.
FAST_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
END_OF_TEXT = "<|endoftext|>"  # GPT-2's token after each document; never made by encoding text

# Where text can be cut and each part encoded alone with the same pieces: no piece of GPT-2's
# pattern holds a character that is not whitespace followed by one that is (a letter, number or
# punctuation run stops at whitespace; a whitespace piece is whitespace only). A letter, number,
# punctuation mark or symbol followed by a space or a newline is such a place under every regex
# engine's \s. "(?r)" searches from the right: the last such place before a limit.
LAST_CUT = regex.compile(r"(?r)[\p{L}\p{N}\p{P}\p{S}](?=[ \n])")
NEXT_CUT = regex.compile(r"[\p{L}\p{N}\p{P}\p{S}](?=[ \n])")


def cut_before(text: str, limit: int, start: int = 0) -> int | None:
    """The last place in text[start + 1:limit + 1] where GPT-2's pieces allow a cut (LAST_CUT),
    else the first one after limit, else None (the text from start cannot be cut)."""
    match = LAST_CUT.search(text, start, limit + 1) or NEXT_CUT.search(text, limit)
    return match.end() if match else None


def encoding_parts(text: str, size: int = 1 << 16) -> list[str]:
    """text cut into parts of about `size` characters that encode, one by one, to its ids."""
    parts, start = [], 0
    while len(text) - start > size:
        cut = cut_before(text, start + size, start)
        if cut is None:
            break
        parts.append(text[start:cut])
        start = cut
    parts.append(text[start:])
    return parts


class TokenizerError(ValueError):
    """Bad input to a tokenizer (unknown character, id out of range, not a tokenizer file)."""


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from each byte 0..255 to a printable unicode character.

    Printable bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') map to themselves; the other 68 bytes
    (controls, space, ...) map to chr(256), chr(257), ... in byte order, so a space becomes 'Ġ'
    and a newline 'Ċ'. The dict's order is GPT-2's byte order: the i-th key is the byte with id i.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    others = [byte for byte in range(256) if byte not in table]
    table.update({byte: chr(256 + n) for n, byte in enumerate(others)})
    return table


BYTE_TO_UNICODE = gpt2_bytes_to_unicode()
BYTE_OF_ID = list(BYTE_TO_UNICODE)  # base token id i is the single byte BYTE_OF_ID[i]
# bytes.translate(BYTE_TO_ID_TABLE) turns a byte string into the base token ids of its bytes.
BYTE_TO_ID_TABLE = bytes(sorted(range(256), key=lambda i: BYTE_OF_ID[i]))


def _id_list(ids, vocab_size: int) -> list[int]:
    """ids (an iterable of ints or an integer numpy array) as a list of ints in [0, vocab_size)."""
    array = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
    if array.size == 0:
        return []
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise TokenizerError(f"token ids must be a 1-D sequence of integers, got {array.dtype} "
                             f"with shape {array.shape}")
    outside = (array < 0) | (array >= vocab_size)
    if outside.any():
        raise TokenizerError(f"token id {array[outside][0]} is out of range for a vocabulary "
                             f"of {vocab_size} tokens")
    return array.tolist()


def _header(kind: str) -> dict:
    return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "type": kind}


def _check_header(d, kind: str) -> None:
    if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
        raise TokenizerError(f'not a nanoandrea tokenizer (expected "format": "{FORMAT_NAME}")')
    if d.get("version") != FORMAT_VERSION:
        raise TokenizerError(f"tokenizer format version {d.get('version')!r} is not supported "
                             f"(this code reads version {FORMAT_VERSION})")
    if d.get("type") != kind:
        raise TokenizerError(f'expected a "{kind}" tokenizer, got type {d.get("type")!r}')


class CharTokenizer:
    """One token per character; the vocabulary is the sorted set of the corpus's characters."""
    kind = "char"
    end_of_text = None  # a char tokenizer has no end-of-text token: documents end in a newline

    def __init__(self, chars: str):
        self.chars = chars  # the vocabulary in id order: id i is chars[i]
        self.id_of_char = {char: i for i, char in enumerate(chars)}

    @classmethod
    def train(cls, text: str) -> "CharTokenizer":
        if not text:
            raise TokenizerError("cannot train a char tokenizer on empty text")
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        try:
            return np.array([self.id_of_char[char] for char in text], dtype=np.int64)
        except KeyError as error:
            raise TokenizerError(f"character {error.args[0]!r} is not in the vocabulary (a char "
                                 f"tokenizer's vocabulary is the characters of its training "
                                 f"corpus)") from None

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in _id_list(ids, self.vocab_size))

    def to_dict(self) -> dict:
        return {**_header(self.kind), "chars": self.chars}

    @classmethod
    def from_dict(cls, d: dict) -> "CharTokenizer":
        _check_header(d, cls.kind)
        if not isinstance(d.get("chars"), str) or len(set(d["chars"])) != len(d["chars"]):
            raise TokenizerError('a char tokenizer needs "chars": a string of distinct characters')
        return cls(d["chars"])

    def __repr__(self):
        return f"CharTokenizer(vocab_size={self.vocab_size})"


def _merge_in_piece(ids: list[int], pair: tuple[int, int], new_id: int
                    ) -> tuple[list[int], Counter]:
    """Replace every occurrence of pair in ids, scanning left to right, by new_id.

    Returns the new ids and, for each adjacent pair whose number of occurrences changed, by how
    much. Only the neighbours of a merged occurrence change: in x a b y, merging (a, b) into Z
    removes (x, a), (a, b), (b, y) and adds (x, Z), (Z, y). list.index jumps to the next
    candidate in C, so a long piece with few occurrences costs little Python work.
    """
    left, right = pair
    merged, changes, i = [], Counter(), 0
    while True:
        try:
            j = ids.index(left, i)
        except ValueError:
            break
        if j + 1 == len(ids):
            break
        if ids[j + 1] != right:
            merged.extend(ids[i:j + 1])
            i = j + 1
            continue
        merged.extend(ids[i:j])
        changes[pair] -= 1
        if merged:  # left neighbour (the previous merge's Z if the two were adjacent)
            changes[merged[-1], left] -= 1
            changes[merged[-1], new_id] += 1
        if j + 2 < len(ids):  # right neighbour
            changes[right, ids[j + 2]] -= 1
            changes[new_id, ids[j + 2]] += 1
        merged.append(new_id)
        i = j + 2
    merged.extend(ids[i:])
    return merged, changes


SHORT_PIECE = 12  # pieces up to this many bytes take the plain loop, cheaper than the heap


def _merge_by_rank_short(ids: list[int], rank) -> list[int]:
    """GPT-2's merge loop for a short piece: merge the leftmost pair of lowest rank, repeat."""
    while len(ids) > 1:
        best, where = None, -1
        for i in range(len(ids) - 1):
            new_id = rank((ids[i], ids[i + 1]))
            if new_id is not None and (best is None or new_id < best):
                best, where = new_id, i
        if best is None:
            break
        ids[where:where + 2] = [best]
    return ids


class BPETokenizer:
    """Byte-level BPE, as in GPT-2.

    Vocabulary: ids 0..255 are the single bytes in GPT-2's byte order (BYTE_OF_ID: id 0 is '!',
    id 220 is the space), then id 256 + k is the k-th merge (left id, right id), the
    concatenation of its two parts; with end_of_text, the last id (256 + the number of merges,
    GPT-2's 50256) is END_OF_TEXT, which `prepare` puts after each document and which encoding text
    never makes. Encoding splits the text with the pre-tokenizing regex, turns
    each piece into byte ids and applies merges by rank: repeatedly merge the adjacent pair that was
    learned first, until no learned pair is left. This is GPT-2's algorithm, so with GPT-2's files
    (from_gpt2_files) the ids are GPT-2's ids.
    """
    kind = "bpe"
    CACHE_LIMIT = 1 << 20  # pieces whose encoding is remembered before the cache is emptied

    def __init__(self, merges: list[tuple[int, int]], pattern: str = GPT2_PATTERN,
                 end_of_text: bool = False):
        self.merges = [tuple(pair) for pair in merges]
        self.pattern = pattern
        self.compiled_pattern = regex.compile(pattern)
        self.id_of_pair = {pair: 256 + k for k, pair in enumerate(self.merges)}
        self.token_bytes = [bytes([byte]) for byte in BYTE_OF_ID]  # id -> the bytes it stands for
        for left, right in self.merges:
            self.token_bytes.append(self.token_bytes[left] + self.token_bytes[right])
        self.end_of_text = len(self.token_bytes) if end_of_text else None  # its id, or None
        self.decoded_bytes = self.token_bytes + [END_OF_TEXT.encode()] * bool(end_of_text)
        self.cache = {}  # piece of text -> its token ids

    @classmethod
    def train(cls, text: str, vocab_size: int, progress=None, end_of_text=False
              ) -> "BPETokenizer":
        """Learn vocab_size - 256 merges from text (one fewer with end_of_text, whose token
        takes the last id).

        The text is split into pieces by the regex once and each distinct piece is counted. Each
        step merges the most frequent adjacent pair (counted over all pieces, times their
        frequency). Ties go to the smallest (left id, right id), so training is deterministic.
        Counts are updated incrementally: an index pair -> pieces containing it says which pieces a
        merge changes, and in those only the neighbours of each merged occurrence are re-counted
        (_merge_in_piece). A heap keyed by (-count, left, right) finds the best pair; entries made
        stale by a count change are skipped when popped. Training stops
        early (smaller vocabulary) if every piece has become a single token. progress, if given, is
        called as progress(merges_done, merges_wanted) about a hundred times.
        """
        if vocab_size < 256 + end_of_text:
            raise TokenizerError(f"a byte-level BPE vocabulary needs at least the 256 bytes"
                                 f"{' and the end-of-text token' * end_of_text}; "
                                 f"vocab_size={vocab_size} is too small")
        piece_counts = Counter(regex.findall(GPT2_PATTERN, text))
        pieces = [list(piece.encode("utf-8").translate(BYTE_TO_ID_TABLE)) for piece in piece_counts]
        frequencies = list(piece_counts.values())
        pair_counts, pieces_with_pair = Counter(), {}
        for index, (ids, frequency) in enumerate(zip(pieces, frequencies)):
            for pair in zip(ids, ids[1:]):
                pair_counts[pair] += frequency
                pieces_with_pair.setdefault(pair, set()).add(index)
        heap = [(-count, *pair) for pair, count in pair_counts.items()]
        heapq.heapify(heap)

        merges, merges_wanted = [], vocab_size - 256 - end_of_text
        while len(merges) < merges_wanted and heap:
            negative_count, left, right = heapq.heappop(heap)
            pair = (left, right)
            if pair_counts.get(pair) != -negative_count:
                continue  # stale heap entry: this pair's count has changed since it was pushed
            new_id = 256 + len(merges)
            merges.append(pair)
            changes = Counter()  # pair -> change of its count caused by this merge
            for index in pieces_with_pair.pop(pair):
                pieces[index], changes_in_piece = _merge_in_piece(pieces[index], pair, new_id)
                for changed_pair, change in changes_in_piece.items():
                    changes[changed_pair] += change * frequencies[index]
                    if change > 0:
                        pieces_with_pair.setdefault(changed_pair, set()).add(index)
            for changed_pair, change in changes.items():
                if change == 0:
                    continue
                count = pair_counts[changed_pair] + change
                if count > 0:
                    pair_counts[changed_pair] = count
                    heapq.heappush(heap, (-count, *changed_pair))
                else:
                    del pair_counts[changed_pair]
            if progress is not None and len(merges) % max(1, merges_wanted // 100) == 0:
                progress(len(merges), merges_wanted)
        return cls(merges, end_of_text=end_of_text)

    @property
    def vocab_size(self) -> int:
        return len(self.decoded_bytes)

    def _encode_piece(self, piece: str) -> list[int]:
        """Token ids of one pre-tokenized piece: its bytes, then merges applied by rank.

        GPT-2 repeatedly takes the learned pair of lowest rank and merges all its occurrences left
        to right. We do the same one occurrence at a time, taking the (rank, position) that is
        lowest from a heap: a merge only creates pairs of higher rank than its own, so the order of
        merges is the same. The piece is a linked list (next_position, previous_position) so that
        a merge is O(1) and a long piece costs O(n log n), not O(n^2). A merged pair's rank is the
        id it makes, 256 + rank; a heap entry whose pair has changed since it was pushed is skipped.
        """
        try:
            ids = list(piece.encode("utf-8").translate(BYTE_TO_ID_TABLE))
        except UnicodeEncodeError as error:
            raise TokenizerError(f"text is not valid unicode: {error.reason} at "
                                 f"{error.object[error.start:error.end]!r}") from None
        rank = self.id_of_pair.get  # (left, right) -> new id, None if the pair is not learned
        if len(ids) <= SHORT_PIECE:
            return _merge_by_rank_short(ids, rank)
        queue = [(new_id, i) for i, pair in enumerate(zip(ids, ids[1:])) if (new_id := rank(pair))]
        if not queue:
            return ids
        heapq.heapify(queue)
        end = len(ids)
        next_position, previous_position = list(range(1, end + 1)), list(range(-1, end - 1))
        while queue:
            new_id, i = heapq.heappop(queue)
            j = next_position[i]
            if j == end or rank((ids[i], ids[j])) != new_id:
                continue  # stale: i or its neighbour has been merged since this entry was pushed
            ids[i], ids[j] = new_id, None  # position i now holds the merged token, j is gone
            k = next_position[i] = next_position[j]
            if k != end:
                previous_position[k] = i
                if right_rank := rank((new_id, ids[k])):
                    heapq.heappush(queue, (right_rank, i))
            h = previous_position[i]
            if h != -1 and (left_rank := rank((ids[h], new_id))):
                heapq.heappush(queue, (left_rank, h))
        return [token for token in ids if token is not None]

    def encode(self, text: str) -> np.ndarray:
        ids = []
        for piece in self.compiled_pattern.findall(text):
            piece_ids = self.cache.get(piece)
            if piece_ids is None:
                if len(self.cache) >= self.CACHE_LIMIT:
                    self.cache.clear()
                piece_ids = self.cache[piece] = self._encode_piece(piece)
            ids.extend(piece_ids)
        return np.array(ids, dtype=np.int64)

    def encode_fast(self, text: str, threads: int | None = None) -> np.ndarray:
        """encode(text), the same ids, through tiktoken (Rust) where it is installed and the
        pattern is GPT-2's; else encode itself. This class stays the readable definition; the
        library is what runs at scale (`prepare`), and tests/test_tokenizer.py holds the two
        equal (tools/encode_speed.py measures both, and the `tokenizers` library's BPE). The
        text goes in parts cut where no piece spans the cut (encoding_parts), over `threads`
        threads [one a core]. tiktoken's encode_to_numpy hands back its buffer of ids, with no
        Python int made for each; with no special token allowed, "<|endoftext|>" in the text is
        ordinary text, as encode_ordinary has it."""
        fast = self.fast_encoding()
        if fast is None:
            return self.encode(text)

        def encode(part):
            return fast.encode_to_numpy(part, disallowed_special=()).astype(np.int64)
        parts = encoding_parts(text)
        if len(parts) == 1:
            return encode(text)
        with ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
            return np.concatenate(list(pool.map(encode, parts)))

    def fast_encoding(self):
        """tiktoken's Encoding of these merges, built once (None without tiktoken, or for
        another pattern): its ranks are our ids (GPT-2's layout), so its merge of the
        lowest-ranked pair is this class's merge order."""
        if getattr(self, "_fast_encoding", False) is not False:
            return self._fast_encoding
        self._fast_encoding = None
        try:
            import tiktoken
        except ImportError:
            return None
        if self.pattern == GPT2_PATTERN and len(set(self.token_bytes)) == len(self.token_bytes):
            special = {END_OF_TEXT: self.end_of_text} if self.end_of_text is not None else {}
            self._fast_encoding = tiktoken.Encoding(
                f"nanoandrea-bpe-{self.vocab_size}", pat_str=FAST_GPT2_PATTERN,
                special_tokens=special,
                mergeable_ranks={data: i for i, data in enumerate(self.token_bytes)})
        return self._fast_encoding

    def decode(self, ids) -> str:
        """Text of ids. Ids that end inside a multi-byte character (this happens while sampling,
        one token at a time) decode with errors="replace": the broken bytes become '\ufffd'."""
        data = b"".join(self.decoded_bytes[i] for i in _id_list(ids, self.vocab_size))
        return data.decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        end = {"end_of_text": END_OF_TEXT} if self.end_of_text is not None else {}
        return {**_header(self.kind), "byte_order": "gpt2", "pattern": self.pattern, **end,
                "merges": [list(pair) for pair in self.merges]}

    @classmethod
    def from_dict(cls, d: dict) -> "BPETokenizer":
        _check_header(d, cls.kind)
        if d.get("byte_order") != "gpt2":
            raise TokenizerError(f'unknown "byte_order" {d.get("byte_order")!r} (expected "gpt2")')
        if not isinstance(d.get("pattern"), str) or not isinstance(d.get("merges"), list):
            raise TokenizerError('a bpe tokenizer needs "pattern" (a string) and "merges" (a list)')
        if d.get("end_of_text", END_OF_TEXT) != END_OF_TEXT:
            raise TokenizerError(f'"end_of_text" is {d["end_of_text"]!r}; the one known is '
                                 f'{END_OF_TEXT!r}')
        for k, pair in enumerate(d["merges"]):
            if not (isinstance(pair, list) and len(pair) == 2
                    and all(isinstance(i, int) and 0 <= i < 256 + k for i in pair)):
                raise TokenizerError(f"merge {k} is {pair!r}; expected [left_id, right_id], both "
                                     f"ids of earlier tokens (below {256 + k})")
        try:
            regex.compile(d["pattern"])
        except regex.error as error:
            raise TokenizerError(f'"pattern" is not a valid regex: {error}') from None
        return cls(d["merges"], d["pattern"], end_of_text="end_of_text" in d)

    def to_gpt2_files(self, directory) -> tuple[str, str]:
        """Write GPT-2's vocab.json and merges.txt into directory (made if missing); returns
        their paths."""
        os.makedirs(directory, exist_ok=True)
        token_strings = ["".join(BYTE_TO_UNICODE[b] for b in data) for data in self.token_bytes]
        if len(set(token_strings)) != len(token_strings):
            raise TokenizerError("two merges make the same bytes; GPT-2's vocab.json cannot "
                                 "hold that")
        vocab_path = os.path.join(directory, "vocab.json")
        merges_path = os.path.join(directory, "merges.txt")
        vocab = {string: i for i, string in enumerate(token_strings)}
        if self.end_of_text is not None:
            vocab[END_OF_TEXT] = self.end_of_text
        _write_atomically(vocab_path, json.dumps(vocab, ensure_ascii=False))
        lines = [f"{token_strings[left]} {token_strings[right]}\n" for left, right in self.merges]
        _write_atomically(merges_path, "#version: 0.2\n" + "".join(lines))
        return vocab_path, merges_path

    @classmethod
    def from_gpt2_files(cls, vocab_json_path, merges_txt_path) -> "BPETokenizer":
        """Load GPT-2's vocab.json (token string -> id) and merges.txt ("#version" line, then one
        "left right" merge per line, in rank order).

        The ids must be GPT-2's layout, which ours is: the 256 bytes in GPT-2 byte order, then the
        k-th merge's token at 256 + k. GPT-2's "<|endoftext|>" (50256), right after the merges,
        is the end-of-text token; other entries beyond the merges are not byte sequences and are
        left out: encode never produces them.
        """
        with open(vocab_json_path, encoding="utf-8") as file:
            vocab = json.load(file)
        with open(merges_txt_path, encoding="utf-8") as file:
            lines = [line for line in file.read().splitlines()
                     if line.strip() and not line.startswith("#version")]
        for i, byte in enumerate(BYTE_OF_ID):
            if vocab.get(BYTE_TO_UNICODE[byte]) != i:
                raise TokenizerError(f"{vocab_json_path}: byte {byte} should have id {i} "
                                     f"(GPT-2 byte order)")
        merges = []
        for k, line in enumerate(lines):
            left, _, right = line.partition(" ")
            if not (left in vocab and right in vocab and vocab.get(left + right) == 256 + k):
                raise TokenizerError(f"{merges_txt_path}: merge {k} ({line!r}) does not match "
                                     f"{vocab_json_path} (its parts must be there and the merged "
                                     f"token must have id {256 + k})")
            merges.append((vocab[left], vocab[right]))
        return cls(merges, end_of_text=vocab.get(END_OF_TEXT) == 256 + len(merges))

    def __repr__(self):
        return f"BPETokenizer(vocab_size={self.vocab_size})"


TOKENIZER_CLASSES = {CharTokenizer.kind: CharTokenizer, BPETokenizer.kind: BPETokenizer}


def train_tokenizer(kind: str, text: str, vocab_size: int | None = None, progress=None,
                    end_of_text: bool = False):
    """Train a "char" tokenizer (vocab_size is ignored: the corpus sets it; it has no end-of-text
    token) or a "bpe" one (with END_OF_TEXT as its last id if end_of_text)."""
    if kind == "char":
        return CharTokenizer.train(text)
    if kind == "bpe":
        if vocab_size is None:
            raise TokenizerError("a bpe tokenizer needs a vocab_size (at least 256)")
        return BPETokenizer.train(text, vocab_size, progress, end_of_text)
    raise TokenizerError(f"unknown tokenizer kind {kind!r}; expected one of "
                         f"{sorted(TOKENIZER_CLASSES)}")


def _write_atomically(path, text: str) -> None:
    """Write text as UTF-8 to a temporary file beside path, fsync it, then rename it onto path,
    so that a reader never sees a half-written file. The file gets the umask's mode, not
    mkstemp's owner-only one."""
    directory = os.path.dirname(os.path.abspath(path))
    descriptor, temporary_path = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        shareable(temporary_path)
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary_path, path)
    except BaseException:
        os.unlink(temporary_path)
        raise


def _tokenizer_path(path) -> str:
    """path itself, or path/tokenizer.json when path is a directory."""
    return os.path.join(path, "tokenizer.json") if os.path.isdir(path) else os.fspath(path)


def _json_item(item) -> str:
    """json.dumps(item); a merge [left, right] formatted directly, the same text at a sixth of
    the time (GPT-2's 50,000 merges through json.dumps take a fifth of a second)."""
    if type(item) is list and len(item) == 2 and type(item[0]) is int and type(item[1]) is int:
        return f"[{item[0]}, {item[1]}]"
    return json.dumps(item)


def save_tokenizer(tok, path) -> str:
    """Write tok as tokenizer.json (path may be the file or its directory); one key per line and,
    for lists, one item per line, so the file reads well. Returns the file's path."""
    lines = []
    for key, value in tok.to_dict().items():
        if isinstance(value, list) and value:
            items = ",\n    ".join(map(_json_item, value))
            lines.append(f"  {json.dumps(key)}: [\n    {items}\n  ]")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
    path = _tokenizer_path(path)
    _write_atomically(path, "{\n" + ",\n".join(lines) + "\n}\n")
    return path


def load_tokenizer(path):
    """Read a tokenizer.json written by save_tokenizer (path may be the file or its directory)."""
    path = _tokenizer_path(path)
    try:
        with open(path, encoding="utf-8") as file:
            d = json.load(file)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TokenizerError(f"{path} is not a tokenizer file (not UTF-8 JSON: {error})") from None
    kind = d.get("type") if isinstance(d, dict) and d.get("format") == FORMAT_NAME else None
    if kind not in TOKENIZER_CLASSES:
        raise TokenizerError(f'{path} is not a nanoandrea tokenizer file (expected "format": '
                             f'"{FORMAT_NAME}" and "type": "char" or "bpe")')
    try:
        return TOKENIZER_CLASSES[kind].from_dict(d)
    except TokenizerError as error:
        raise TokenizerError(f"{path}: {error}") from None
