"""README's "What it guarantees": every guarantee names the tests that prove it, and every named
test exists (a renamed or deleted test fails here, so the list cannot rot)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMED = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)`")


def guarantees() -> list[str]:
    """The section's bullet items, each as one string."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("### What it guarantees", 1)[1].split("\n### ", 1)[0]
    return [item.strip() for item in re.split(r"\n- ", "\n" + section.split("\n- ", 1)[1])]


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test_")}


def test_every_guarantee_names_a_test():
    items = guarantees()
    assert len(items) >= 10, items
    unbacked = [item.split("**")[1] for item in items if not NAMED.search(item)]
    assert unbacked == []


def test_every_named_test_exists():
    missing = []
    for item in guarantees():
        for path, name in NAMED.findall(item):
            file = ROOT / path
            if not file.is_file() or name not in defined_tests(file):
                missing.append(f"{path}::{name}")
    assert missing == []
