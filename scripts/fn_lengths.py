#!/usr/bin/env python3
"""Every library function fits on a screen: none is longer than 70 lines.

    python3 scripts/fn_lengths.py [--max N] [PATH ...]

Scans the `src/` trees of the library crates (the workspace members but the
CLI, and the Python binding), or the given files and folders, for `fn` items
with a body and prints each one longer than the limit, counted from its `fn`
line to its closing brace, as `file:line: name: N lines`. Exits 1 if any.
Test code (`#[cfg(test)]` items, their modules' files) is left out.

Bodies are found by matching braces once comments, strings (byte and raw
strings included) and char literals are blanked out; a lifetime such as `'a`
is not a char literal.
"""

import argparse
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
MAX_LINES = 70
# The CLI is a binary, not a library; the Python binding is a library crate
# outside the workspace.
NOT_LIBRARIES = {"cli"}
EXTRA_LIBRARIES = ["python"]

IDENT = re.compile(r"[A-Za-z0-9_]")


def library_src_dirs():
    """The `src/` folder of every library crate, from the workspace manifest."""
    with open(os.path.join(ROOT, "Cargo.toml"), encoding="utf-8") as f:
        manifest = f.read()
    members = re.search(r"^members\s*=\s*\[(.*?)\]", manifest, re.S | re.M)
    crates = re.findall(r'"([^"]+)"', members.group(1))
    crates = [c for c in crates if c not in NOT_LIBRARIES] + EXTRA_LIBRARIES
    return [os.path.normpath(os.path.join(ROOT, c, "src")) for c in crates]


def blank(text):
    """`text` with comments, strings and char literals turned into spaces.

    Newlines stay where they are, so offsets and line numbers still hold.
    """
    out = list(text)
    n = len(text)
    i = 0

    def wipe(start, end):
        for k in range(start, end):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if c == "/" and text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            wipe(i, end)
            i = end
        elif c == "/" and text.startswith("/*", i):
            # Block comments nest in Rust.
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            wipe(i, j)
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            wipe(i, j + 1)
            i = j + 1
        elif c == "'":
            i = skip_quote(text, i, wipe)
        elif IDENT.match(c):
            j = i
            while j < n and IDENT.match(text[j]):
                j += 1
            word = text[i:j]
            raw = re.compile(r"#*\"").match(text, j)
            if word in ("r", "br", "cr") and raw:
                # r"..", r#".."#: no escapes; ends at `"` and as many `#`.
                close = '"' + "#" * (raw.end() - j - 1)
                end = text.find(close, raw.end())
                end = n if end < 0 else end + len(close)
                wipe(i, end)
                i = end
            else:
                # b".." and c".." then go through the plain string case.
                i = j
        else:
            i += 1
    return "".join(out)


def skip_quote(text, i, wipe):
    """Blanks the char literal at `i` (`'x'`, `'\\n'`, `b'{'`); a lifetime or
    label (`'a`, `'static`, `'outer:`) is left as it is. Returns where to go on."""
    n = len(text)
    if i + 1 < n and text[i + 1] == "\\":
        # The escaped character may itself be a quote: '\''.
        j = i + 3
        while j < n and text[j] != "'":
            j += 1
        wipe(i, j + 1)
        return j + 1
    if i + 2 < n and text[i + 2] == "'":
        wipe(i, i + 3)
        return i + 3
    return i + 1


def line_of(starts, offset):
    """The 1-based line of `offset`, given the offsets where lines start."""
    lo, hi = 0, len(starts)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if starts[mid] <= offset:
            lo = mid
        else:
            hi = mid
    return lo + 1


def item_end(code, start):
    """Where the item starting at `start` ends: past the `}` closing its
    body, or past its `;` when it has none (`fn f();`, `mod m;`)."""
    nest = 0  # () and []: a `{` there (a const block in a type) is not the body
    i = start
    n = len(code)
    while i < n:
        c = code[i]
        if c in "([":
            nest += 1
        elif c in ")]":
            nest -= 1
        elif c == ";" and nest == 0:
            return i + 1, False
        elif c == "{" and nest == 0:
            depth = 0
            while i < n:
                if code[i] == "{":
                    depth += 1
                elif code[i] == "}":
                    depth -= 1
                    if depth == 0:
                        return i + 1, True
                i += 1
            return n, True
        i += 1
    return n, False


TEST_CFG = re.compile(r"#\[cfg\((?:all\()?\s*test\b[^\]]*\]")
# The attributes and qualifiers that may come between `#[cfg(test)]` and
# the item it applies to.
ATTRS = re.compile(r"(?:\s|#\[[^\]]*\]|pub(?:\([^)]*\))?)*")
ITEM = re.compile(r"(?:const|async|unsafe|extern|fn|mod|impl|trait|struct|enum|use|static|type|macro_rules)\b")
MOD_DECL = re.compile(r"mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;")
FN = re.compile(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)")


def test_items(code):
    """The spans of `#[cfg(test)]` items, and the names of test modules
    declared without a body (`#[cfg(test)] mod tests;`)."""
    spans, files = [], []
    for m in TEST_CFG.finditer(code):
        start = ATTRS.match(code, m.end()).end()
        decl = MOD_DECL.match(code, start)
        if decl:
            files.append(decl.group(1))
            continue
        if not ITEM.match(code, start):
            continue  # a field, a variant, a statement: no function in it
        end, _ = item_end(code, start)
        spans.append((m.start(), end))
    return spans, files


def module_files(path, name):
    """The files that `mod name;` in `path` can refer to."""
    base = os.path.basename(path)
    if base in ("lib.rs", "main.rs", "mod.rs"):
        folder = os.path.dirname(path)
    else:
        folder = os.path.splitext(path)[0]
    return [os.path.join(folder, name + ".rs"), os.path.join(folder, name, "mod.rs")]


def long_fns(path, limit):
    """(line, name, lines) of each function in `path` over `limit` lines,
    and the files of its test modules."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    code = blank(text)
    starts = [0] + [m.end() for m in re.finditer("\n", code)]
    spans, test_mods = test_items(code)
    found = []
    for m in FN.finditer(code):
        if any(a <= m.start() < b for a, b in spans):
            continue
        end, has_body = item_end(code, m.end())
        if not has_body:
            continue
        first, last = line_of(starts, m.start()), line_of(starts, end - 1)
        if last - first + 1 > limit:
            found.append((first, m.group(1), last - first + 1))
    test_files = [p for name in test_mods for p in module_files(path, name)]
    return found, test_files


def rust_files(paths):
    for top in paths:
        if os.path.isfile(top):
            yield os.path.normpath(top)
            continue
        for folder, dirs, names in os.walk(top):
            dirs.sort()
            for name in sorted(names):
                if name.endswith(".rs"):
                    yield os.path.normpath(os.path.join(folder, name))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=int, default=MAX_LINES, help="lines allowed (70)")
    parser.add_argument("paths", nargs="*", help="files or folders (the library crates' src/)")
    args = parser.parse_args()
    files = list(rust_files(args.paths or library_src_dirs()))
    reports, test_files = [], set()
    for path in files:
        found, tests = long_fns(path, args.max)
        test_files.update(os.path.normpath(p) for p in tests)
        reports.extend((path, line, name, lines) for line, name, lines in found)
    bad = [r for r in reports if r[0] not in test_files]
    for path, line, name, lines in bad:
        print(f"{os.path.relpath(path, ROOT)}:{line}: fn {name}: {lines} lines (> {args.max})")
    if bad:
        print(f"{len(bad)} function(s) over {args.max} lines: split them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
