#!/usr/bin/env python3
"""Finds import cycles between the source files of each crate under crates/.

Each crate's files under src/ are the nodes of a graph (a file is a module: `foo.rs` and
`foo/mod.rs` are module `foo`; `lib.rs`, `main.rs` and each `src/bin/` program are roots).
File A has an edge to file B when A's code names B's module: `use crate::b::...` and
`crate::b::...` paths anywhere, `super::`/`super::super::` resolved from A's module,
`self::b` and paths starting with the name of one of A's child modules. A path names the
file of the longest module prefix it has, so `crate::Item` names the crate root's file and
`super::X` the parent's: a child using its parent's items is an edge child -> parent. A
parent's `mod child;` declaration is not an edge. Comments, string literals and items under
`#[cfg(test)]` (test modules) are ignored.

A strongly connected component of more than one file is a cycle: every one is printed with
its files and, for each edge inside it, the first reference that made it. The exit status
is 1 when there is a cycle, 0 otherwise. `--list` prints every edge as well.

Python 3.11 standard library only.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

# --- Lexing ---------------------------------------------------------------------------------

IDENT, PUNCT, LITERAL = "ident", "punct", "literal"


@dataclass(frozen=True)
class Token:
    kind: str
    text: str
    line: int


class LexError(ValueError):
    """Source the lexer cannot read (an unterminated comment or literal)."""


def _is_ident_start(c: str) -> bool:
    return c == "_" or c.isalpha()


def _is_ident_char(c: str) -> bool:
    return c == "_" or c.isalnum()


def tokenize(src: str) -> list[Token]:
    """Rust tokens that matter for paths: identifiers and punctuation (`::` is one token).

    Comments are dropped; string, char and number literals become LITERAL tokens (their
    text kept only for strings, so `#[path = "..."]` can be read); lifetimes are dropped.
    """
    out: list[Token] = []
    i, n, line = 0, len(src), 1

    def skip_quoted(j: int, quote: str) -> int:
        """Index past the closing `quote` of a literal whose body starts at `j`."""
        nonlocal line
        while j < n:
            c = src[j]
            if c == "\\":
                if j + 1 < n and src[j + 1] == "\n":
                    line += 1
                j += 2
                continue
            if c == "\n":
                line += 1
            if c == quote:
                return j + 1
            j += 1
        raise LexError(f"unterminated literal near line {line}")

    def raw_string(j: int) -> int | None:
        """If a raw string starts at `j` (at its `r`), the index past it; else None."""
        nonlocal line
        k = j + 1
        hashes = 0
        while k < n and src[k] == "#":
            hashes += 1
            k += 1
        if k >= n or src[k] != '"':
            return None
        end = src.find('"' + "#" * hashes, k + 1)
        if end < 0:
            raise LexError(f"unterminated raw string near line {line}")
        line += src.count("\n", k, end)
        return end + 1 + hashes

    while i < n:
        c = src[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif src.startswith("//", i):
            end = src.find("\n", i)
            i = n if end < 0 else end
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while depth:
                if j >= n:
                    raise LexError(f"unterminated block comment near line {line}")
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    if src[j] == "\n":
                        line += 1
                    j += 1
            i = j
        elif c == '"':
            start_line, j = line, skip_quoted(i + 1, '"')
            out.append(Token(LITERAL, src[i + 1 : j - 1], start_line))
            i = j
        elif c == "'":
            # A char literal ('a', '\n', '\'', '"') or a lifetime/label ('a, 'static).
            if i + 1 < n and src[i + 1] == "\\":
                i = skip_quoted(i + 1, "'")
                out.append(Token(LITERAL, "", line))
            elif i + 2 < n and src[i + 2] == "'":
                i += 3
                out.append(Token(LITERAL, "", line))
            else:
                j = i + 1
                while j < n and _is_ident_char(src[j]):
                    j += 1
                i = j
        elif _is_ident_start(c):
            # Literal prefixes (b"..", b'..', c"..", r"..", r#".."#, br"..", cr"..") and
            # raw identifiers (r#name).
            if c in "bcr":
                k = i + 1 if c in "bc" else i
                if k < n and src[k] == "r":
                    start_line, end = line, raw_string(k)
                    if end is not None:
                        body = src[k + 1 : end].strip("#")[1:-1]
                        out.append(Token(LITERAL, body, start_line))
                        i = end
                        continue
                elif k > i and k < n and src[k] in "\"'":
                    start_line, end = line, skip_quoted(k + 1, src[k])
                    out.append(Token(LITERAL, src[k + 1 : end - 1], start_line))
                    i = end
                    continue
                if (
                    c == "r"
                    and src.startswith("r#", i)
                    and i + 2 < n
                    and _is_ident_start(src[i + 2])
                ):
                    j = i + 2
                    while j < n and _is_ident_char(src[j]):
                        j += 1
                    out.append(Token(IDENT, src[i + 2 : j], line))
                    i = j
                    continue
            j = i + 1
            while j < n and _is_ident_char(src[j]):
                j += 1
            out.append(Token(IDENT, src[i:j], line))
            i = j
        elif c.isdigit():
            j = i + 1
            while j < n and (
                _is_ident_char(src[j]) or (src[j] == "." and j + 1 < n and src[j + 1].isdigit())
            ):
                j += 1
            out.append(Token(LITERAL, "", line))
            i = j
        elif src.startswith("::", i):
            out.append(Token(PUNCT, "::", line))
            i += 2
        else:
            out.append(Token(PUNCT, c, line))
            i += 1
    return out


# --- Dropping test-only code ----------------------------------------------------------------

OPENERS = {"(": ")", "[": "]", "{": "}"}
CLOSERS = {")", "]", "}"}
ITEM_KEYWORDS = {
    "mod",
    "fn",
    "use",
    "impl",
    "struct",
    "enum",
    "union",
    "const",
    "static",
    "trait",
    "type",
    "macro_rules",
    "extern",
}
MODIFIERS = {"pub", "unsafe", "async", "default"}


def _is(tokens: list[Token], i: int, text: str) -> bool:
    return i < len(tokens) and tokens[i].text == text and tokens[i].kind != LITERAL


def _matching(tokens: list[Token], i: int) -> int:
    """Index of the closer matching the opener at `i` (len(tokens) if none)."""
    depth = 0
    for j in range(i, len(tokens)):
        t = tokens[j]
        if t.kind != PUNCT:
            continue
        if t.text in OPENERS:
            depth += 1
        elif t.text in CLOSERS:
            depth -= 1
            if depth == 0:
                return j
    return len(tokens)


def _cfg_is_test_only(pred: list[Token]) -> bool:
    """Whether a `cfg(...)` predicate (the tokens between its parentheses) needs `test`:
    `test` itself, or `all(...)` with a test-only member."""
    if len(pred) == 1 and pred[0].text == "test":
        return True
    if len(pred) >= 3 and pred[0].text == "all" and pred[1].text == "(":
        members: list[list[Token]] = [[]]
        depth = 0
        for t in pred[2 : _matching(pred, 1)]:
            if t.kind == PUNCT and t.text in OPENERS:
                depth += 1
            elif t.kind == PUNCT and t.text in CLOSERS:
                depth -= 1
            if depth == 0 and t.text == "," and t.kind == PUNCT:
                members.append([])
            else:
                members[-1].append(t)
        return any(_cfg_is_test_only(m) for m in members)
    return False


def _test_attribute_end(tokens: list[Token], i: int, inner: bool) -> int | None:
    """If a `#[cfg(test)]`-like attribute (`#![...]` when `inner`) starts at `i`, the
    index past it; else None."""
    j = i + 1
    if inner:
        if not _is(tokens, j, "!"):
            return None
        j += 1
    if not (_is(tokens, j, "[") and _is(tokens, j + 1, "cfg") and _is(tokens, j + 2, "(")):
        return None
    close_paren = _matching(tokens, j + 2)
    if not _is(tokens, close_paren + 1, "]"):
        return None
    if not _cfg_is_test_only(tokens[j + 3 : close_paren]):
        return None
    return close_paren + 2


def _skip_attributes(tokens: list[Token], j: int) -> int:
    while _is(tokens, j, "#") and _is(tokens, j + 1, "["):
        j = _matching(tokens, j + 1) + 1
    return j


def _item_end(tokens: list[Token], j: int) -> int:
    """Index past the item or statement that starts at `j` (after its attributes)."""
    k = j
    while k < len(tokens) and tokens[k].text in MODIFIERS and tokens[k].kind == IDENT:
        k += 1
        if _is(tokens, k, "("):  # pub(crate), pub(in path)
            k = _matching(tokens, k) + 1
    if k < len(tokens) and tokens[k].kind == LITERAL:  # extern "C"
        k += 1
    is_item = k < len(tokens) and tokens[k].text in ITEM_KEYWORDS and tokens[k].kind == IDENT
    depth = 0
    for m in range(j, len(tokens)):
        t = tokens[m]
        if t.kind != PUNCT:
            continue
        if t.text in OPENERS:
            depth += 1
        elif t.text in CLOSERS:
            if depth == 0:  # the enclosing block ends: the item ended before it
                return m
            depth -= 1
            if depth == 0 and t.text == "}":
                return m + 1
        elif depth == 0 and (t.text == ";" or (t.text == "," and not is_item)):
            return m + 1
    return len(tokens)


def drop_test_code(tokens: list[Token]) -> list[Token]:
    """The tokens without what `#[cfg(test)]` (or `cfg(all(test, ..))`) guards: the item,
    statement or field that follows the attribute. A file whose inner attributes include
    `#![cfg(test)]` is test code as a whole: nothing is left of it."""
    i = 0
    while _is(tokens, i, "#") and _is(tokens, i + 1, "!") and _is(tokens, i + 2, "["):
        if _test_attribute_end(tokens, i, inner=True) is not None:
            return []
        i = _matching(tokens, i + 2) + 1
    out: list[Token] = tokens[:i]
    while i < len(tokens):
        if _is(tokens, i, "#"):
            end = _test_attribute_end(tokens, i, inner=False)
            if end is not None:
                i = _item_end(tokens, _skip_attributes(tokens, end))
                continue
        out.append(tokens[i])
        i += 1
    return out


# --- Paths ----------------------------------------------------------------------------------

Scope = tuple[str, ...]
DEFINING_KEYWORDS = {"fn", "struct", "enum", "union", "trait", "type", "const", "static", "mod"}


@dataclass(frozen=True)
class PathRef:
    """A path the code names, and the module scope (inline modules included, relative to
    the file's module) it is written in."""

    segments: tuple[str, ...]
    scope: Scope
    line: int


@dataclass
class FileScan:
    """What one file declares, imports and refers to."""

    child_files: list[tuple[Scope, str, str | None]] = field(default_factory=list)
    """`mod name;` declarations: (inline scope inside the file, name, #[path] if any)."""
    inline_modules: list[Scope] = field(default_factory=list)
    """Inline `mod name { .. }` modules, as scopes relative to the file's module."""
    defined: set[tuple[Scope, str]] = field(default_factory=set)
    """Items defined at a module's top level: (scope, name)."""
    imported: dict[tuple[Scope, str], PathRef] = field(default_factory=dict)
    """Names a module's top-level `use` binds: (scope, name) -> the path it names."""
    globs: list[PathRef] = field(default_factory=list)
    """Top-level glob imports (`use path::*`): the path globbed."""
    refs: list[PathRef] = field(default_factory=list)
    """Every path with `::` and every path a `use` names."""


def _parse_use_tree(
    tokens: list[Token], i: int, prefix: tuple[str, ...], out: list[tuple[tuple[str, ...], str]]
) -> int:
    """Parses a `use` tree at `i`; appends (full path, name it binds) to `out`, the name
    being `*` for a glob and `_` for `as _`; returns the index past the tree.
    `use a::{self, b}` gives (a, "a") and (a::b, "b")."""
    if _is(tokens, i, "{"):
        i += 1
        while i < len(tokens) and not _is(tokens, i, "}"):
            i = _parse_use_tree(tokens, i, prefix, out)
            if _is(tokens, i, ","):
                i += 1
            elif not _is(tokens, i, "}"):
                i += 1  # something this parser does not know: skip it
        return i + 1
    if _is(tokens, i, "*"):
        out.append((prefix, "*"))
        return i + 1
    segs: tuple[str, ...] = ()
    if _is(tokens, i, "::"):  # `use ::std::...`: an extern crate
        segs = ("::",)
        i += 1
    while i < len(tokens) and tokens[i].kind == IDENT:
        name = tokens[i].text
        if not (name == "self" and (prefix or segs)):
            segs += (name,)
        i += 1
        if not _is(tokens, i, "::"):
            break
        i += 1
        if _is(tokens, i, "{") or _is(tokens, i, "*"):
            return _parse_use_tree(tokens, i, prefix + segs, out)
    path = prefix + segs
    bound = path[-1] if path else ""
    if _is(tokens, i, "as") and i + 1 < len(tokens):
        bound = tokens[i + 1].text
        i += 2
    if path:
        out.append((path, bound))
    return i


def scan_file(tokens: list[Token]) -> FileScan:
    """Finds module declarations, top-level items and imports, and referenced paths in a
    file's (test-free) tokens."""
    scan = FileScan()
    scope: list[str] = []
    # Brace depth of the body of each inline module of `scope`.
    body_depth: list[int] = []
    depth = 0
    path_attr: str | None = None
    i = 0
    n = len(tokens)
    while i < n:
        t = tokens[i]
        top_level = depth == (body_depth[-1] if body_depth else 0)
        if t.kind == PUNCT:
            if t.text == "{":
                depth += 1
            elif t.text == "}":
                depth -= 1
                if body_depth and depth < body_depth[-1]:
                    body_depth.pop()
                    scope.pop()
            elif t.text == "#" and _is(tokens, i + 1, "["):
                end = _matching(tokens, i + 1)
                body = tokens[i + 2 : end]
                if (
                    len(body) == 3
                    and body[0].text == "path"
                    and body[1].text == "="
                    and body[2].kind == LITERAL
                ):
                    path_attr = body[2].text
                i = end + 1
                continue
            elif t.text == "$" and _is(tokens, i + 1, "crate") and _is(tokens, i + 2, "::"):
                i += 1  # `$crate::x` in a macro is `crate::x`
                continue
            i += 1
            continue
        if t.kind == LITERAL:
            i += 1
            continue
        here = tuple(scope)
        if t.text == "mod" and i + 1 < n and tokens[i + 1].kind == IDENT:
            name = tokens[i + 1].text
            if _is(tokens, i + 2, ";"):
                scan.child_files.append((here, name, path_attr))
                scan.defined.add((here, name))
                path_attr = None
                i += 3
                continue
            if _is(tokens, i + 2, "{"):
                scan.defined.add((here, name))
                scope.append(name)
                scan.inline_modules.append(tuple(scope))
                depth += 1
                body_depth.append(depth)
                path_attr = None
                i += 3
                continue
        if top_level and t.text in DEFINING_KEYWORDS:
            j = i + 2 if _is(tokens, i + 1, "mut") else i + 1  # static mut NAME
            if j < n and tokens[j].kind == IDENT:
                scan.defined.add((here, tokens[j].text))
        elif top_level and t.text == "macro_rules" and _is(tokens, i + 1, "!") and i + 2 < n:
            scan.defined.add((here, tokens[i + 2].text))
        if t.text == "pub" and _is(tokens, i + 1, "(") and _is(tokens, i + 2, "in"):
            i = _matching(tokens, i + 1) + 1  # pub(in path): a visibility, not a use
            continue
        if t.text == "use":
            paths: list[tuple[tuple[str, ...], str]] = []
            j = _parse_use_tree(tokens, i + 1, (), paths)
            for path, bound in paths:
                ref = PathRef(path, here, t.line)
                scan.refs.append(ref)
                if not top_level:
                    continue
                if bound == "*":
                    scan.globs.append(ref)
                elif bound != "_":
                    scan.imported[(here, bound)] = ref
            i = j
            continue
        # An expression or type path: ident (:: ident)*, not the tail of a longer one.
        if t.kind == IDENT and not (i > 0 and _is(tokens, i - 1, "::")):
            segs = [t.text]
            j = i + 1
            while _is(tokens, j, "::") and j + 1 < n and tokens[j + 1].kind == IDENT:
                segs.append(tokens[j + 1].text)
                j += 2
            if len(segs) > 1:
                scan.refs.append(PathRef(tuple(segs), here, t.line))
            i = j if len(segs) > 1 else i + 1
            continue
        i += 1
    return scan


# --- Crates ---------------------------------------------------------------------------------


@dataclass
class CrateGraph:
    name: str
    files: list[Path]
    # (from, to) -> references that made the edge: (line, path text).
    edges: dict[tuple[Path, Path], list[tuple[int, str]]]


def _load_tokens(path: Path) -> list[Token]:
    return drop_test_code(tokenize(path.read_text(encoding="utf-8")))


def _roots(src: Path) -> list[Path]:
    roots = [p for p in (src / "lib.rs", src / "main.rs") if p.is_file()]
    bin_dir = src / "bin"
    if bin_dir.is_dir():
        roots += sorted(bin_dir.glob("*.rs"))
        roots += sorted(bin_dir.glob("*/main.rs"))
    return roots


class ModuleTree:
    """The modules of one crate root (its files and their inline modules) and what each
    defines and imports, to tell which file a path names."""

    MAX_HOPS = 32

    def __init__(self) -> None:
        self.file_of: dict[Scope, Path] = {}
        self.defined: dict[Scope, set[str]] = {}
        self.imported: dict[Scope, dict[str, PathRef]] = {}
        self.globs: dict[Scope, list[PathRef]] = {}
        self.module_of_file: dict[Path, Scope] = {}

    def add(self, path: Path, module: Scope, scan: FileScan) -> None:
        self.module_of_file[path] = module
        for scope in [(), *scan.inline_modules]:
            self.file_of[module + scope] = path
            self.defined.setdefault(module + scope, set())
            self.imported.setdefault(module + scope, {})
            self.globs.setdefault(module + scope, [])
        for scope, name in scan.defined:
            self.defined[module + scope].add(name)
        for (scope, name), ref in scan.imported.items():
            self.imported[module + scope][name] = ref
        for ref in scan.globs:
            self.globs[module + ref.scope].append(ref)

    def absolute(self, ref: PathRef, file_module: Scope) -> Scope | None:
        """The crate-absolute path `ref` names, or None when it leaves the crate (an extern
        crate, std) or names no module (a local item, a type, a variable)."""
        segs = list(ref.segments)
        here = file_module + ref.scope
        if segs[0] == "crate":
            base: Scope = ()
            segs = segs[1:]
        elif segs[0] == "self":
            base = here
            segs = segs[1:]
        elif segs[0] == "super":
            base = here
            while segs and segs[0] == "super":
                if not base:
                    return None  # above the crate root
                base = base[:-1]
                segs = segs[1:]
        elif here + (segs[0],) in self.file_of:
            base = here
        else:
            return None
        return base + tuple(segs)

    def _names(self, module: Scope, name: str) -> bool:
        return name in self.defined.get(module, ()) or name in self.imported.get(module, {})

    def file_named(self, full: Scope, hops: int = 0) -> Path | None:
        """The file that holds what the absolute path `full` names: the longest module
        prefix's file, or, when the rest starts with a name that module imports, the file
        of what the import names (so `crate::Error` re-exported by lib.rs from error.rs
        names error.rs). None when it leads out of the crate."""
        cut = len(full)
        while full[:cut] not in self.file_of:
            cut -= 1
        module, rest = full[:cut], full[cut:]
        if not rest or hops > self.MAX_HOPS or rest[0] in self.defined[module]:
            return self.file_of[module]
        name = rest[0]
        ref = self.imported[module].get(name)
        if ref is not None:
            target = self.absolute(ref, self.module_of_file[self.file_of[module]])
            return None if target is None else self.file_named(target + rest[1:], hops + 1)
        for glob in self.globs[module]:
            target = self.absolute(glob, self.module_of_file[self.file_of[module]])
            if target is not None and target in self.file_of and self._names(target, name):
                return self.file_named(target + rest, hops + 1)
        return self.file_of[module]


def build_graph(crate_dir: Path) -> CrateGraph:
    """The file-level reference graph of the crate at `crate_dir`."""
    src = crate_dir / "src"
    files: list[Path] = []
    edges: dict[tuple[Path, Path], list[tuple[int, str]]] = {}
    for root in _roots(src):
        tree = ModuleTree()
        scans: dict[Path, tuple[Scope, FileScan]] = {}
        todo: list[tuple[Path, Scope]] = [(root, ())]
        while todo:
            path, module = todo.pop()
            if path in scans or not path.is_file():
                continue
            scan = scan_file(_load_tokens(path))
            scans[path] = (module, scan)
            tree.add(path, module, scan)
            mod_rs = path == root or path.name == "mod.rs"
            child_dir = path.parent if mod_rs else path.parent / path.stem
            for scope, name, path_attr in scan.child_files:
                if path_attr is not None and not scope:
                    todo.append((path.parent / path_attr, module + (name,)))
                    continue
                base = child_dir.joinpath(*scope)
                flat, nested = base / f"{name}.rs", base / name / "mod.rs"
                todo.append((flat if flat.is_file() else nested, module + scope + (name,)))
        for path, (module, scan) in scans.items():
            if path not in files:
                files.append(path)
            for ref in scan.refs:
                full = tree.absolute(ref, module)
                target = None if full is None else tree.file_named(full)
                if target is None or target == path:
                    continue
                edges.setdefault((path, target), []).append((ref.line, "::".join(ref.segments)))
    return CrateGraph(crate_dir.name, sorted(files), edges)


def cycles(graph: CrateGraph) -> list[list[Path]]:
    """Strongly connected components of more than one file (Tarjan's algorithm, without
    recursion), each sorted, sorted by their first file."""
    succ: dict[Path, list[Path]] = {f: [] for f in graph.files}
    for a, b in graph.edges:
        succ.setdefault(a, []).append(b)
        succ.setdefault(b, [])
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    on_stack: set[Path] = set()
    stack: list[Path] = []
    found: list[list[Path]] = []
    counter = 0
    for start in sorted(succ):
        if start in index:
            continue
        work = [(start, iter(sorted(succ[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(succ[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


# --- Command line ---------------------------------------------------------------------------


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def _module_name(path: Path) -> str:
    return path.parent.name if path.name == "mod.rs" else path.stem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "crates", nargs="*", help="crate directory names under crates/ (default: all)"
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="the repository (default: this script's)",
    )
    parser.add_argument("--list", action="store_true", help="print every edge too")
    args = parser.parse_args(argv)

    root: Path = args.root.resolve()
    crate_dirs = sorted(p.parent for p in (root / "crates").glob("*/Cargo.toml"))
    if args.crates:
        unknown = set(args.crates) - {d.name for d in crate_dirs}
        if unknown:
            parser.error(f"no such crate under {root / 'crates'}: {', '.join(sorted(unknown))}")
        crate_dirs = [d for d in crate_dirs if d.name in args.crates]

    total = 0
    for crate_dir in crate_dirs:
        try:
            graph = build_graph(crate_dir)
        except (LexError, OSError, UnicodeDecodeError) as e:
            print(f"{crate_dir.name}: cannot read its sources: {e}", file=sys.stderr)
            return 2
        if args.list:
            print(f"{graph.name}: {len(graph.files)} files, {len(graph.edges)} edges")
            for (a, b), refs in sorted(graph.edges.items()):
                line, text = refs[0]
                print(
                    f"  {_rel(a, root)} -> {_rel(b, root)}  ({len(refs)} refs; line {line}: {text})"
                )
        for component in cycles(graph):
            total += 1
            names = " <-> ".join(_module_name(f) for f in component)
            print(f"{graph.name}: cycle of {len(component)} files ({names})")
            members = set(component)
            for (a, b), refs in sorted(graph.edges.items()):
                if a in members and b in members:
                    line, text = refs[0]
                    print(f"  {_rel(a, root)} -> {_rel(b, root)}  (line {line}: {text})")
    print(f"{total} cycle(s) in {len(crate_dirs)} crate(s)")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
