"""Code prompts for drafter training, built from Python source trees (the standard library, installed packages).

The target answers them itself, like every training prompt; the source only supplies realistic code requests:
complete a function from its signature and docstring, write a function from a description, explain or rewrite a
given function. Functions named like an evaluation problem are skipped by the caller (`exclude_names`).
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SourceFunction:
    name: str
    signature: str  # "def name(args) -> ret:" as written (decorators dropped)
    docstring: str
    source: str  # the whole function, dedented


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{prefix} {node.name}({ast.unparse(node.args)}){returns}:"


def functions_in_source(text: str, *, min_doc: int = 40, max_source: int = 1800) -> Iterator[SourceFunction]:
    """Public functions and methods with a docstring of at least `min_doc` characters and a body of at most
    `max_source` characters."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if doc is None or len(doc) < min_doc or len(node.body) < 2:
            continue
        source = ast.get_source_segment(text, node)
        if source is None or len(source) > max_source:
            continue
        lines = source.splitlines()
        indent = node.col_offset
        # get_source_segment leaves continuation lines indented as in the file: dedent them by the def's column
        body = "\n".join(line[indent:] if not line[:indent].strip() else line for line in lines[1:])
        source = lines[0] + ("\n" + body if body else "")
        yield SourceFunction(node.name, _signature(node), doc.strip(), source)


def functions_in_tree(root: Path, **limits: int) -> Iterator[SourceFunction]:
    for path in sorted(root.rglob("*.py")):
        if any(part in {"test", "tests", "idlelib", "lib2to3", "site-packages"} for part in path.relative_to(root).parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield from functions_in_source(text, **limits)


def _first_sentence(doc: str) -> str:
    paragraph = doc.split("\n\n")[0].replace("\n", " ").strip()
    sentence = paragraph.split(". ")[0].rstrip(".")
    return sentence[:1].lower() + sentence[1:] if sentence else sentence


def _docstring_block(fn: SourceFunction) -> str:
    doc = "\n".join("    " + line if line else "" for line in fn.docstring.splitlines())
    return f'{fn.signature}\n    """\n{doc}\n    """\n'


def prompt_for(fn: SourceFunction) -> str:
    """One request per function; the style is picked by a hash of the function, so the set is reproducible."""
    style = int(hashlib.sha256(fn.source.encode()).hexdigest(), 16) % 5
    if style in (0, 1):
        return (
            "Complete the following Python function. Reply with the full function in a code block.\n\n"
            f"```python\n{_docstring_block(fn)}```"
        )
    if style == 2:
        return f"Write a Python function `{fn.signature[4:-1]}` that {_first_sentence(fn.docstring)}."
    if style == 3:
        return f"Explain what this Python function does:\n\n```python\n{fn.source}\n```"
    return f"Rewrite this Python function to be clearer, with type hints and comments:\n\n```python\n{fn.source}\n```"


def code_prompts(roots: Iterable[Path], *, exclude_names: set[str], limit: int | None = None) -> list[str]:
    """Distinct prompts from the functions under `roots`, in a stable order, at most `limit`."""
    prompts: dict[str, None] = {}
    seen_sources: set[str] = set()
    for root in roots:
        for fn in functions_in_tree(root):
            if fn.name in exclude_names or fn.source in seen_sources:
                continue
            seen_sources.add(fn.source)
            prompts[prompt_for(fn)] = None
    ordered = sorted(prompts, key=lambda p: hashlib.sha256(p.encode()).hexdigest())
    return ordered[:limit] if limit else ordered
