"""Tests of nanoandrea.tokenizer: round trips, errors, training, file formats, GPT-2 equivalence."""
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import regex

from nanoandrea.tokenizer import (BYTE_OF_ID, GPT2_PATTERN, BPETokenizer, CharTokenizer,
                                  TokenizerError, load_tokenizer, save_tokenizer, train_tokenizer)

REPO = Path(__file__).resolve().parents[1]
CORPUS = (REPO / "nanoandrea" / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")

UNSEEN_TEXTS = [
    "",
    " ",
    "   ",
    "\r\n",
    "line one\r\nline two\r\n\r\n",
    "\t\x00\x01\x7f\x1b[0m",
    "emoji 🎉👩‍👩‍👧‍👦 and flags 🇰🇷",
    "中文文本，日本語のテキスト、한국어 텍스트",
    "combining: e\u0301 a\u0308\u0304 Z\u0335\u0321",
    "it's they'll we've I'm  double  spaces   \n\n  trailing ",
    "numbers 3.14159 1,000,000 ٣٤٥ ⅷ",
    "\ufeffBOM and \u200bzero width\u2028line sep",
]


def random_unicode(n: int, seed: int) -> str:
    """n random code points from all of unicode except the surrogates (which are not text)."""
    rng = random.Random(seed)
    points = [rng.choice([rng.randrange(0, 0x80), rng.randrange(0, 0xD800),
                          rng.randrange(0xE000, 0x110000)]) for _ in range(n)]
    return "".join(map(chr, points))


def byte_id(char: str) -> int:
    """Base token id of a one-byte character."""
    return BYTE_OF_ID.index(ord(char))


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(CORPUS[:30_000], 512)


# ---- char ----

def test_char_vocabulary_is_the_sorted_characters_and_round_trips():
    text = CORPUS[:100_000]
    tok = CharTokenizer.train(text)
    assert tok.chars == "".join(sorted(set(text)))
    assert tok.vocab_size == len(set(text))
    ids = tok.encode(text)
    assert ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer) and len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text


def test_char_unknown_character_names_it_and_the_corpus():
    tok = CharTokenizer.train("hello world")
    with pytest.raises(TokenizerError) as error:
        tok.encode("hello\tworld")
    message = str(error.value)
    assert repr("\t") in message and "training corpus" in message and "\n" not in message


def test_char_cannot_train_on_empty_text():
    with pytest.raises(TokenizerError, match="empty"):
        CharTokenizer.train("")


@pytest.mark.parametrize("bad_id", [-1, 8])
def test_char_decode_rejects_ids_out_of_range(bad_id):
    tok = CharTokenizer.train("abcdefgh")
    with pytest.raises(TokenizerError, match="out of range"):
        tok.decode([0, bad_id])


# ---- bpe: round trips and decoding ----

@pytest.mark.parametrize("text", UNSEEN_TEXTS + [random_unicode(3000, seed) for seed in range(3)])
def test_bpe_round_trips_text_it_never_saw(bpe, text):
    ids = bpe.encode(text)
    assert ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer)
    assert bpe.decode(ids) == text


def test_bpe_round_trips_its_corpus_with_fewer_tokens_than_bytes(bpe):
    text = CORPUS[:30_000]
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert len(ids) < 0.5 * len(text.encode("utf-8"))


def test_bpe_decode_of_half_a_character_gives_the_replacement_character():
    tok = BPETokenizer([])
    ids = tok.encode("é")  # two UTF-8 bytes, two tokens
    assert len(ids) == 2
    assert tok.decode(ids[:1]) == "\ufffd"
    assert tok.decode(ids) == "é"


def test_bpe_decode_accepts_lists_arrays_and_generators_and_rejects_bad_ids(bpe):
    ids = bpe.encode("To be, or not to be")
    assert bpe.decode(ids) == bpe.decode(ids.tolist()) == bpe.decode(int(i) for i in ids)
    assert bpe.decode(ids.astype(np.int32)) == "To be, or not to be"
    with pytest.raises(TokenizerError, match="out of range"):
        bpe.decode([bpe.vocab_size])
    with pytest.raises(TokenizerError, match="integers"):
        bpe.decode([1.5])


def test_bpe_piece_cache_is_bounded_and_does_not_change_results(bpe):
    small_cache = BPETokenizer(bpe.merges)
    small_cache.CACHE_LIMIT = 10
    text = CORPUS[30_000:35_000]
    assert small_cache.encode(text).tolist() == bpe.encode(text).tolist()
    assert 0 < len(small_cache.cache) <= 10


def test_bpe_rejects_text_that_is_not_unicode(bpe):
    with pytest.raises(TokenizerError, match="not valid unicode"):
        bpe.encode("half a surrogate \ud800 here")


# ---- bpe: training ----

def test_bpe_first_merges_of_the_textbook_example():
    # "aaabdaaabac" (Wikipedia): aa -> Z, then ab and Za tie at 2; the smaller pair (a, b) wins
    # (byte ids are below merge ids), then ZY -> X, leaving "XdXac".
    tok = BPETokenizer.train("aaabdaaabac", 259)
    a, b, c, d = (byte_id(char) for char in "abcd")
    assert tok.merges == [(a, a), (a, b), (256, 257)]
    assert tok.encode("aaabdaaabac").tolist() == [258, d, 258, a, c]


@pytest.mark.parametrize("vocab_size", [256, 257, 300, 512])
def test_bpe_vocab_size_is_exactly_the_one_asked_for(vocab_size):
    tok = BPETokenizer.train(CORPUS[:20_000], vocab_size)
    assert tok.vocab_size == vocab_size == 256 + len(tok.merges)
    assert max(tok.encode(CORPUS[:20_000])) < vocab_size


def test_bpe_rejects_a_vocab_smaller_than_the_bytes():
    with pytest.raises(TokenizerError, match="256"):
        BPETokenizer.train("some text", 255)


def test_bpe_stops_when_every_piece_is_one_token():
    # Pieces "ab", " ab", " abc": merge (a, b), then (" ", ab), then (" ab", c); nothing is left.
    tok = BPETokenizer.train("ab ab abc", 1000)
    a, b, c, space = (byte_id(char) for char in "abc ")
    assert tok.merges == [(a, b), (space, 256), (257, c)] and tok.vocab_size == 259
    assert all(len(tok.encode(piece)) == 1 for piece in ["ab", " ab", " abc"])


def reference_bpe_training(text: str, vocab_size: int) -> list[tuple[int, int]]:
    """Slow obvious BPE training: recount every pair after every merge, same tie-break."""
    pieces = Counter(regex.findall(GPT2_PATTERN, text))
    words = {piece: [byte_id_of_byte[b] for b in piece.encode("utf-8")] for piece in pieces}
    merges = []
    while 256 + len(merges) < vocab_size:
        counts = Counter()
        for piece, ids in words.items():
            for pair in zip(ids, ids[1:]):
                counts[pair] += pieces[piece]
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))
        new_id = 256 + len(merges)
        merges.append(pair)
        for piece, ids in words.items():
            merged, i = [], 0
            while i < len(ids):
                if ids[i:i + 2] == list(pair):
                    merged.append(new_id)
                    i += 2
                else:
                    merged.append(ids[i])
                    i += 1
            words[piece] = merged
    return merges


byte_id_of_byte = {byte: i for i, byte in enumerate(BYTE_OF_ID)}


def test_bpe_incremental_training_equals_recounting_from_scratch():
    text = (CORPUS[:3000] + " aaaa aaaaa aaaaaaa bbbb abababab aabaab abab ababa baaab "
            + random_unicode(200, seed=7))
    assert BPETokenizer.train(text, 400).merges == reference_bpe_training(text, 400)


def test_bpe_training_is_deterministic_across_processes():
    text = CORPUS[:20_000]
    merges = BPETokenizer.train(text, 400).merges
    assert BPETokenizer.train(text, 400).merges == merges
    script = ("import json, sys; from nanoandrea.tokenizer import BPETokenizer; "
              "text = sys.stdin.read(); print(json.dumps(BPETokenizer.train(text, 400).merges))")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script], input=text, env=env, encoding="utf-8",
                         capture_output=True, check=True).stdout
    assert [tuple(pair) for pair in json.loads(out)] == merges


def test_bpe_training_reports_progress():
    calls = []
    BPETokenizer.train(CORPUS[:20_000], 456, progress=lambda *args: calls.append(args))
    assert len(calls) == 100
    assert calls[-1] == (200, 200)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)


def test_bpe_training_is_fast_enough():
    start = time.perf_counter()
    BPETokenizer.train(CORPUS[:100_000], 512)
    assert time.perf_counter() - start < 10.0  # about 0.2 s on 2 cores; the bound is for slow CI


def test_bpe_long_pieces_cost_little_to_train_on_and_to_encode():
    # One 100 kB piece of random letters and one 60 kB piece "thethe...": a merge step that
    # rescans whole pieces in Python takes tens of seconds here; ours take about 1 s in all.
    blob = "".join(random.Random(0).choice("etaoinshrdlu") for _ in range(100_000))
    start = time.perf_counter()
    tok = BPETokenizer.train(CORPUS[:20_000] + " " + blob, 512)
    for text in [blob, "the" * 20_000]:
        assert tok.decode(tok.encode(text)) == text
    assert time.perf_counter() - start < 10.0


# ---- GPT-2 compatibility ----

def test_byte_ids_follow_gpt2_vocab():
    # Ids of single bytes in GPT-2's own vocab.json ("!" 0, "Ā" 188, "Ċ" 198, "Ġ" 220).
    assert byte_id("!") == 0 and byte_id("\x00") == 188 and byte_id("\n") == 198
    assert byte_id(" ") == 220 and sorted(BYTE_OF_ID) == list(range(256))


def gpt2_reference_encoder(vocab_path, merges_path):
    """GPT-2's encoder.py (openai/gpt-2, src/encoder.py), the string-based original, condensed."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    byte_encoder, n = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in byte_encoder:
            byte_encoder[b], n = chr(256 + n), n + 1
    encoder = json.loads(Path(vocab_path).read_text(encoding="utf-8"))
    merge_lines = Path(merges_path).read_text(encoding="utf-8").split("\n")[1:-1]
    ranks = {tuple(line.split()): rank for rank, line in enumerate(merge_lines)}

    def bpe(token):
        word = tuple(token)
        while len(word) > 1:
            pairs = set(zip(word, word[1:]))
            first, second = min(pairs, key=lambda pair: ranks.get(pair, float("inf")))
            if (first, second) not in ranks:
                break
            new_word, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    new_word.append(first + second)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            word = tuple(new_word)
        return word

    def encode(text):
        ids = []
        for token in regex.findall(GPT2_PATTERN, text):
            symbols = "".join(byte_encoder[b] for b in token.encode("utf-8"))
            ids.extend(encoder[t] for t in bpe(symbols))
        return ids
    return encode


def test_gpt2_files_export_import_and_match_the_gpt2_reference_encoder(bpe, tmp_path):
    vocab_path, merges_path = bpe.to_gpt2_files(tmp_path)
    assert Path(merges_path).read_text(encoding="utf-8").startswith("#version")
    loaded = BPETokenizer.from_gpt2_files(vocab_path, merges_path)
    assert loaded.merges == bpe.merges
    reference = gpt2_reference_encoder(vocab_path, merges_path)
    random_letters = "".join(random.Random(1).choice("etaoin") for _ in range(2000))
    texts = [CORPUS[30_000:40_000], "aaaa aaaaa aaaaaaaa " + "the" * 300, *UNSEEN_TEXTS,
             random_unicode(500, 3), random_letters]
    for text in texts:
        assert loaded.encode(text).tolist() == bpe.encode(text).tolist() == reference(text)


def test_gpt2_files_with_special_tokens_and_blank_lines_load(bpe, tmp_path):
    vocab_path, merges_path = bpe.to_gpt2_files(tmp_path)
    vocab = json.loads(Path(vocab_path).read_text(encoding="utf-8"))
    vocab["<|endoftext|>"] = len(vocab)
    Path(vocab_path).write_text(json.dumps(vocab), encoding="utf-8")
    with open(merges_path, "a", encoding="utf-8") as file:
        file.write("\n\n")
    assert BPETokenizer.from_gpt2_files(vocab_path, merges_path).merges == bpe.merges


def test_gpt2_files_that_disagree_are_rejected(bpe, tmp_path):
    vocab_path, merges_path = bpe.to_gpt2_files(tmp_path)
    lines = Path(merges_path).read_text(encoding="utf-8").splitlines()
    lines[1], lines[2] = lines[2], lines[1]  # merge 0 and merge 1 swapped: ids no longer match
    Path(merges_path).write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match="merge 0"):
        BPETokenizer.from_gpt2_files(vocab_path, merges_path)


def test_gpt2_vocab_in_another_byte_order_is_rejected(bpe, tmp_path):
    vocab_path, merges_path = bpe.to_gpt2_files(tmp_path)
    vocab = json.loads(Path(vocab_path).read_text(encoding="utf-8"))
    vocab["!"], vocab['"'] = vocab['"'], vocab["!"]
    Path(vocab_path).write_text(json.dumps(vocab), encoding="utf-8")
    with pytest.raises(TokenizerError, match="GPT-2 byte order"):
        BPETokenizer.from_gpt2_files(vocab_path, merges_path)


# ---- files ----

@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_save_and_load_give_the_same_tokenizer(kind, tmp_path):
    tok = train_tokenizer(kind, CORPUS[:20_000], 300)
    path = save_tokenizer(tok, tmp_path / "tokenizer.json")
    assert sorted(os.listdir(tmp_path)) == ["tokenizer.json"]  # no temporary file left behind
    on_disk = json.loads(Path(path).read_text(encoding="utf-8"))
    header = (on_disk["format"], on_disk["version"], on_disk["type"])
    assert header == ("nanoandrea-tokenizer", 1, kind)
    for loaded in [load_tokenizer(path), load_tokenizer(tmp_path)]:
        assert type(loaded) is type(tok) and loaded.vocab_size == tok.vocab_size
        sample = CORPUS[20_000:25_000]
        assert loaded.encode(sample).tolist() == tok.encode(sample).tolist()


def test_bpe_file_holds_merges_pattern_and_byte_order(tmp_path):
    tok = BPETokenizer.train("aaabdaaabac", 259)
    text = Path(save_tokenizer(tok, tmp_path)).read_text(encoding="utf-8")
    on_disk = json.loads(text)
    assert on_disk["merges"] == [list(pair) for pair in tok.merges]
    one_a_line = [line.strip().rstrip(",") for line in text.splitlines() if line.startswith("    [")]
    assert one_a_line == [json.dumps(list(pair)) for pair in tok.merges]      # as json writes one
    assert on_disk["pattern"] == GPT2_PATTERN and on_disk["byte_order"] == "gpt2"


HEADER = '"format": "nanoandrea-tokenizer", "version": 1'
NOT_TOKENIZERS = [
    '{"foo": 1}', "[1, 2]", "not json at all", "", "\xff\xfe binary",
    '{"format": "nanoandrea-tokenizer", "version": 2, "type": "char", "chars": "ab"}',
    '{%s, "type": "word", "words": ["a"]}' % HEADER,
    '{%s, "type": "char", "chars": "aba"}' % HEADER,  # a character twice
    '{%s, "type": "bpe", "byte_order": "gpt2", "pattern": "x", "merges": [[0, 256]]}' % HEADER,
    '{%s, "type": "bpe", "byte_order": "raw", "pattern": "x", "merges": []}' % HEADER,
    '{%s, "type": "bpe", "byte_order": "gpt2", "pattern": "(", "merges": []}' % HEADER,
]


@pytest.mark.parametrize("content", NOT_TOKENIZERS)
def test_load_rejects_files_that_are_not_tokenizers(content, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content.encode("latin-1"))  # "\xff\xfe" becomes two bytes that are not UTF-8
    with pytest.raises(TokenizerError):
        load_tokenizer(path)


def test_train_tokenizer_dispatches_on_kind():
    assert isinstance(train_tokenizer("char", "abc"), CharTokenizer)
    assert train_tokenizer("bpe", "abc abc", 257).vocab_size == 257
    with pytest.raises(TokenizerError, match="vocab_size"):
        train_tokenizer("bpe", "abc")
    with pytest.raises(ValueError, match="'word'.*'bpe', 'char'"):
        train_tokenizer("word", "abc", 300)


FAST_TEXTS = ["", "   leading", "trailing   \n\n", "it's we'll  don't\r\n\u00a0 3.14 1000000",
              "héllo wörld — ελληνικά русский 日本語 العربية 😀🎉\t\t\n", "\x00\x01\x7f bytes \ufffd",
              "a" * 3000 + " " + "ab" * 500, "line one\nline two\n\n\n   indented\n"]


def test_the_fast_bpe_gives_the_reference_ids():
    """encode_fast (tiktoken, built from the same merges) gives the same ids as the readable
    reference on varied text: scripts the training text never had, emoji, control bytes, long
    runs, whitespace at either end, a text of many lines (split over threads)."""
    from nanoandrea.data import DEFAULT_CORPUS
    from nanoandrea.tokenizer import BPETokenizer
    corpus = DEFAULT_CORPUS.read_text(encoding="utf-8")
    tokenizer = BPETokenizer.train(corpus[:50000] + FAST_TEXTS[4], 600)
    assert tokenizer.fast_encoding() is not None
    for text in FAST_TEXTS + [corpus[200000:260000]]:
        assert np.array_equal(tokenizer.encode_fast(text), tokenizer.encode(text)), text[:40]
    assert tokenizer.encode_fast("").dtype == np.int64


def test_the_fast_pattern_finds_gpt2s_pieces():
    """FAST_GPT2_PATTERN, what tiktoken runs, splits text into the pieces GPT2_PATTERN does."""
    from nanoandrea.tokenizer import FAST_GPT2_PATTERN, GPT2_PATTERN
    contractions = "'m it's I'm we'll they're you've he'd don't ma'am X'S Y'LL a''s b'''re c'x d'l"
    for text in [*FAST_TEXTS, *UNSEEN_TEXTS, contractions, CORPUS[:20_000], random_unicode(3000, 7)]:
        assert regex.findall(FAST_GPT2_PATTERN, text) == regex.findall(GPT2_PATTERN, text)


def test_the_fast_bpe_cuts_text_only_where_no_piece_spans_the_cut():
    """Long text of whitespace runs (which cross line ends: "  \\n\\n\\n" is one piece) goes to
    tiktoken in parts; each cut must leave the pieces, and so the ids, as they are."""
    from nanoandrea.tokenizer import encoding_parts
    tokenizer = BPETokenizer.train(CORPUS[:30000] + " \n\n\n  \n\n \n" * 300, 400)
    rng = random.Random(0)
    for _ in range(5):
        text = "".join(rng.choice(["a", "b7", " ", "\n", "\n\n", "  ", "é", "日本", "'s"])
                       for _ in range(100_000))
        parts = encoding_parts(text, size=5000)
        assert len(parts) > 10 and "".join(parts) == text
        assert np.array_equal(tokenizer.encode_fast(text), tokenizer.encode(text))


def test_the_end_of_text_token_is_the_last_id_and_text_never_makes_it(tmp_path):
    from nanoandrea.tokenizer import END_OF_TEXT
    tok = train_tokenizer("bpe", CORPUS[:20_000], 300, end_of_text=True)
    assert tok.vocab_size == 300 and len(tok.merges) == 43 and tok.end_of_text == 299
    assert tok.decode([tok.end_of_text]) == END_OF_TEXT
    text = f"the end{END_OF_TEXT}and after"
    ids = tok.encode(text)
    assert tok.end_of_text not in ids.tolist() and tok.decode(ids) == text
    assert np.array_equal(tok.encode_fast(text), ids)
    for loaded in [load_tokenizer(save_tokenizer(tok, tmp_path)),
                   BPETokenizer.from_gpt2_files(*tok.to_gpt2_files(tmp_path / "gpt2"))]:
        assert loaded.to_dict() == tok.to_dict() and loaded.end_of_text == 299
    assert BPETokenizer.train(CORPUS[:20_000], 300).end_of_text is None    # as before
    assert CharTokenizer.train("ab").end_of_text is None
