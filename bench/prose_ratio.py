"""Prose per code line in the product packages: comment and docstring lines over code lines (issue 48's target:
0.12 or less).

A line counts once: as prose when it holds only a comment or part of a docstring, as code when it holds code
(a code line with a trailing comment is code). Blank lines count as neither.

    python bench/prose_ratio.py [--by-file N] [--json bench/out/prose_ratio.json] [PACKAGE ...]
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import tokenize
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("router", "common", "prefill_worker", "decode_worker", "mixed_worker", "planner")


@dataclass
class Count:
    path: str
    prose: int
    code: int

    @property
    def ratio(self) -> float:
        return self.prose / self.code if self.code else 0.0


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def count_file(path: Path) -> Count:
    text = path.read_text()
    docstrings = _docstring_lines(ast.parse(text))
    comment_lines: set[int] = set()
    code_lines: set[int] = set()
    skip = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comment_lines.add(tok.start[0])
        elif tok.type not in skip:
            rows = range(tok.start[0], tok.end[0] + 1)
            code_lines.update(r for r in rows if r not in docstrings)
    lines = text.splitlines()
    prose = {n for n in (comment_lines | docstrings) - code_lines if lines[n - 1].strip()}
    return Count(str(path.relative_to(ROOT)), len(prose), len(code_lines))


def count(packages: tuple[str, ...] = PRODUCT) -> list[Count]:
    return [count_file(p) for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("packages", nargs="*", default=list(PRODUCT))
    ap.add_argument("--by-file", type=int, default=0, help="also list the N files with the most prose lines")
    ap.add_argument("--json", type=Path, help="write the totals and per-package figures here")
    args = ap.parse_args()
    counts = count(tuple(args.packages))
    per_package: dict[str, dict[str, float]] = {}
    for pkg in args.packages:
        mine = [c for c in counts if c.path.startswith(pkg + "/")]
        prose, code = sum(c.prose for c in mine), sum(c.code for c in mine)
        per_package[pkg] = {"prose": prose, "code": code, "ratio": round(prose / code, 4) if code else 0.0}
        print(f"{pkg:16} prose {prose:6}  code {code:6}  ratio {per_package[pkg]['ratio']:.3f}")
    prose, code = sum(c.prose for c in counts), sum(c.code for c in counts)
    print(f"{'total':16} prose {prose:6}  code {code:6}  ratio {prose / code:.3f}")
    for c in sorted(counts, key=lambda c: c.prose, reverse=True)[: args.by_file]:
        print(f"  {c.path:60} prose {c.prose:5}  code {c.code:5}  ratio {c.ratio:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        total = {"prose": prose, "code": code, "ratio": round(prose / code, 4)}
        files = [asdict(c) for c in counts]
        args.json.write_text(json.dumps({"total": total, "packages": per_package, "files": files}, indent=1) + "\n")


if __name__ == "__main__":
    main()
