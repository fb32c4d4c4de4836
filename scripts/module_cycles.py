#!/usr/bin/env python3
"""Import circles between the modules of one Rust crate.

    python3 scripts/module_cycles.py CRATE/src [-v]

A module is a file (`foo.rs`, `foo/mod.rs`, the root `main.rs`/`lib.rs`);
A -> B when A names something of B through `crate::`, `super::` or (in a
parent) a child module's name, in `use` lines and in paths. A parent and its
children count as siblings: declaring `mod child;` is no edge, using it is.
Prints the strongly connected components of more than one module and exits 1
if there is one; `-v` prints every module's edges first. A name a module
brings in with `use` (a re-export, or a private import its children reach
through `super::`) counts as the module it comes from, so a parent that
only re-exports its children is no edge back. Approximate: a path is read
from the text (comments and strings left out), not from the compiler, and
a glob import is followed only when a module has just one.
"""
import os
import re
import sys


def strip(src):
    """`src` without comments, strings and char literals."""
    src = re.sub(r"//[^\n]*", "", src)
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    src = re.sub(r'\bb?r(#*)".*?"\1', '""', src, flags=re.S)
    src = re.sub(r'"(\\.|[^"\\])*"', '""', src, flags=re.S)
    return re.sub(r"'(\\.|[^'\\])'", "' '", src)


def modules(root):
    """Module path (a tuple of names; () for the root) -> file."""
    mods = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".rs"):
                rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].split(os.sep)
                if rel in (["main"], ["lib"]):
                    key = ()
                elif rel[-1] == "mod":
                    key = tuple(rel[:-1])
                else:
                    key = tuple(rel)
                mods[key] = os.path.join(dirpath, f)
    return mods


def split_top(text):
    """`text` split at the commas outside braces."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def use_items(tree, prefix=()):
    """Every path a use tree such as `a::{b, c::{d, e as f}}` names, with
    the name it binds (`*` for a glob)."""
    out = []
    for part in (p.strip() for p in split_top(tree)):
        group = re.match(r"^((?:\w+\s*::\s*)*)\{(.*)\}$", part, re.S)
        if group:
            segs = tuple(s for s in re.split(r"\s*::\s*", group.group(1)) if s)
            out += use_items(group.group(2), prefix + segs)
        elif part:
            alias = re.search(r"\s+as\s+(\w+)$", part)
            part = re.sub(r"\s+as\s+\w+$", "", part)
            segs = prefix + tuple(s for s in re.split(r"\s*::\s*", part) if s and s != "self")
            if segs:
                out.append((segs, alias.group(1) if alias else segs[-1]))
    return out


def use_paths(tree):
    """Every path a use tree names."""
    return [path for path, _ in use_items(tree)]


def inline_mods(src):
    """Spans of inline `mod x { ... }` blocks (their `super` is the file)."""
    spans = []
    for m in re.finditer(r"\bmod\s+\w+\s*\{", src):
        depth, i = 1, m.end()
        while depth and i < len(src):
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            i += 1
        spans.append((m.start(), i))
    return spans


def absolute(path, me, inline, children):
    """`path` from the crate root, or None when it leaves the crate."""
    head, rest = path[0], list(path[1:])
    if head == "crate":
        return rest
    if head == "super":
        return None if inline and rest[:1] == ["super"] else list(me if inline else me[:-1]) + rest
    if head == "self" or head in children:
        return list(me) + ([] if head == "self" else [head]) + rest
    return None


def children_of(mods, me):
    return {k[-1] for k in mods if len(k) == len(me) + 1 and k[: len(me)] == me}


def aliases(mods, sources):
    """Module -> {name it binds with `use` (outside inline modules): the
    absolute path it stands for}."""
    out = {}
    for me, src in sources.items():
        spans, bound = inline_mods(src), {}
        for m in re.finditer(r"\buse\s+([^;]+);", src):
            if any(a <= m.start() < b for a, b in spans):
                continue
            for path, name in use_items(m.group(1)):
                full = absolute(path, me, False, children_of(mods, me))
                if full is not None:
                    bound.setdefault(name, []).append(tuple(full[:-1]) if name == "*" else tuple(full))
        out[me] = bound
    return out


def resolve(full, mods, names):
    """`full` with each name a module re-exports replaced by its source."""
    full = tuple(full)
    for _ in range(16):
        n = next(n for n in range(len(full), -1, -1) if full[:n] in mods)
        if n == len(full):
            return full
        bound = names[full[:n]]
        globs = bound.get("*", [])
        if full[n] in bound:
            full = bound[full[n]][0] + full[n + 1:]
        elif len(globs) == 1 and globs[0] != full[:n]:
            full = globs[0] + full[n:]
        else:
            return full
    return full


def edges(root):
    mods = modules(root)
    graph = {m: set() for m in mods}
    sources = {me: strip(open(f, encoding="utf-8").read()) for me, f in mods.items()}
    names = aliases(mods, sources)
    for me in mods:
        src = sources[me]
        spans = inline_mods(src)
        children = children_of(mods, me)
        # A re-export (`pub use`) declares the module's surface; only what
        # a module brings in for its own code is an edge.
        uses = [m for m in re.finditer(r"(\bpub(?:\([\w\s:]+\))?\s+)?\buse\s+([^;]+);", src)]
        paths = [(m.start(), p) for m in uses if not m.group(1) for p in use_paths(m.group(2))]
        src = "".join(ch if not any(a <= i < b for m in uses for a, b in [m.span()]) else " " for i, ch in enumerate(src))
        paths += [
            (m.start(), tuple(re.split(r"\s*::\s*", m.group(1))))
            for m in re.finditer(r"(?<![\w:])(\w+(?:\s*::\s*\w+)+)", src)
        ]
        for at, path in paths:
            inline = any(a <= at < b for a, b in spans)
            full = absolute(path, me, inline, children) if path else None
            if full is None:
                continue
            full = resolve(full, mods, names)
            target = next(tuple(full[:n]) for n in range(len(full), -1, -1) if tuple(full[:n]) in mods)
            if target != me:
                graph[me].add(target)
    return graph


def components(graph):
    """Tarjan's strongly connected components."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            out.append(comp)

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def name(m):
    return "::".join(m) or "(root)"


def main(argv):
    root = argv[1]
    graph = edges(root)
    if "-v" in argv:
        for m in sorted(graph, key=name):
            print(f"{name(m):24} -> {', '.join(sorted(map(name, graph[m]))) or '(none)'}")
    circles = sorted((c for c in components(graph) if len(c) > 1), key=len, reverse=True)
    for c in circles:
        print(f"{root}: an import circle of {len(c)} modules: {', '.join(sorted(map(name, c)))}")
    if not circles:
        print(f"{root}: {len(graph)} modules, no import circle")
    return 1 if circles else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
