"""One owner per concern, checked by reading the source (nothing is imported).

- Files the user gets are written through :mod:`omnibal.outputs` (checked first, written atomically): no
  ``Path.write_text`` / ``write_bytes``, no ``open(..., "w")``, no ``os.replace`` / ``os.rename`` elsewhere
  in src/, except the few listed in ``WRITE_ALLOWED`` with the reason they differ.
- Markdown tables are built by :mod:`omnibal.tables`: no table separator row (``| --- |``) elsewhere in
  src/, except the modules in ``TABLE_ALLOWED``.
- Integers are checked by :func:`omnibal.validate.is_int`: no inline ``isinstance(x, bool) or not
  isinstance(x, int)`` elsewhere.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "omnibal"

# (module, call) pairs that legitimately write outside omnibal.outputs, each with its reason.
WRITE_ALLOWED = {
    # a streaming log: lines appended as training runs, flushed per line; an atomic rewrite per line would be
    # quadratic, and a reader wants to tail it while it grows
    ("train/metrics_log.py", "open"),
    # append-only ledgers (one JSON line per step, a reader replays them; an interrupted run resumes appending)
    ("train/ledger.py", "open"),
    ("integrations/hf.py", "open"),
    # publishes a stage of folders (images/, tokenizer/, models) one entry at a time, each renamed whole
    ("examples/real_example.py", "os.replace"),
    # merges a save_pretrained folder into one that may hold the user's other files: each file renamed in
    ("train/hf_run.py", "os.replace"),
}

# Modules that may still build a markdown table by hand, each with its reason.
TABLE_ALLOWED: set[str] = set()

_WRITE_METHODS = {"write_text", "write_bytes"}
_RENAMES = {("os", "replace"), ("os", "rename"), ("shutil", "move")}


def _modules() -> dict[str, ast.Module]:
    return {p.relative_to(SRC).as_posix(): ast.parse(p.read_text(), str(p)) for p in sorted(SRC.rglob("*.py"))}


def _writes_mode(call: ast.Call) -> bool:
    """``open(path, mode)`` with a mode that writes (w, a, x or +); a mode that is not a literal counts."""
    mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
    if mode is None:
        return False
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return any(c in mode.value for c in "wax+")
    return True


def _write_calls(tree: ast.Module) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in _WRITE_METHODS:
            found.append((node.lineno, f"Path.{f.attr}"))
        elif isinstance(f, ast.Name) and f.id == "open" and _writes_mode(node):
            found.append((node.lineno, "open"))
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in _RENAMES:
            found.append((node.lineno, f"{f.value.id}.{f.attr}"))
    return found


def test_files_are_written_through_outputs():
    bad = [f"{name}:{line}: {what}" for name, tree in _modules().items() if name != "outputs.py"
           for line, what in _write_calls(tree) if (name, what) not in WRITE_ALLOWED]
    assert not bad, "write through omnibal.outputs (write_text, write_bytes, atomic_path, staged_dir):\n" + \
        "\n".join(bad)


_SEPARATOR = re.compile(r"\|\s*:?-{3,}:?\s*\|")


def test_markdown_tables_are_built_by_tables_py():
    bad = [f"{p.relative_to(SRC)}:{i}" for p in sorted(SRC.rglob("*.py")) if p.name != "tables.py"
           and p.relative_to(SRC).as_posix() not in TABLE_ALLOWED
           for i, line in enumerate(p.read_text().splitlines(), 1) if _SEPARATOR.search(line)]
    assert not bad, "build markdown tables with omnibal.tables.markdown_table:\n" + "\n".join(bad)


_BOOL_CHECK = re.compile(r"isinstance\(([^,()]+), bool\)")


def _inline_int_check(line: str) -> bool:
    """``isinstance(x, bool)`` beside ``isinstance(x, int)`` or ``(int, np.integer)``: is_int written out."""
    return any(re.search(rf"isinstance\({re.escape(x)}, (int\b|\(int, np\.integer\))", line)
               for x in _BOOL_CHECK.findall(line))


def test_integers_are_checked_by_validate_is_int():
    bad = [f"{p.relative_to(SRC)}:{i}" for p in sorted(SRC.rglob("*.py")) if p.name != "validate.py"
           for i, line in enumerate(p.read_text().splitlines(), 1) if _inline_int_check(line)]
    assert not bad, "check integers with omnibal.validate.is_int:\n" + "\n".join(bad)


def test_the_int_check_sees_both_spellings():
    assert _inline_int_check("if isinstance(v, bool) or not isinstance(v, int):")
    assert _inline_int_check("ok = not isinstance(n, (int, np.integer)) or isinstance(n, bool)")
    assert not _inline_int_check("if isinstance(v, bool) or not isinstance(v, (int, float)):")
