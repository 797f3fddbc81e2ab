"""The modules the opt-in compiled build compiles with mypyc (`setup.py`'s `COMPILED`) avoid what mypyc gets
wrong: an `await` inside an `except` or `finally` block. A compiled coroutine suspended there (a cancellation
unwinding through it, above all) leaves the exception it handles as the thread's "exception being handled"
for good (`tests/integration/test_handled_exceptions.py` shows the effect). Checked on the source, so that the
pure build catches it too."""

from __future__ import annotations

import ast
from pathlib import Path

from lockgate.bench.machine import HOT_MODULES

ROOT = Path(__file__).resolve().parents[2]


def _compiled() -> list[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "COMPILED" for t in targets):
                assert node.value is not None
                value = ast.literal_eval(node.value)
                assert isinstance(value, list)
                return [str(path) for path in value]
    raise AssertionError("setup.py defines no COMPILED list")


def _awaits_in_handlers(tree: ast.AST) -> list[int]:
    """Lines of `await`, `async for` and `async with` inside `except` handlers and `finally` blocks (not
    inside functions defined there: those run when called, not in the handler)."""
    found: list[int] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Await | ast.AsyncFor | ast.AsyncWith):
            found.append(node.lineno)
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            for child in ast.iter_child_nodes(node):
                visit(child)

    for node in ast.walk(tree):
        if isinstance(node, ast.Try | ast.TryStar):
            for statement in node.finalbody:
                visit(statement)
            for handler in node.handlers:
                for statement in handler.body:
                    visit(statement)
    return sorted(set(found))


def test_the_compiled_modules_are_the_hot_modules_the_bench_reports() -> None:
    names = {path.removeprefix("src/").removesuffix(".py").replace("/", ".") for path in _compiled()}
    assert names == set(HOT_MODULES)


def test_no_compiled_module_awaits_while_handling_an_exception() -> None:
    offenders = {}
    for path in _compiled():
        lines = _awaits_in_handlers(ast.parse((ROOT / path).read_text()))
        if lines:
            offenders[path] = lines
    assert offenders == {}


def test_the_check_finds_awaits_in_handlers() -> None:
    source = """
async def f(x):
    try:
        await x()
    except ValueError:
        await x()
    finally:
        async with x():
            pass
        async def later():
            await x()
"""
    assert _awaits_in_handlers(ast.parse(source)) == [6, 8]
