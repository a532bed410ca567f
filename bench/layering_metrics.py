"""The layering figures of issue 33, for anyone to rerun: python bench/layering_metrics.py [--list]

  modules over 500 lines; functions (and methods) over 80 lines; function-level imports of the package
  (an `import finetune_mcp...` inside a def); cross-module private imports (`from finetune_mcp.x import _y`
  or `x._y` reached from another module). Counts are over server/finetune_mcp/**.py.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "server" / "finetune_mcp"


def _module(path: Path) -> str:
    return ".".join(("finetune_mcp",) + path.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__")


def figures() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"modules over 500 lines": [], "functions over 80 lines": [],
                                 "function-level imports of the package": [], "cross-module private imports": []}
    for path in sorted(p for p in PKG.rglob("*.py") if "templates" not in p.parts):  # templates: text with {{slots}}
        text = path.read_text()
        mod = _module(path)
        rel = path.relative_to(PKG.parent)
        n = text.count("\n")
        if n > 500:
            out["modules over 500 lines"].append(f"{rel} {n}")
        tree = ast.parse(text)
        local_imports: dict[int, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 80:
                    out["functions over 80 lines"].append(f"{rel}:{node.lineno} {node.name} {length}")
                for sub in ast.walk(node):
                    if isinstance(sub, ast.ImportFrom) and (sub.module or "").startswith("finetune_mcp") or \
                            isinstance(sub, ast.Import) and any(a.name.startswith("finetune_mcp") for a in sub.names):
                        local_imports.setdefault(sub.lineno, f"{rel}:{sub.lineno} in {node.name}")  # outermost def
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("finetune_mcp") and node.module != mod:
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        # a private name, or a private module imported whole (from finetune_mcp.jobs import _records)
                        out["cross-module private imports"].append(f"{rel}:{node.lineno} {node.module}.{a.name}")
        out["function-level imports of the package"] += list(local_imports.values())
        # attribute access to a private name of an imported package module: R._x
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("finetune_mcp"):
                for a in node.names:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("finetune_mcp"):
                        aliases[a.asname or a.name] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                out["cross-module private imports"].append(f"{rel}:{node.lineno} {aliases[node.value.id]}.{node.attr}")
    return out


def main() -> None:
    for name, items in figures().items():
        print(f"{name}: {len(items)}")
        if "--list" in sys.argv:
            for i in items:
                print("   ", i)


if __name__ == "__main__":
    main()
