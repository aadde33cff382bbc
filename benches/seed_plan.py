"""The seed's plan resolution loops, for the benchmark in benches/plan.rs.

A transcription of the seed's `module_name_match` (the seed
recompiles the pattern on every call) and of the three loops plan resolution runs over
`named_modules()`: EP modules, EFSDP modules, and the outer-FSDP2 ignored parameters
(what src/plan.rs resolves in one pass). Usage: seed_plan.py NAMES_FILE REPEATS; prints the
median seconds of one resolution and the number of modules matched, as JSON.
"""
import json
import re
import statistics
import sys
import time


def compile_extended_pattern(pattern):
    specs = []

    def brace(match):
        inner = match.group(1)
        if inner == "*":
            specs.append(None)
        elif "-" in inner:
            parts = inner.split("-")
            if len(parts) != 2:
                raise ValueError(f"Invalid brace pattern: {inner}")
            try:
                low, high = int(parts[0]), int(parts[1])
            except ValueError:
                raise ValueError(f"Non-integer in range: {inner}") from None
            if low > high:
                raise ValueError(f"Invalid range: {inner} (low > high)")
            specs.append((low, high))
        else:
            raise ValueError(f"Unrecognized brace pattern: {inner}")
        return "__NUM__"

    text = re.sub(r"\{([^}]*)\}", brace, pattern)
    out, i = [], 0
    while i < len(text):
        if text.startswith("__NUM__", i):
            out.append(r"(\d+)")
            i += len("__NUM__")
            continue
        ch = text[i]
        out.append(".*" if ch == "*" else "." if ch == "?" else r"\." if ch == "." else re.escape(ch))
        i += 1
    return re.compile("^" + "".join(out) + "$"), specs


def module_name_match(pattern, name):
    regex, specs = compile_extended_pattern(pattern)
    match = regex.match(name)
    if not match:
        return False
    for num, spec in zip(match.groups(), specs):
        if spec is not None and not (spec[0] <= int(num) <= spec[1]):
            return False
    return True


class Tree:
    """Stands in for nn.Module: children and direct parameters, so `parameters()` walks
    the subtree the way torch does."""

    def __init__(self, modules, params):
        self.children = {m: [] for m in modules}
        self.direct = {m: [] for m in modules}
        for m in modules:
            if m:
                self.children[m.rpartition(".")[0] if "." in m else ""].append(m)
        for p in params:
            self.direct[p.rpartition(".")[0]].append(p)

    def parameters(self, module):
        stack, out = [module], []
        while stack:
            m = stack.pop()
            out.extend(self.direct[m])
            stack.extend(self.children[m])
        return out


def resolve(modules, tree, ep_patterns, efsdp_patterns, ignored_patterns):
    ep_modules = [m for p in ep_patterns for m in modules if module_name_match(p, m)]
    efsdp_modules = [m for p in efsdp_patterns for m in modules if module_name_match(p, m)]
    ignored = set()
    for m in modules:
        for p in ignored_patterns:
            if module_name_match(p, m):
                ignored.update(tree.parameters(m))
    return ep_modules, efsdp_modules, ignored


def main():
    names_file, repeats = sys.argv[1], int(sys.argv[2])
    with open(names_file) as f:
        data = json.load(f)
    args = (data["modules"], Tree(data["modules"], data["params"]), data["ep"], data["efsdp"], data["ep"])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        ep_modules, efsdp_modules, ignored = resolve(*args)
        times.append(time.perf_counter() - start)
    print(json.dumps({"seconds": statistics.median(times), "ep_modules": len(ep_modules),
                      "efsdp_modules": len(efsdp_modules), "ignored_params": len(ignored)}))


if __name__ == "__main__":
    main()
