#!/usr/bin/env python3
"""Generates the ctypes layer of the Python package from the C headers.

Reads include/fsdpturbo.h and include/fsdpturbo_internal.h (cbindgen's output, docs/design.md §3)
and writes torch_ext/python/fsdpturbo/_abi.py: every constant, the status codes and their
names, the callback types, the structs and the signature of every function, so Python never
retypes the C ABI. Also checks the prefix rule on the way: every name the headers declare
starts with `fsdpturbo_` or `FSDPTURBO_`.

    scripts/gen_ctypes.py           rewrite _abi.py
    scripts/gen_ctypes.py --check   exit 1 if _abi.py is not what the headers give (CI, ctest)

The parser knows the shapes cbindgen writes (one declaration per statement, `//` comments,
`#ifdef __cplusplus` blocks) and refuses anything else rather than guessing.
"""
import argparse
import difflib
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADERS = [ROOT / "include" / "fsdpturbo.h", ROOT / "include" / "fsdpturbo_internal.h"]
OUTPUT = ROOT / "torch_ext" / "python" / "fsdpturbo" / "_abi.py"
PREFIXES = ("fsdpturbo_", "FSDPTURBO_")
STATUS_ENUM = "fsdpturbo_status_t"

SCALARS = {
    "bool": "c_bool", "char": "c_char", "float": "c_float", "double": "c_double", "size_t": "c_size_t",
    "int8_t": "c_int8", "uint8_t": "c_uint8", "int16_t": "c_int16", "uint16_t": "c_uint16",
    "int32_t": "c_int32", "uint32_t": "c_uint32", "int64_t": "c_int64", "uint64_t": "c_uint64",
    "int": "c_int",
}


class HeaderError(Exception):
    pass


def c_view(text):
    """The header as a C (not C++) compiler sees it, without comments: `#ifdef __cplusplus`
    blocks dropped, other directives but `#define` removed."""
    # `//` first: a line comment may hold `/*` (e.g. "nvidia/*/lib").
    text = re.sub(r"//.*", "", text)
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    out, stack = [], []
    for line in text.splitlines():
        directive = line.strip()
        if directive.startswith("#"):
            words = directive[1:].split()
            if words[0] == "ifdef":
                stack.append(words[1] != "__cplusplus")
            elif words[0] == "ifndef":
                stack.append(True)  # C: __cplusplus and the include guards are undefined
            elif words[0] == "if":
                stack.append(_c11_condition(directive[3:]))
            elif words[0] == "else":
                stack[-1] = not stack[-1]
            elif words[0] == "endif":
                stack.pop()
            elif words[0] == "define" and all(stack):
                out.append(directive)
            elif words[0] not in ("include", "define"):
                raise HeaderError(f"unexpected directive: {directive}")
            continue
        if all(stack):
            out.append(line)
    return "\n".join(out)


def _c11_condition(expr):
    """The value of an `#if` expression for a C11 compiler (cbindgen's C23 enum guards)."""
    py = expr.replace("defined(__cplusplus)", "0").replace("__STDC_VERSION__", "201112")
    py = re.sub(r"(\d+)L\b", r"\1", py).replace("||", " or ").replace("&&", " and ")
    if not re.fullmatch(r"[\d\s()<>=!orand]+", py):
        raise HeaderError(f"unexpected #if: {expr}")
    return bool(eval(py))  # noqa: S307 (digits, comparisons and boolean operators only)


class Abi:
    def __init__(self):
        self.constants = {}  # name -> int or float literal text
        self.statuses = {}  # name -> code
        self.opaque = []
        self.enums = []
        self.callbacks = {}  # name -> (ret, [arg types])
        self.structs = {}  # name -> [(field, type)]
        self.functions = {}  # name -> (ret, [arg types], header)

    def parse(self, path):
        text = c_view(path.read_text())
        # Structs first (their bodies hold `;`), then the statements left.
        for m in re.finditer(r"typedef struct \{(.*?)\} (\w+);", text, flags=re.S):
            self._prefixed(m.group(2), path)
            decls = (" ".join(d.split()) for d in m.group(1).split(";"))
            self.structs[m.group(2)] = [_split_decl(d) for d in decls if d]
        text = re.sub(r"typedef struct \{.*?\} \w+;", "", text, flags=re.S)
        lines = text.splitlines()
        aliases = {}  # a constant defined as another one (e.g. #define FSDPTURBO_A FSDPTURBO_B)
        for line in (line for line in lines if line.startswith("#define")):
            m = re.fullmatch(r"#define\s+(\w+)(?:\s+(.*))?", line)
            name, value = m.group(1), (m.group(2) or "").strip()
            self._prefixed(name, path)
            if not value or value.startswith("{"):  # include guards and the *_INIT initialisers
                continue
            if re.fullmatch(r"FSDPTURBO_\w+", value):
                aliases[name] = value
                continue
            if not re.fullmatch(r"-?\d+(\.\d+)?([eE][-+]?\d+)?", value):
                raise HeaderError(f"{path.name}: #define {name} {value}: not a number literal")
            self.constants[name] = value
        for name, target in aliases.items():
            if target not in self.constants:
                raise HeaderError(f"{path.name}: #define {name} {target}: not a number constant of the headers")
            self.constants[name] = self.constants[target]
        body = "\n".join(line for line in lines if not line.startswith("#define"))
        for stmt in body.split(";"):
            self._statement(" ".join(stmt.split()), path)

    @staticmethod
    def _prefixed(name, path):
        if not name.startswith(PREFIXES):
            raise HeaderError(f"{path.name} declares `{name}`, which does not start with fsdpturbo_/FSDPTURBO_ "
                              f"(docs/design.md §3: the header is the C API and nothing else)")

    def _statement(self, stmt, path):
        stmt = re.sub(r'^extern "C" \{ ', "", stmt).strip()
        if not stmt or stmt == "}":
            return
        m = re.fullmatch(r"typedef struct (\w+) (\w+)", stmt)
        if m and m.group(1) == m.group(2):
            self._prefixed(m.group(1), path)
            self.opaque.append(m.group(1))
            return
        m = re.fullmatch(r"enum (\w+) \{ (.*?),? \}", stmt)
        if m:
            self._prefixed(m.group(1), path)
            self.enums.append(m.group(1))
            for item in m.group(2).split(","):
                key, value = (s.strip() for s in item.split("="))
                self._prefixed(key, path)
                if m.group(1) == STATUS_ENUM:
                    self.statuses[key] = int(value)
                else:
                    self.constants[key] = value
            return
        m = re.fullmatch(r"typedef (?:int32_t|uint32_t|int|int64_t) (\w+)", stmt)
        if m and m.group(1) in self.enums:
            return
        m = re.fullmatch(r"typedef (.+?)\(\*(\w+)\)\((.*)\)", stmt)
        if m:
            self._prefixed(m.group(2), path)
            self.callbacks[m.group(2)] = (m.group(1).strip(), _params(m.group(3)))
            return
        m = re.fullmatch(r"(.+?)\b(\w+)\((.*)\)", stmt)
        if m and not stmt.startswith("typedef"):
            self._prefixed(m.group(2), path)
            self.functions[m.group(2)] = (m.group(1).strip(), _params(m.group(3)), path.name)
            return
        raise HeaderError(f"{path.name}: cannot read: {stmt}")


def _split_decl(decl):
    """`const uint32_t *dims` -> ("dims", "const uint32_t *"); `char name[8]` -> ("name", "char[8]")."""
    m = re.fullmatch(r"(.*?)(\w+)(\[\d+\])?", decl.strip())
    if not m or not m.group(1).strip():
        raise HeaderError(f"cannot read declaration: {decl}")
    return m.group(2), m.group(1).strip() + (m.group(3) or "")


def _params(text):
    text = text.strip()
    if text in ("", "void"):
        return []
    return [_split_decl(p)[1] for p in text.split(",")]


def ctype(c, abi, result=False):
    """The ctypes expression for C type `c` as the package passes arguments: handles and other
    opaque pointers are `c_void_p`, strings and byte buffers (`char *`, `uint8_t *`) `c_char_p`."""
    array = re.search(r"\[(\d+)\]$", c)
    if array:
        return f"({ctype(c[:array.start()], abi)} * {array.group(1)})"
    stars = c.count("*")
    base = " ".join(w for w in c.replace("*", " ").split() if w != "const")
    if base == "void":
        return {0: "None", 1: "_c.c_void_p"}.get(stars, "_c.POINTER(_c.c_void_p)")
    if base in abi.opaque:
        if stars == 0:
            raise HeaderError(f"an opaque type by value: {c}")
        return "_c.c_void_p" if stars == 1 else "_c.POINTER(_c.c_void_p)"
    if base in ("char", "uint8_t") and stars >= 1:
        inner = "_c.c_char_p"
        stars -= 1
    elif base in SCALARS:
        inner = f"_c.{SCALARS[base]}"
    elif base in abi.enums:
        inner = "_c.c_int32"
    elif base in abi.structs or base in abi.callbacks:
        inner = base
    else:
        raise HeaderError(f"unknown type {c!r}")
    for _ in range(stars):
        inner = f"_c.POINTER({inner})"
    return inner


def generate():
    abi = Abi()
    for path in HEADERS:
        abi.parse(path)
    return render(abi)


def render(abi):
    out = [
        '"""The C ABI of libfsdpturbo for ctypes: constants, status codes, callback types, structs and',
        "function signatures.",
        "",
        "GENERATED by scripts/gen_ctypes.py from include/fsdpturbo.h and include/fsdpturbo_internal.h;",
        "do not edit by hand (ctest abi_ctypes_drift and scripts/test.sh check it). Handles and other",
        "opaque pointers are c_void_p; strings and byte buffers (char *, uint8_t *) are c_char_p.",
        '"""',
        "import ctypes as _c",
        "",
        "# Constants (#define and enum values).",
    ]
    out += [f"{name} = {value}" for name, value in abi.constants.items()]
    out += ["", f"# Status codes (enum {STATUS_ENUM}) and their names (fsdpturbo_status_name)."]
    out += [f"{name} = {code}" for name, code in abi.statuses.items()]
    out += ["STATUS_NAMES = {"] + [f"    {code}: {name!r}," for name, code in abi.statuses.items()] + ["}", ""]
    out += ["", "# Structs (fields below, so that they may point at each other)."]
    for name in abi.structs:
        out += ["", "", f"class {name}(_c.Structure):", "    pass"]
    out += ["", "", "# Callback types."]
    for name, (ret, args) in abi.callbacks.items():
        types = ", ".join([ctype(ret, abi, result=True)] + [ctype(a, abi) for a in args])
        out.append(f"{name} = _c.CFUNCTYPE({types})")
    out += ["", "# Struct fields."]
    for name, fields in abi.structs.items():
        out.append(f"{name}._fields_ = [")
        out += [f"    ({field!r}, {ctype(c, abi)})," for field, c in fields]
        out.append("]")
    out += ["", "# Functions: name -> (restype, argtypes), in header order (public, then internal)."]
    out.append("FUNCTIONS = {")
    for name, (ret, args, _header) in abi.functions.items():
        argtypes = ", ".join(ctype(a, abi) for a in args)
        out.append(f"    {name!r}: ({ctype(ret, abi, result=True)}, [{argtypes}]),")
    out += ["}", "", "", "def bind(lib):",
            '    """Sets restype and argtypes of every function on the loaded ctypes library."""',
            "    for name, (restype, argtypes) in FUNCTIONS.items():",
            "        fn = getattr(lib, name)",
            "        fn.restype = restype",
            "        fn.argtypes = argtypes", ""]
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed _abi.py is stale")
    args = parser.parse_args()
    try:
        text = generate()
    except HeaderError as err:
        print(f"gen_ctypes: {err}", file=sys.stderr)
        return 1
    if args.check:
        old = OUTPUT.read_text() if OUTPUT.exists() else ""
        if old != text:
            sys.stderr.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                       str(OUTPUT.relative_to(ROOT)), "generated"))
            print(f"\ngen_ctypes: {OUTPUT.relative_to(ROOT)} is stale: run scripts/gen_ctypes.py and commit it",
                  file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
