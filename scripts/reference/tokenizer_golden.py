#!/usr/bin/env python3
"""Tokenizer goldens for kvdb's Rust tokenizer, made with llama.cpp (through llama-cpp-python).

Independent of kvdb: it loads only the GGUF vocabulary with llama.cpp and tokenizes a fixed list
of strings the way `llama_tokenize(add_special=false, parse_special=...)` does, then records
llama.cpp's own detokenization of the ids (`llama_detokenize(remove_special=false,
unparse_special=...)`) with and without rendering control tokens.

Usage (from the repository root):
    pip install -r scripts/reference/requirements.txt
    python3 scripts/reference/tokenizer_golden.py \
        [--model ~/.cache/kvdb/models/gemma-3-270m-q4_k_m.gguf] \
        [--out model/tests/data/gemma3_tokenizer_golden.json]
"""

import ctypes
import json
import os
import random
import sys

import llama_cpp
from llama_cpp import Llama

from common import GPL_PATH, golden_path, parse_args, read_gpl, sha256

DEFAULT_OUT = golden_path("gemma3_tokenizer_golden.json")

RANDOM_CASES = 200
RANDOM_SEED = 20250601

# (text, parse_special)
CASES = [
    ("Hello, world!", True),
    ("The quick brown fox jumps over the lazy dog.", True),
    ("", True),
    (" leading space", True),
    ("trailing space ", True),
    ("  two leading spaces", True),
    ("a  b   c    d     e", True),
    ("line1\nline2\n\nline4\n\n\n", True),
    ("\ttab\tseparated\t\tvalues\t", True),
    ("fn main() {\n    println!(\"Hello, {}!\", name);\n}\n", True),
    ("def f(x):\n\treturn x ** 2  # square\n\n\nclass A:\n        pass\n", True),
    ("3.14159 2718281828 1,000,000 -42 0x1F 1e-10 007", True),
    ("日本語のテキストと中文文本。한국어 텍스트", True),
    ("Emoji: 😀🎉👍🏽 and 🇫🇷 flags, family 👨\u200d👩\u200d👧\u200d👦", True),
    ("Café naïve résumé façade jalapeño Ångström Straße", True),
    ("Ελληνικά, русский язык, العربية, עברית, हिन्दी, ภาษาไทย", True),
    ("Mathematical: ∀x∈ℝ, x² ≥ 0, ∑ ∫ √2 ≈ 1.414", True),
    ("Rare code points: \U000f0000\U0010fffd \u0000 \x7f \u200b end", True),
    ("I'm sure they're fine; we've said we'll go, can't we? He'd agree.", True),
    ("URL: https://example.com/path?query=1&b=2#frag and email a.b@example.org", True),
    ("@handle #hashtag $100 50% a+b=c [x] {y} (z) <w> ~!^&*_-=|\\/", True),
    ("ALL CAPS TEXT AND MiXeD cAsE wOrDs", True),
    ("   ", True),
    ("\n", True),
    ("\n" * 40 + "x", True),
    (" " * 45 + "x" + " " * 3, True),
    ("\t" * 35 + "y", True),
    (" \t \n \r\n  x \r\n", True),
    ("<bos>Hello", True),
    ("<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n", True),
    ("<end_of_turn>", True),
    ("<unused0><unused1>text<unused6241>", True),
    ("<pad><eos><unk><mask>[multimodal]<start_of_image><end_of_image>", True),
    ("<table><tr><td>cell</td></tr></table>", True),
    ("<div class=\"x\"><b>bold</b> and <i>italic</i> <code>x</code></div>", True),
    ("</s> is also a user-defined token", True),
    ("text with <start_of_turn> in the middle and <<bos>> nested <start_of_turn", True),
    ("<h1>Title</h1>\n\n<p>Paragraph with <strong>strong</strong> text.</p>", True),
    # control tokens are not recognised without special parsing; user-defined ones are
    ("<start_of_turn>user\nHi<end_of_turn>", False),
    ("</s> and <b>bold</b>", False),
    ("<bos><unused0>\n\n  x", False),
    ("supercalifragilisticexpialidocious antidisestablishmentarianism", True),
    ("Windows\r\nline\r\nendings\r\n", True),
]


# Fragments for the seeded random cases: words, whitespace runs, special and user-defined tokens,
# near-misses of special tokens, and characters that need byte fallback.
FRAGMENTS = [
    "the", "The", " of", " and", "license", "Licence", " program", "GNU", "free", "software",
    "hello", "world", "don't", "it's", "naïve", "Ünïcödé", "日本", "中文", "한국", "Ελλάδα",
    "русский", "😀", "👍🏽", "🇫🇷", "\u200d", "\u00a0", "\u3000", "\U000f0001", "\u0007",
    "0", "42", "3.14", "1,000", "2024-06-01", "x", "y_z", "CamelCase", "snake_case", "+-*/",
    "(", ")", "{", "}", "[", "]", ";", ":", ",", ".", "!", "?", "'", '"', "`", "#", "@",
    "$", "%", "^", "&", "|", "~", "=", "\\", "/", "<", ">", "</", "/>",
    " ", "  ", "   ", " " * 8, " " * 33, "\n", "\n\n", "\n" * 5, "\n" * 33, "\t", "\t\t",
    "\r\n", " \n", "\n ", "\t ", " \t",
    "<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<unused0>", "<unused17>",
    "<unused6241>", "<mask>", "[multimodal]", "<start_of_image>", "<b>", "</b>", "<table>",
    "</td>", "<h1>", "</s>", "<code>", "<start_of_turn", "<unused", "<end_of", "start_of_turn>",
    "<<", ">>", "<bos", "bos>",
]


def random_cases(n, seed):
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        k = rng.randint(1, 12)
        text = "".join(rng.choice(FRAGMENTS) for _ in range(k))
        cases.append((text, i % 4 != 3))  # every fourth without special parsing
    return cases


def detokenize(vocab, ids, unparse_special):
    """llama.cpp's detokenization, as raw bytes (no llama-cpp-python post-processing)."""
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 + 64 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, unparse_special)
    if n < 0:
        raise RuntimeError(f"detokenize needs {-n} bytes")
    return buf.raw[:n]


def main():
    args = parse_args(__doc__, DEFAULT_OUT)

    llm = Llama(model_path=args.model, vocab_only=True, verbose=False)
    vocab = llm._model.vocab

    def case(text, parse_special, **extra):
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=parse_special)
        rendered = detokenize(vocab, ids, True)
        plain = detokenize(vocab, ids, False)
        out = dict(extra)
        if "text_file" not in out:
            out["text"] = text
        out["parse_special"] = parse_special
        out["ids"] = ids
        # Byte-fallback ids can split characters; record lossless text when possible.
        out["detok_special"] = rendered.decode("utf-8", errors="replace")
        out["detok_plain"] = plain.decode("utf-8", errors="replace")
        out["roundtrip"] = rendered == text.encode("utf-8")
        return out

    cases = [case(t, s) for t, s in CASES]
    cases += [case(t, s, random_seed=RANDOM_SEED) for t, s in random_cases(RANDOM_CASES, RANDOM_SEED)]
    gpl = read_gpl()
    gpl_case = case(gpl, True, text_file=GPL_PATH)
    # The whole file's decoded text is just the file again; keep the JSON small.
    for k in ("detok_special", "detok_plain"):
        gpl_case[k] = None
    cases.append(gpl_case)

    golden = {
        "generator": f"llama-cpp-python {llama_cpp.__version__}",
        "script": "scripts/reference/tokenizer_golden.py",
        "model": os.path.basename(args.model),
        "model_sha256": sha256(args.model),
        "tokenize_call": "llama_tokenize(add_special=false, parse_special=case.parse_special)",
        "detokenize_call": "llama_detokenize(remove_special=false, unparse_special=true|false)",
        "vocab_size": llama_cpp.llama_vocab_n_tokens(vocab),
        "bos_id": llama_cpp.llama_vocab_bos(vocab),
        "eos_id": llama_cpp.llama_vocab_eos(vocab),
        "eog_ids": [i for i in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, i)],
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
        "cases": cases,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        # One key per line and one case per line, for readable diffs.
        head = {k: v for k, v in golden.items() if k != "cases"}
        f.write("{\n")
        for k, v in head.items():
            f.write(f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)},\n")
        f.write('"cases": [\n')
        f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in golden["cases"]))
        f.write("\n]\n}\n")
    n_ids = sum(len(c["ids"]) for c in cases)
    print(f"wrote {args.out}: {len(cases)} cases, {n_ids} ids", file=sys.stderr)


if __name__ == "__main__":
    main()
