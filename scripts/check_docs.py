#!/usr/bin/env python3
"""Checks that the docs a newcomer reads are true of the repository (CI runs it):

- ARCHITECTURE.md has at most 250 lines, none wider than 110 characters;
- every path it mentions exists: tokens under a top-level folder (`crates/...`, `examples/...`,
  `scripts/...`, `docs/...`, `fuzz/...`, ...), relative link targets, and every `.rs` path (one
  not from the repository root must be the end of exactly one file's path, e.g.
  `rendezvous/master.rs`);
- every `file.rs::name` names an item defined in that file (`fn`, `struct`, `enum`, `trait`,
  `type`, `mod`, `const`, `static`, `union`, `macro_rules!`), and every `file.rs::Type::name`
  an item of an `impl` or `trait` block of `Type` in that file (as its type or its trait);
- its crate table (`| crate | ... | uses |`) lists exactly the workspace members of Cargo.toml,
  each crate's `uses` cell is its `flotilla-*` `[dependencies]` (`?`: optional), and every crate
  uses only crates listed above it;
- README.md's crate table lists exactly the workspace members, once each, bottom-up (a crate
  after every crate it uses);
- no Markdown file links to an `ARCHITECTURE.md#anchor` that is not a heading of it.

Usage: `python3 scripts/check_docs.py [REPO_ROOT]` (default: the repository this script is in).
Exit status 1, with one line per problem, when a check fails. Python 3 standard library only.
"""
import glob
import os
import re
import sys

MAX_LINES = 250
MAX_WIDTH = 110
TOP_DIRS = ("crates", "examples", "scripts", "docs", "fuzz", "models", "deploy", "data", ".ci")
SKIP_DIRS = {".git", "target", "runs", "node_modules", "__pycache__"}
ITEM_KINDS = r"(?:fn|struct|enum|trait|type|mod|const|static|union)"
PREFIX = "flotilla-"


class Checker:
    def __init__(self, root):
        self.root = root
        self.problems = []
        self._files = None
        self._items = {}

    def fail(self, where, message):
        self.problems.append(f"{where}: {message}")

    # ---- the repository's files ----------------------------------------------------------

    def files(self):
        """Every file's path relative to the root (without .git, target, runs)."""
        if self._files is None:
            out = []
            for d, subdirs, names in os.walk(self.root):
                subdirs[:] = [s for s in subdirs if s not in SKIP_DIRS]
                rel = os.path.relpath(d, self.root)
                for n in names:
                    out.append(n if rel == "." else os.path.join(rel, n).replace(os.sep, "/"))
            self._files = out
        return self._files

    def resolve_rs(self, token):
        """The file a `.rs` path names (from the root, or the end of exactly one path)."""
        if token.startswith(TOP_DIRS):
            return token if os.path.isfile(os.path.join(self.root, token)) else None, 0
        hits = [f for f in self.files() if f == token or f.endswith("/" + token)]
        return (hits[0], 1) if len(hits) == 1 else (None, len(hits))

    # ---- Rust items ------------------------------------------------------------------------

    def items(self, path):
        """(top-level-or-nested item names, {type or trait name: item names of its blocks})."""
        if path not in self._items:
            with open(os.path.join(self.root, path), encoding="utf-8") as f:
                code = strip_rust(f.read())
            names = set(re.findall(rf"\b{ITEM_KINDS}\s+(?:r#)?([A-Za-z_]\w*)", code))
            names |= set(re.findall(r"\bmacro_rules!\s*([A-Za-z_]\w*)", code))
            self._items[path] = (names, blocks(code))
        return self._items[path]

    def check_name(self, where, token, path, names):
        defined, by_type = self.items(path)
        if len(names) == 1:
            if names[0] not in defined:
                self.fail(where, f"`{token}`: no fn, struct, enum, trait, type, mod, const, static "
                                 f"or macro named `{names[0]}` in {path}")
        elif len(names) == 2:
            owner, item = names
            if owner not in by_type:
                self.fail(where, f"`{token}`: no `impl` or `trait` block of `{owner}` in {path}")
            elif item not in by_type[owner]:
                self.fail(where, f"`{token}`: `{item}` is not defined in a block of `{owner}` "
                                 f"in {path}")
        else:
            self.fail(where, f"`{token}`: write `file.rs::name` or `file.rs::Type::name`")

    # ---- ARCHITECTURE.md -------------------------------------------------------------------

    def check_architecture(self, members):
        name = "ARCHITECTURE.md"
        text = read(os.path.join(self.root, name))
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        if len(lines) > MAX_LINES:
            self.fail(name, f"{len(lines)} lines, more than {MAX_LINES}")
        widest = max((len(line), i) for i, line in enumerate(lines, 1)) if lines else (0, 0)
        for i, line in enumerate(lines, 1):
            if len(line) > MAX_WIDTH:
                self.fail(f"{name}:{i}", f"{len(line)} characters, more than {MAX_WIDTH}")
        paths, names, rs_files = set(), 0, set()
        for i, line in enumerate(lines, 1):
            where = f"{name}:{i}"
            line = re.sub(r"https?://\S+", "", line)
            for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", line):
                target = m.group(1)
                paths.add(target)
                if not os.path.exists(os.path.join(self.root, target)):
                    self.fail(where, f"the link target `{target}` does not exist")
            tops = "|".join(re.escape(d) for d in TOP_DIRS)
            for m in re.finditer(rf"(?<![\w./-])((?:{tops})/[\w.*/-]*)", line):
                token = m.group(1).rstrip(".,;:")
                if token.endswith(".rs"):
                    continue  # checked below with the other .rs paths
                paths.add(token)
                found = glob.glob(os.path.join(self.root, token)) if "*" in token else (
                    [token] if os.path.exists(os.path.join(self.root, token)) else [])
                if not found:
                    self.fail(where, f"`{token}` does not exist")
            for m in re.finditer(r"(?<![\w./-])([\w./-]*\w\.rs)((?:::[A-Za-z_]\w*)*)", line):
                token, rest = m.group(1), m.group(2)
                paths.add(token)
                path, hits = self.resolve_rs(token)
                if path is None:
                    what = "does not exist" if hits == 0 else \
                        f"is the end of {hits} paths; give more of it"
                    self.fail(where, f"`{token}` {what}")
                    continue
                rs_files.add(path)
                if rest:
                    names += 1
                    self.check_name(where, token + rest, path, rest[2:].split("::"))
        table = self.check_crate_table(name, text, members, with_uses=True)
        return len(lines), widest, len(paths), len(rs_files), names, table

    def check_crate_table(self, name, text, members, with_uses=False):
        """The rows of the Markdown table whose first header cell is `crate`, against the
        workspace members (and, `with_uses`, their dependencies)."""
        rows, header = table_rows(text)
        if rows is None:
            self.fail(name, "no crate table (a Markdown table whose first column is `crate`)")
            return 0
        listed = [re.sub(r"[`*]", "", r[0]).strip() for r in rows]
        seen = set()
        for c in listed:
            if c in seen:
                self.fail(name, f"the crate table lists `{c}` twice")
            seen.add(c)
        for c in sorted(seen - set(members)):
            self.fail(name, f"the crate table lists `{c}`, which is not a workspace member")
        for c in sorted(set(members) - seen):
            self.fail(name, f"the crate table does not list the workspace member `{c}`")
        if not with_uses:
            above = set()
            for crate in listed:
                for dep in sorted(members.get(crate, {})):
                    if dep not in above:
                        self.fail(name, f"`{crate}` uses `{dep}` (its Cargo.toml), which is not "
                                        f"above it in the crate table")
                above.add(crate)
            return len(listed)
        col = next((i for i, h in enumerate(header) if h.strip().lower().startswith("uses")), None)
        if col is None:
            self.fail(name, "the crate table has no `uses` column")
            return len(listed)
        above = set()
        for row, crate in zip(rows, listed):
            cell = row[col] if col < len(row) else ""
            written = {}
            for word in re.findall(r"[\w-]+\??", cell.replace("`", "")):
                optional = word.endswith("?")
                dep = word.rstrip("?")
                dep = dep if dep == "flotilla" or dep.startswith(PREFIX) else PREFIX + dep
                written[dep] = optional
            if crate in members:
                actual = members[crate]
                if written != actual:
                    want = " ".join(sorted(short(d) + ("?" if o else "") for d, o in actual.items()))
                    self.fail(name, f"`{crate}` uses `{want or '—'}` (its Cargo.toml), "
                                    f"the table says `{cell.strip()}`")
            for dep in written:
                if dep not in above:
                    self.fail(name, f"`{crate}` uses `{dep}`, which is not above it in the table")
            above.add(crate)
        return len(listed)

    # ---- anchors into ARCHITECTURE.md from other Markdown files ----------------------------

    def check_anchors(self):
        arch = read(os.path.join(self.root, "ARCHITECTURE.md"))
        slugs = {slug(h) for h in re.findall(r"^#+\s+(.*?)\s*$", arch, flags=re.M)}
        count = 0
        for f in self.files():
            if not f.endswith(".md"):
                continue
            text = read(os.path.join(self.root, f))
            for i, line in enumerate(text.split("\n"), 1):
                for m in re.finditer(r"ARCHITECTURE\.md#([\w-]+)", line):
                    count += 1
                    if m.group(1) not in slugs:
                        self.fail(f"{f}:{i}", f"ARCHITECTURE.md has no heading `#{m.group(1)}`")
                if re.search(r"ARCHITECTURE\.md\)?\s*§", line):
                    self.fail(f"{f}:{i}", "ARCHITECTURE.md has no numbered sections (§)")
        return count


def strip_rust(src):
    """`src` without comments, string and char literals (newlines and code kept)."""
    out, i, n = [], 0, len(src)
    char_lit = re.compile(r"'(?:\\(?:u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^\\'\n])'")
    raw = re.compile(r'b?r(#*)"')
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if src.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif src.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    if src[i] == "\n":
                        out.append("\n")
                    i += 1
        elif c in "rb" and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")) \
                and raw.match(src, i):
            m = raw.match(src, i)
            end = src.find('"' + m.group(1), m.end())
            end = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""' + "\n" * src.count("\n", i, end))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append('""' + "\n" * src.count("\n", i, j))
            i = j + 1
        elif c == "'" and char_lit.match(src, i):
            out.append("' '")
            i = char_lit.match(src, i).end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def blocks(code):
    """{name: item names} of every `impl` block (by its type and its trait) and `trait` block."""
    by_type = {}
    for m in re.finditer(r"\b(impl|trait)\b", code):
        start = code.find("{", m.end())
        if start < 0:
            continue
        header = code[m.end():start]
        before = re.sub(r"\bunsafe\s*$", "", code[:m.start()].rstrip()).rstrip()
        if ";" in header or (m.group(1) == "impl" and before and before[-1] not in "{};]"):
            continue  # `impl Trait` in a type position, not an `impl` block
        if m.group(1) == "trait":
            owners = re.findall(r"^\s*([A-Za-z_]\w*)", header)
        else:
            h = strip_generics(header.replace("->", "  "))
            h = re.split(r"\bwhere\b", h)[0]
            parts = re.split(r"\bfor\b", h)
            owners = [last_ident(p) for p in parts]
        body = code[start:matching_brace(code, start)]
        items = set(re.findall(rf"\b{ITEM_KINDS}\s+(?:r#)?([A-Za-z_]\w*)", body))
        for o in owners:
            if o:
                by_type.setdefault(o, set()).update(items)
    return by_type


def strip_generics(s):
    out, depth = [], 0
    for c in s:
        if c == "<":
            depth += 1
        elif c == ">":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(c)
    return "".join(out)


def last_ident(s):
    ids = [w for w in re.findall(r"[A-Za-z_]\w*", s) if w not in ("dyn", "mut", "unsafe", "const")]
    return ids[-1] if ids else None


def matching_brace(code, start):
    depth = 0
    for i in range(start, len(code)):
        if code[i] == "{":
            depth += 1
        elif code[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(code)


def table_rows(text):
    """(rows, header cells) of the first Markdown table whose first header cell is `crate`."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        cells = split_row(line)
        if cells and cells[0].strip().lower() == "crate" and i + 1 < len(lines) \
                and re.match(r"^\s*\|?\s*:?-{3,}", lines[i + 1]):
            rows = []
            for row in lines[i + 2:]:
                if not row.strip().startswith("|"):
                    break
                rows.append(split_row(row))
            return rows, cells
    return None, None


def split_row(line):
    s = line.strip()
    if not s.startswith("|"):
        return None
    return [c.strip() for c in s.strip("|").split("|")]


def slug(heading):
    """GitHub's anchor of a heading."""
    s = re.sub(r"[`*_]", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def short(dep):
    return dep[len(PREFIX):] if dep.startswith(PREFIX) else dep


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def workspace_members(root):
    """{package name: {flotilla dependency: optional}} of the workspace's members."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        tomllib = None
    cargo = read(os.path.join(root, "Cargo.toml"))
    if tomllib:
        members = tomllib.loads(cargo)["workspace"]["members"]
    else:
        block = re.search(r"^\[workspace\].*?^members\s*=\s*\[(.*?)\]", cargo, re.S | re.M)
        members = re.findall(r'"([^"]+)"', block.group(1))
    dirs = []
    for m in members:
        dirs += sorted(glob.glob(os.path.join(root, m))) if "*" in m else [os.path.join(root, m)]
    packages = {}
    for d in dirs:
        manifest = read(os.path.join(d, "Cargo.toml"))
        if tomllib:
            data = tomllib.loads(manifest)
            name = data["package"]["name"]
            sections = [data.get("dependencies", {})]
            sections += [t.get("dependencies", {}) for t in data.get("target", {}).values()]
            deps = {}
            for sec in sections:
                for dep, spec in sec.items():
                    deps[dep] = isinstance(spec, dict) and bool(spec.get("optional"))
        else:
            name = re.search(r'^\[package\].*?^name\s*=\s*"([^"]+)"', manifest, re.S | re.M).group(1)
            sec = re.search(r"^\[dependencies\]\s*$(.*?)(?=^\[|\Z)", manifest, re.S | re.M)
            deps = {}
            for line in (sec.group(1) if sec else "").splitlines():
                m = re.match(r"\s*([\w-]+)\s*=\s*(.*)", line)
                if m:
                    deps[m.group(1)] = bool(re.search(r"optional\s*=\s*true", m.group(2)))
        packages[name] = deps
    names = set(packages)
    return {p: {d: o for d, o in deps.items() if d in names} for p, deps in packages.items()}


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))
    c = Checker(root)
    members = workspace_members(root)
    n_lines, (width, at), n_paths, n_files, n_names, n_arch = c.check_architecture(members)
    n_readme = c.check_crate_table("README.md", read(os.path.join(root, "README.md")), members)
    n_anchors = c.check_anchors()
    print(f"ARCHITECTURE.md: {n_lines} lines (at most {MAX_LINES}), widest {width} characters "
          f"(line {at}; at most {MAX_WIDTH})")
    print(f"ARCHITECTURE.md: {n_paths} distinct paths ({n_files} .rs files), "
          f"{n_names} file.rs::name references checked")
    print(f"crate tables: ARCHITECTURE.md {n_arch} rows (with their dependencies), README.md "
          f"{n_readme} rows (bottom-up), against {len(members)} workspace members")
    print(f"links to ARCHITECTURE.md#anchors in Markdown files: {n_anchors}")
    if c.problems:
        print(f"\n{len(c.problems)} problem(s):", file=sys.stderr)
        for p in c.problems:
            print(f"  {p}", file=sys.stderr)
        sys.exit(1)
    print("docs: ok")


if __name__ == "__main__":
    main()
