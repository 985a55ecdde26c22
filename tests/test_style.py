"""The readability budget of the files readers meet (README, DEVELOPERS' quality bar): vgrpo.py's reading path, its
docstring to the end of `main`, under 650 lines; no function over 50 lines; no line over 120 characters."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("vgrpo.py", "reward.py")


def parsed(name):
    with open(os.path.join(ROOT, name)) as f:
        text = f.read()
    return text.splitlines(), ast.parse(text)


def test_the_reading_path_is_under_650_lines():
    lines, tree = parsed("vgrpo.py")
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    marked = next(i for i, line in enumerate(lines, 1) if line.startswith("# What supports it"))
    assert main.end_lineno < marked                        # main is the last thing above the marked line
    assert main.end_lineno < 650, f"the reading path is {main.end_lineno} lines"


def test_no_function_over_50_lines_and_no_line_over_120_characters():
    for name in SOURCES:
        lines, tree = parsed(name)
        long_lines = [i for i, line in enumerate(lines, 1) if len(line) > 120]
        assert not long_lines, f"{name}: lines over 120 characters: {long_lines}"
        long_functions = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(tree)
                          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                          and node.end_lineno - node.lineno + 1 > 50]
        assert not long_functions, f"{name}: functions over 50 lines: {long_functions}"
