#!/usr/bin/env python3
"""Checks the links of README.md and docs/*.md (ctest docs_links, labels cpu and docs).

- a relative Markdown link [text](path) or [text](path#anchor) must name an existing file, and an
  anchor into a Markdown file one of its headings' GitHub anchors (lowercased, punctuation but
  hyphens dropped, spaces to hyphens, -1, -2, ... for repeats);
- a section named in prose after a file name, `kv-cache.md, "Disk tier"` or `cuda.md "Benchmarks"`,
  must begin a heading or a bold paragraph title (`**Disk tier...`) of that file (case-insensitive).
Code blocks are skipped. Prints every broken reference and exits 1 if there is one.
Usage: check_links.py [REPO_ROOT] (default: the repository holding this file).
"""
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
docs = sorted("docs/" + f for f in os.listdir(os.path.join(root, "docs")) if f.endswith(".md"))
files = ["README.md"] + docs
CODE = re.compile(r"^```.*?^```", re.S | re.M)


def text_of(f):
    with open(os.path.join(root, f), encoding="utf-8") as fh:
        return CODE.sub("", fh.read())


def slug(heading):
    s = heading.strip().lower().replace("`", "")
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


texts = {f: text_of(f) for f in files}
anchors, titles = {}, {}
for f, t in texts.items():
    seen, a = {}, set()
    heads = [m.group(1) for m in re.finditer(r"^#+\s+(.*)$", t, re.M)]
    for h in heads:
        s = slug(h)
        a.add(s if s not in seen else f"{s}-{seen[s] + 1}")
        seen[s] = seen.get(s, -1) + 1
    anchors[f] = a
    titles[f] = [h.replace("`", "").lower() for h in heads]

bad = []
for f, t in texts.items():
    for m in re.finditer(r"\]\(([^)\s]+)\)", t):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, frag = target.partition("#")
        tgt = os.path.normpath(os.path.join(os.path.dirname(f), path)) if path else f
        if not os.path.exists(os.path.join(root, tgt)):
            bad.append(f"{f}: link to a missing file: {target}")
        elif frag and tgt in anchors and frag not in anchors[tgt]:
            bad.append(f"{f}: link to a missing anchor: {target}")
    for m in re.finditer(r"\b([A-Za-z-]+\.md)\)?`?,? \"([^\"\n]+)\"", t):
        name, section = m.group(1), m.group(2).replace("`", "").lower()
        tgt = "README.md" if name == "README.md" else "docs/" + name
        if tgt not in texts:
            continue  # another project's file (the spec's serving.md, ...)
        body = texts[tgt].replace("`", "").lower()
        if not any(h.startswith(section) for h in titles[tgt]) and "**" + section not in body:
            bad.append(f'{f}: no section "{m.group(2)}" in {tgt}')

for b in bad:
    print(b)
print(f"{len(files)} files, {len(bad)} broken references")
sys.exit(1 if bad else 0)
