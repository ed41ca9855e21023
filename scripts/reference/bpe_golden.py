#!/usr/bin/env python3
"""Byte-level BPE goldens for kvdb's Rust tokenizer, made with llama.cpp (llama-cpp-python).

Independent of kvdb. No real BPE model is needed: the script trains a small byte-level BPE
vocabulary on tests/data/gpl-3.txt *without* pre-tokenization (so merges cross word, space,
digit and punctuation boundaries and the ids depend on exactly how each pre-tokenizer splits),
adds a few control and user-defined tokens, writes it as a vocabulary-only GGUF file, loads
it with `Llama(vocab_only=True)` once per `tokenizer.ggml.pre` value, and records the ids
llama.cpp produces. The JSON holds the vocabulary too, so the Rust test rebuilds the same
tokenizer from it.

Usage (from the repository root):
    pip install -r scripts/reference/requirements.txt
    python3 scripts/reference/bpe_golden.py [--out model/tests/data/bpe_tokenizer_golden.json]
"""

import argparse
import collections
import json
import os
import random
import struct
import sys
import tempfile

import llama_cpp
from llama_cpp import Llama

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(REPO, "model", "tests", "data", "bpe_tokenizer_golden.json")
GPL_PATH = "tests/data/gpl-3.txt"

PRE_TOKENIZERS = ["llama-bpe", "qwen2", "smollm", "gpt-2", "default"]
N_MERGES = 700
TRAIN_CHARS = 12000
CONTROL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<tool>", "</tool>"]

CASES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "a  b   c    d     e",
    "line1\nline2\n\nline4\n\n\n",
    "\ttab\tseparated\t\tvalues\t",
    "fn main() {\n    println!(\"Hello, {}!\", name);\n}\n",
    "def f(x):\n\treturn x ** 2  # square\n",
    "3.14159 2718281828 1,000,000 -42 0x1F 1e-10 007 12345678",
    "日本語のテキストと中文文本。한국어 텍스트",
    "Emoji: 😀🎉👍🏽 and 🇫🇷 flags, family 👨\u200d👩\u200d👧\u200d👦",
    "Café naïve résumé façade jalapeño Ångström Straße",
    "Ελληνικά, русский язык, العربية, עברית, हिन्दी, ภาษาไทย",
    "Mathematical: ∀x∈ℝ, x² ≥ 0, ∑ ∫ √2 ≈ 1.414 ½ ⅓ ⑦ Ⅻ",
    "I'm sure they're fine; we've said we'll go, can't we? He'd agree. I'M SURE THEY'RE",
    "URL: https://example.com/path?query=1&b=2#frag and email a.b@example.org",
    "@handle #hashtag $100 50% a+b=c [x] {y} (z) <w> ~!^&*_-=|\\/",
    "   ",
    "\n",
    " \t \n \r\n  x \r\n",
    "Windows\r\nline\r\nendings\r\n",
    "non-breaking\u00a0space, ideographic\u3000space, thin\u2009space, nel\u0085line",
    "<|begin_of_text|>Hello<|eot_id|>",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<tool>call()</tool> and <|end_of_text|>",
    "the GNU General Public License is a free, copyleft license for software",
    "  the  program    of   the   license  ",
]

# Numbers, code and whitespace for the training text, so that merges cover them too.
SYNTHETIC = (
    "In 2024, 1234 of 5678 items cost $12.50 (about 45%); call 555-0100 or 1-800-123-4567.\n"
    "for (int i = 0; i < 100; i++) {\n\tsum += a[i] * 2;\n}\n\n"
    "if x == 1:\n    return [1, 2, 3]\nelse:\n    return {'a': 10, 'b': 20}\n"
    "    indented    text  with   runs\t\tof\t spaces\r\nand CRLF\r\n"
    "THE PROGRAM'S LICENSE ISN'T WHAT YOU'LL GET. It's what we've said.\n"
) * 3

FRAGMENTS = [
    "the", "The", " of", " and", "license", " program", "GNU", "free", "software", "don't",
    "it's", "'S", "'ll", "naïve", "日本", "😀", "\u00a0", "\u3000", "\u2028", "0", "42", "3.14",
    "1,000", "12345", "x", "y_z", "+-*/", "(", ")", ";", ":", ",", ".", "!", "?", "'", '"',
    "$", "%", "|", "~", "=", "<", ">", " ", "  ", "   ", " " * 7, "\n", "\n\n", "\r\n", "\t",
    " \n", "\n ", "<|eot_id|>", "<|im_end|>", "<tool>", "<|begin_of", "eot_id|>",
]


def gpt2_byte_chars():
    printable = (
        list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    )
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


# Merges that only some pre-tokenizers allow (space + digit, punctuation + newline, digit
# groups, whitespace before newlines, upper-case contractions, ...), ranked first. Pairs of
# UTF-8 strings; both halves are themselves earlier merges or single bytes.
SEED_MERGES = [
    ("\xc2", "\xa0"), ("1", "2"), ("12", "3"), ("123", "4"), ("4", "5"), ("0", "0"), ("00", "0"),
    (" ", "1"), (" ", "4"), (" ", "0"), ("\n", "\n"), (" ", "\n"), (" ", " "), ("  ", "\n"),
    (".", "\n"), (",", "\n"), ("'", "S"), ("'", "s"), ("'", "LL"), ("L", "L"), (" ", "("),
    ("(", ")"), (")", ";"), (" ", "<"), ("|", ">"), ("<", "|"), (" ", '"'), ("\t", "\t"),
    (" ", "\t"), ("\r", "\n"), (" ", "\r"), ("\n", " "), ("\n", "  "), ("\xc2\xa0", " "),
    (" ", "\xc2\xa0"), ("!", "\n"), ("e", "1"), ("x", "2"), ("$", "1"), ("\t", "\n"),
]


def train(text, n_merges):
    """Greedy byte-pair training over 200-character chunks (no pre-tokenization), after the
    seed merges."""
    chars = gpt2_byte_chars()

    def enc(x):
        return "".join(chars[b] for b in x.encode("latin-1" if x.startswith("\xc2") else "utf-8"))

    seqs = [[chars[b] for b in text[i : i + 200].encode("utf-8")] for i in range(0, len(text), 200)]
    merges = [(enc(a), enc(b)) for a, b in SEED_MERGES]
    for a, b in merges:
        for i, sq in enumerate(seqs):
            seqs[i] = merge_pair(sq, a, b)
    for _ in range(n_merges):
        counts = collections.Counter()
        for s in seqs:
            for a, b in zip(s, s[1:]):
                counts[(a, b)] += 1
        if not counts:
            break
        (a, b), c = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
        if c < 2:
            break
        merges.append((a, b))
        for i, sq in enumerate(seqs):
            seqs[i] = merge_pair(sq, a, b)
    return merges


def merge_pair(seq, a, b):
    out, j = [], 0
    while j < len(seq):
        if j + 1 < len(seq) and seq[j] == a and seq[j + 1] == b:
            out.append(a + b)
            j += 2
        else:
            out.append(seq[j])
            j += 1
    return out


def build_vocab(text):
    chars = gpt2_byte_chars()
    tokens = [chars[b] for b in range(256)]
    types = [1] * 256
    for t in CONTROL:
        tokens.append(t)
        types.append(3)
    for t in USER_DEFINED:
        tokens.append(t)
        types.append(4)
    merges = train(text, N_MERGES)
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
            types.append(1)
    return tokens, types, [f"{a} {b}" for a, b in merges]


def gguf_bytes(kv):
    """A GGUF v3 file with metadata only (no tensors)."""

    def s(x):
        b = x.encode("utf-8")
        return struct.pack("<Q", len(b)) + b

    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    for key, (kind, value) in kv.items():
        out += s(key)
        if kind == "str":
            out += struct.pack("<I", 8) + s(value)
        elif kind == "u32":
            out += struct.pack("<II", 4, value)
        elif kind == "f32":
            out += struct.pack("<If", 6, value)
        elif kind == "bool":
            out += struct.pack("<IB", 7, int(value))
        elif kind == "str[]":
            out += struct.pack("<IIQ", 9, 8, len(value)) + b"".join(s(v) for v in value)
        elif kind == "i32[]":
            out += struct.pack("<IIQ", 9, 5, len(value)) + struct.pack(f"<{len(value)}i", *value)
        else:
            raise ValueError(kind)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()

    with open(os.path.join(REPO, GPL_PATH), encoding="utf-8") as f:
        gpl = f.read()
    tokens, types, merges = build_vocab(gpl[:TRAIN_CHARS] + SYNTHETIC)
    bos, eos = tokens.index("<|begin_of_text|>"), tokens.index("<|end_of_text|>")

    rng = random.Random(20250602)
    cases = list(CASES)
    for _ in range(60):
        cases.append("".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 10))))
    cases.append(gpl[TRAIN_CHARS : TRAIN_CHARS + 4000])

    results = {}
    for pre in PRE_TOKENIZERS:
        kv = {
            "general.architecture": ("str", "llama"),
            "general.name": ("str", "kvdb-bpe-test"),
            "llama.context_length": ("u32", 2048),
            "llama.embedding_length": ("u32", 64),
            "llama.block_count": ("u32", 1),
            "llama.feed_forward_length": ("u32", 128),
            "llama.attention.head_count": ("u32", 2),
            "llama.attention.layer_norm_rms_epsilon": ("f32", 1e-5),
            "tokenizer.ggml.model": ("str", "gpt2"),
            "tokenizer.ggml.pre": ("str", pre),
            "tokenizer.ggml.tokens": ("str[]", tokens),
            "tokenizer.ggml.token_type": ("i32[]", types),
            "tokenizer.ggml.merges": ("str[]", merges),
            "tokenizer.ggml.bos_token_id": ("u32", bos),
            "tokenizer.ggml.eos_token_id": ("u32", eos),
        }
        with tempfile.NamedTemporaryFile(suffix=".gguf", delete=False) as f:
            f.write(gguf_bytes(kv))
            path = f.name
        try:
            llm = Llama(model_path=path, vocab_only=True, verbose=False)
            rows = []
            for i, text in enumerate(cases):
                for special in (True, False):
                    if not special and not any(t in text for t in CONTROL):
                        continue
                    ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
                    rows.append({"case": i, "parse_special": special, "ids": ids})
            results[pre] = {"add_bos": bool(llm._model.add_bos_token()), "results": rows}
            del llm
        finally:
            os.unlink(path)
        print(f"{pre}: {len(rows)} tokenizations", file=sys.stderr)

    golden = {
        "generator": f"llama-cpp-python {llama_cpp.__version__}",
        "script": "scripts/reference/bpe_golden.py",
        "vocab": {
            "tokens": tokens,
            "token_type": types,
            "merges": merges,
            "bos_token_id": bos,
            "eos_token_id": eos,
        },
        "cases": cases,
        "pre": results,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        head = {k: v for k, v in golden.items() if k not in ("pre",)}
        f.write("{\n")
        for k, v in head.items():
            f.write(f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)},\n")
        f.write('"pre": {\n')
        parts = []
        for pre, r in results.items():
            body = ",\n".join(json.dumps(x) for x in r["results"])
            parts.append(f'{json.dumps(pre)}: {{"add_bos": {json.dumps(r["add_bos"])}, "results": [\n{body}\n]}}')
        f.write(",\n".join(parts))
        f.write("\n}\n}\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
