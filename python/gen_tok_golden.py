#!/usr/bin/env python3
"""Generates the tokenizer golden corpus tests/data/tok/corpus.jsonl.gz with HF `tokenizers`.

Each line of the gzip-compressed JSON-lines file is one record:
    {"t": text, "s": ids, "p": ids}
where "s" are the ids of HF `Tokenizer.encode(text, add_special_tokens=False)` (added tokens
recognised: template text) and "p" those of the pre-tokenizer + BPE model alone (plain text:
added-token text becomes ordinary tokens); "p" is omitted when equal to "s". The first line is a
header {"generator": ..., "tokenizers": version, "tokenizer_sha256": ..., "n": count}.

The corpus is deterministic (seeded) and built from text found on a Debian machine plus synthetic
strings; see docs/tokenizer.md for the categories. Every record is also checked here to satisfy
decode(encode(t)) == t with HF, so the C test can demand the same.

It also writes tests/data/tok/decode.jsonl.gz: random id sequences with HF's decode of them
({"ids", "text": skip_special_tokens=False, "skip": skip_special_tokens=True}).

Usage: python/.venv/bin/python python/gen_tok_golden.py [--out PATH] [--tokenizer PATH] [--decode-only]
"""
import argparse
import glob
import gzip
import hashlib
import json
import os
import random
import struct
import sys

import tokenizers
from tokenizers import Tokenizer

GENERATOR = "gen_tok_golden.py v1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- sources of real text ----

def read_mo(path):
    """Yields translated strings from a GNU gettext .mo file."""
    try:
        data = open(path, "rb").read()
    except OSError:
        return
    if len(data) < 28:
        return
    magic = struct.unpack("<I", data[:4])[0]
    endian = "<" if magic == 0x950412DE else ">" if magic == 0xDE120495 else None
    if not endian:
        return
    n, _, toff = struct.unpack(endian + "III", data[8:20])
    for i in range(n):
        try:
            length, off = struct.unpack(endian + "II", data[toff + 8 * i: toff + 8 * i + 8])
            s = data[off: off + length].decode("utf-8")
        except (struct.error, UnicodeDecodeError):
            continue
        for part in s.split("\0"):
            if part.strip():
                yield part


def prose_strings(rng, limit):
    files = sorted(glob.glob("/usr/share/locale/*/LC_MESSAGES/*.mo"))
    rng.shuffle(files)
    out = []
    for f in files:
        for s in read_mo(f):
            out.append(s)
        if len(out) > limit * 3:
            break
    rng.shuffle(out)
    return out[:limit]


CODE_ROOTS = ["/usr/lib/python3", "/usr/lib/python3.11", "/usr/include", "/usr/share/perl",
              "/usr/share/perl5", "/usr/share/javascript", "/usr/lib/node_modules", "/usr/share/doc",
              "/usr/share/cmake-3.25", "/usr/share/X11/locale", "/usr/lib/go", "/usr/share/gocode",
              "/usr/lib/jvm", "/usr/share/lua", "/usr/share/emacs", "/usr/share/vim"]
CODE_EXT = (".py", ".c", ".h", ".hpp", ".cc", ".cpp", ".js", ".ts", ".pl", ".pm", ".go", ".rs",
            ".java", ".lua", ".rb", ".hs", ".el", ".vim", ".cmake", ".sh", ".json", ".html", ".css",
            ".xml", ".md", ".txt", ".yaml", ".yml", ".toml", ".sql", ".tex", ".mk", "Compose")


def code_strings(rng, limit):
    files = []
    for root in CODE_ROOTS:
        n_root = 0
        for d, dirs, names in os.walk(root):
            dirs.sort()
            for nm in sorted(names):
                if nm.endswith(CODE_EXT):
                    files.append(os.path.join(d, nm))
                    n_root += 1
            if n_root > 3000:
                break
    files = sorted(set(f for f in files if os.path.isfile(f)))
    rng.shuffle(files)
    out = []
    for f in files:
        try:
            data = open(f, "rb").read(200000)
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if "\0" in text:
            continue
        lines = text.split("\n")
        for _ in range(min(40, len(lines) // 4 + 1)):
            a = rng.randrange(len(lines))
            b = min(len(lines), a + rng.choice([1, 1, 2, 3, 5, 8, 13, 20]))
            s = "\n".join(lines[a:b])
            if rng.random() < 0.3:
                s += "\n"
            if s:
                out.append(s)
        if len(out) > limit:
            break
    rng.shuffle(out)
    return out[:limit]


# ---- synthetic text ----

SEED_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.", "Hello, world! How's it going?",
    "Le cœur a ses raisons que la raison ne connaît point.", "Über den Wolken muss die Freiheit wohl grenzenlos sein.",
    "¿Dónde está la biblioteca? ¡Allí!", "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Γαζέες καὶ μυρτιὲς δὲν θὰ βρῶ πιὰ στὸ χρυσαφὶ ξέφωτο.", "我能吞下玻璃而不伤身体。",
    "今天天气很好，我们去公园散步吧！", "人工智能正在改变世界，DeepSeek-V4 支持一百万上下文。",
    "私はガラスを食べられます。それは私を傷つけません。", "カタカナとひらがな・漢字の混在テキスト。",
    "나는 유리를 먹을 수 있어요. 그래도 아프지 않아요.", "ฉันกินกระจกได้ แต่มันไม่ทำให้ฉันเจ็บ",
    "मैं काँच खा सकता हूँ और मुझे उससे कोई चोट नहीं पहुंचती।", "أنا قادر على أكل الزجاج و هذا لا يؤلمني.",
    "אני יכול לאכול זכוכית וזה לא מזיק לי.", "Tôi có thể ăn thủy tinh mà không hại gì.",
    "Mogę jeść szkło i mi nie szkodzi.", "Pot să mănânc sticlă și ea nu mă rănește.",
    "Cam yiyebilirim, bana zararı dokunmaz.", "ᚠᛇᚻ᛫ᛒᛦᚦ᛫ᚠᚱᚩᚠᚢᚱ᛫ᚠᛁᚱᚪ᛫ᚷᛖᚻᚹᛦᛚᚳᚢᛗ",
    "Ἐν ἀρχῇ ἦν ὁ λόγος", "ኣብ ርእሲ ኩሉ ሰላም ይኹን", "ᐊᐃᑉ ᑕᑯᔪᖅ", "Բարեւ աշխարհ", "გამარჯობა მსოფლიო",
    "வணக்கம் உலகம்", "ನಮಸ್ಕಾರ ಪ್ರಪಂಚ", "ഹലോ വേൾഡ്", "హలో వరల్డ్", "ওহে বিশ্ব", "ສະບາຍດີ", "ជំរាបសួរ",
    "Сайн байна уу", "Здравствуй, мир", "Ahoj světe, příliš žluťoučký kůň úpěl ďábelské ódy.",
    "e = mc², ∑ᵢ xᵢ ≥ ∫₀^∞ f(x) dx ≈ π·r²", "Price: $1,234.56 (€1.234,56) — 10% off!",
    "file_name.tar.gz --output=/tmp/x.json -v2", "https://example.com/path?q=a+b&x=1#frag",
    "user@example.org <mailto:user@example.org>", "CamelCaseIdentifier snake_case_id kebab-case-id",
]

SCRIPTS = [
    (0x41, 0x5A), (0x61, 0x7A), (0xC0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x530, 0x58F),
    (0x590, 0x5FF), (0x600, 0x6FF), (0x900, 0x97F), (0x980, 0x9FF), (0xB80, 0xBFF), (0xE00, 0xE7F),
    (0x10A0, 0x10FF), (0x1100, 0x11FF), (0x3040, 0x309F), (0x30A0, 0x30FF), (0x4E00, 0x9FFF),
    (0xAC00, 0xD7A3), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x1F300, 0x1FAFF), (0x2000, 0x206F),
    (0x2190, 0x22FF), (0xFF00, 0xFFEF), (0x0300, 0x036F), (0x1D400, 0x1D7FF), (0x10000, 0x1007F),
]

EMOJI = ["😀", "👍", "👍🏽", "❤️", "🇨🇳", "🇺🇸", "🏳️‍🌈", "👨‍👩‍👧‍👦", "👩🏾‍💻", "🧑‍🤝‍🧑", "1️⃣", "#️⃣",
         "🫠", "🥹", "🐈‍⬛", "😶‍🌫️", "❤️‍🔥", "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "©️", "™", "☕", "🚀", "✨", "🤖", "🧪"]

WS = [" ", "  ", "\t", "\n", "\n\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2028", "\u2029", "\u0085",
      "\v", "\f", "\u2009", "\u200b", "\u180e", "\u202f", "\u205f", "\u1680", "\ufeff"]

DIGITS = ["0123456789", "٠١٢٣٤٥٦٧٨٩", "۰۱۲۳۴۵۶۷۸۹", "०१२३४५६७८९", "０１２３４５６７８９", "①②③④⑤",
          "²³¹¼½¾", "ⅠⅡⅢⅣⅤ", "〇一二三", "𝟘𝟙𝟚𝟛", "๐๑๒๓"]


def rand_cp(rng, lo, hi):
    while True:
        c = rng.randint(lo, hi)
        if not 0xD800 <= c <= 0xDFFF:
            return chr(c)


def rand_word(rng):
    lo, hi = rng.choice(SCRIPTS)
    return "".join(rand_cp(rng, lo, hi) for _ in range(rng.randint(1, 9)))


def synthetic_multilingual(rng):
    parts = []
    for _ in range(rng.randint(1, 12)):
        r = rng.random()
        if r < 0.35:
            parts.append(rng.choice(SEED_SENTENCES))
        elif r < 0.7:
            parts.append(rand_word(rng))
        elif r < 0.8:
            parts.append(rng.choice(EMOJI))
        elif r < 0.9:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
        else:
            parts.append(rng.choice(".,;:!?-'\"()[]{}<>/\\@#$%^&*_+=|~`"))
        parts.append(rng.choice(["", " ", " ", " ", "\n", ", "]))
    return "".join(parts)


def emoji_string(rng):
    s = []
    for _ in range(rng.randint(1, 10)):
        e = rng.choice(EMOJI)
        if rng.random() < 0.3:
            e = e + "\u200d" + rng.choice(EMOJI)
        if rng.random() < 0.2:
            e += rng.choice(["\ufe0f", "\ufe0e", "\U0001f3fb", "\U0001f3ff", "\u20e3"])
        s.append(e)
        s.append(rng.choice(["", "", " ", "a", "中", "\n", "!"]))
    return "".join(s)


def digit_string(rng):
    r = rng.random()
    if r < 0.4:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 200)))
    if r < 0.7:
        d = rng.choice(DIGITS)
        return "".join(rng.choice(d) for _ in range(rng.randint(1, 40)))
    parts = []
    for _ in range(rng.randint(1, 8)):
        parts.append("".join(rng.choice(rng.choice(DIGITS)) for _ in range(rng.randint(1, 7))))
        parts.append(rng.choice(["", ".", ",", " ", "-", "e", "x", "abc", "中", "_", "/", ":"]))
    return "".join(parts)


def ws_string(rng):
    parts = []
    for _ in range(rng.randint(1, 12)):
        if rng.random() < 0.6:
            parts.append("".join(rng.choice(WS) for _ in range(rng.randint(1, 8))))
        else:
            parts.append(rng.choice(["a", "word", "中文", "x1", ".", "!", "é", "\u0301", "--", "😀", "Ab"]))
    return "".join(parts)


def control_string(rng):
    parts = []
    for _ in range(rng.randint(1, 20)):
        r = rng.random()
        if r < 0.35:
            parts.append(chr(rng.choice(list(range(0, 32)) + [127] + list(range(0x80, 0xA0)))))
        elif r < 0.5:
            parts.append(rng.choice(["\u200e", "\u200f", "\u202a", "\u202e", "\u2066", "\u2069", "\u200c",
                                     "\u200d", "\u2060", "\ufeff", "\ufffd", "\ufffe", "\uffff", "\U000e0001",
                                     "\U0010ffff", "\U000f0000", "\ue000"]))
        elif r < 0.7:
            parts.append("a" + "".join(chr(rng.randint(0x300, 0x36F)) for _ in range(rng.randint(1, 12))))
        else:
            parts.append(rng.choice(["text", " ", "\\x00", "\\n", "%s", "{{}}", "NUL", "ESC[31m", "\x1b[0m"]))
    return "".join(parts)


def special_string(rng, added):
    parts = []
    for _ in range(rng.randint(1, 8)):
        r = rng.random()
        if r < 0.5:
            parts.append(rng.choice(added))
        elif r < 0.65:
            t = rng.choice(added)
            parts.append(t[: rng.randint(1, max(1, len(t) - 1))])  # a proper prefix
        elif r < 0.8:
            parts.append(rng.choice(["<｜DSML｜tool_calls>", "</｜DSML｜invoke>", '<｜DSML｜ parameter name="q" string="true">',
                                     "<think>", "</think>", "<｜User｜>", "<｜Assistant｜>", "｜", "▁", "<｜", "｜>"]))
        else:
            parts.append(rng.choice(["hello", " ", "\n\n", "中文", "x", "{\"a\": 1}", "<tool_result>", "😀"]))
    return "".join(parts)


def codepoint_strings(rng):
    """Every code point of planes 0-2 twice (in two random contexts), a sample of the others."""
    cps = [c for c in range(0x30000) if not 0xD800 <= c <= 0xDFFF]
    cps += list(range(0x30000, 0x110000, 61))
    ctx = ["", " ", "a", "1", "\n", "中", ".", " x", "  ", "é", "\t", "ア"]
    out = []
    for rep in range(2):
        order = cps[:]
        if rep:
            rng.shuffle(order)
        for i in range(0, len(order), 40):
            out.append("".join(rng.choice(ctx) + chr(c) for c in order[i: i + 40]))
    return out


def long_strings(rng):
    return [
        "a" * 5000, " " * 20000, "\n" * 3000, "ab" * 4000, "中" * 3000, "😀" * 1000, "1" * 10000,
        "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/") for _ in range(30000)),
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(20000)),
        " \t" * 5000 + "x", "=" * 4000, "-" * 8000 + "\n", "." * 3000, "é" * 4000, "ñ̃" * 2000,
        "".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(8000)),
        "".join(chr(rng.randint(0x0E00, 0x0E7F)) for _ in range(6000)),
    ]


# ---- main ----

def plain_ids(tok, text):
    ids = []
    for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text):
        ids.extend(t.id for t in tok.model.tokenize(piece))
    return ids


def write_decode_golden(tok, path, seed):
    """tests/data/tok/decode.jsonl.gz: random id sequences and HF's decode of them, with and without
    skip_special_tokens: byte tokens that do not form UTF-8 (U+FFFD repair), added tokens, any ids."""
    rng = random.Random(seed)
    n_vocab = tok.get_vocab_size(with_added_tokens=True)
    added = sorted(tok.get_added_tokens_decoder().keys())
    byte_ids = [tok.token_to_id(c) for c in
                (chr(c) for c in list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256)) + list(range(256, 324)))]
    byte_ids = [i for i in byte_ids if i is not None]
    with gzip.open(path + ".tmp", "wt", encoding="utf-8", compresslevel=9) as f:
        f.write(json.dumps({"generator": GENERATOR, "tokenizers": tokenizers.__version__}) + "\n")
        for _ in range(5000):
            ids = []
            for _ in range(rng.randint(0, 24)):
                r = rng.random()
                ids.append(rng.choice(byte_ids) if r < 0.5 else rng.choice(added) if r < 0.65
                           else rng.randrange(n_vocab))
            rec = {"ids": ids, "text": tok.decode(ids, skip_special_tokens=False),
                   "skip": tok.decode(ids, skip_special_tokens=True)}
            f.write(json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n")
    os.replace(path + ".tmp", path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "data/tokenizer/deepseek-v4/tokenizer.json"))
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/data/tok/corpus.jsonl.gz"))
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument("--decode-only", action="store_true", help="only write decode.jsonl.gz")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    tok = Tokenizer.from_file(args.tokenizer)
    write_decode_golden(tok, os.path.join(os.path.dirname(args.out), "decode.jsonl.gz"), args.seed)
    if args.decode_only:
        return 0
    added = [t.content for t in tok.get_added_tokens_decoder().values()]
    added.sort()

    corpus = []
    corpus += codepoint_strings(rng)
    corpus += prose_strings(rng, 28000)
    corpus += code_strings(rng, 30000)
    corpus += [synthetic_multilingual(rng) for _ in range(14000)]
    corpus += [emoji_string(rng) for _ in range(5000)]
    corpus += [digit_string(rng) for _ in range(5000)]
    corpus += [ws_string(rng) for _ in range(6000)]
    corpus += [control_string(rng) for _ in range(5000)]
    corpus += [special_string(rng, added) for _ in range(8000)]
    corpus += added  # every added token alone
    corpus += long_strings(rng)
    corpus += ["", " ", "\n", "a", "<", "｜"]
    # dedupe, keep order
    seen = set()
    corpus = [s for s in corpus if not (s in seen or seen.add(s))]

    sha = hashlib.sha256(open(args.tokenizer, "rb").read()).hexdigest()
    special = [e.ids for e in tok.encode_batch(corpus, add_special_tokens=False)]
    n_rt_fail = 0
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with gzip.open(args.out + ".tmp", "wt", encoding="utf-8", compresslevel=9) as f:
        hdr = {"generator": GENERATOR, "tokenizers": tokenizers.__version__, "tokenizer_sha256": sha,
               "seed": args.seed, "n": len(corpus)}
        f.write(json.dumps(hdr) + "\n")
        for text, s_ids in zip(corpus, special):
            p_ids = plain_ids(tok, text)
            if tok.decode(s_ids, skip_special_tokens=False) != text or tok.decode(p_ids) != text:
                n_rt_fail += 1
            rec = {"t": text, "s": s_ids}
            if p_ids != s_ids:
                rec["p"] = p_ids
            f.write(json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n")
    os.replace(args.out + ".tmp", args.out)
    print(f"{len(corpus)} strings, {sum(len(s) for s in special)} ids, "
          f"{n_rt_fail} HF decode round-trip failures -> {args.out}", file=sys.stderr)
    return 0 if n_rt_fail == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
