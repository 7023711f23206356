"""What copying a script takes: the files of this repository that a command really imports, their lines and tokens.

    python benchmarks/copy_cost.py grpo.py --preset toy --total_steps 2 --eval_steps 2
    python benchmarks/copy_cost.py --static grpo.py      # every file an import can reach: the upper bound
    python benchmarks/copy_cost.py --uncalled grpo.py --preset toy --total_steps 1 --eval_steps 1

The first form runs the command in this process, as `python grpo.py ARGS` would, and lists every file of the
repository in `sys.modules` once it ends: the script, what it imports at the top, and what its flags import inside
functions (vLLM's engine, the math grader, evaluation, LoRA, ...). `--static` follows every import statement instead,
those inside functions too, whatever the flags: what a copy needs to keep every option working. The README's and
docs/layout.md's figures come from here; tests/test_siblings.py holds them.

`--uncalled` also traces the run and lists, for each file, the lines of the functions it never called: what a copy
for that command carries without running it (the rest runs: shrinking it means dropping what it does).

Lines reward packing (one long line costs what a short one does), so the cost is also counted in tokens, as Python's
`tokenize` splits the code: `code` counts the tokens a reader must read as code (names, operators, literals; not the
layout tokens NEWLINE, NL, INDENT, DEDENT), `prose` the words of comments and docstrings, which are counted apart.
"""

import ast
import io
import os
import runpy
import sys
import threading
import tokenize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


LAYOUT = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER, tokenize.ENCODING}


def docstring_lines(tree: ast.Module) -> set[int]:
    """The first line of every docstring (of the module, a class or a function)."""
    starts = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            is_string = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            if is_string and isinstance(first.value.value, str):
                starts.add(first.lineno)
    return starts


def tokens(path: str) -> tuple[int, int]:
    """(code tokens, prose words) of a Python file: comments and docstrings are prose, the rest code."""
    with open(path) as f:
        source = f.read()
    docstrings = docstring_lines(ast.parse(source))
    code, prose = 0, 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in LAYOUT:
            continue
        if token.type == tokenize.COMMENT:
            prose += len(token.string.lstrip("#").split())
        elif token.type == tokenize.STRING and token.start[0] in docstrings:
            prose += len(token.string.strip("\"'rbuf").split())
        else:
            code += 1
    return code, prose


def imported_files(script: str, argv: list[str], called: set | None = None) -> list[str]:
    """The repository's files in sys.modules after `python script ARGV` ran in this process (paths under REPO).
    `called`: a set that receives (file, first line) of every function of the repository the run called."""
    sys.argv = [script, *argv]
    if REPO not in sys.path:
        sys.path.insert(0, REPO)

    def trace(frame, event, _arg):
        if event == "call" and frame.f_code.co_filename.startswith(REPO + os.sep):
            called.add((frame.f_code.co_filename, frame.f_code.co_firstlineno))

    if called is not None:
        sys.settrace(trace)
        threading.settrace(trace)
    try:
        runpy.run_path(os.path.join(REPO, script), run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    finally:
        sys.settrace(None)
        threading.settrace(None)
    # Only absolute paths: torch.ops and torch.classes carry bare names such as "_classes.py", which would
    # otherwise be taken for files of the current folder.
    named = [getattr(m, "__file__", None) for m in list(sys.modules.values())]
    files = {path for path in named if path and os.path.isabs(path)}
    files.add(os.path.join(REPO, script))
    return sorted(f for f in files if f.startswith(REPO + os.sep) and "benchmarks" + os.sep not in f)


def module_file(name: str) -> str | None:
    base = os.path.join(REPO, *name.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.exists(path):
            return path
    return None


def all_imports(path: str) -> list[str]:
    """Every module an import statement of `path` names, at the top or inside a function."""
    names = []
    with open(path) as f:
        tree = ast.parse(f.read())
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names += [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module:
            names += [n.module] + [f"{n.module}.{a.name}" for a in n.names]
        elif isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "import_module" and n.args and \
                isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str):
            names.append(n.args[0].value)  # importlib.import_module("common.x")
    return names


def reachable_files(script: str) -> list[str]:
    """The script and every repository file an import statement reaches from it, transitively."""
    seen, todo = set(), [os.path.join(REPO, script)]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo += [f for f in map(module_file, all_imports(path)) if f]
            package = os.path.join(os.path.dirname(path), "__init__.py")
            if os.path.dirname(path) != REPO and os.path.exists(package):
                todo.append(package)
    return sorted(seen)


def report(files: list[str]) -> tuple[int, int, int]:
    """Print each file's lines, code tokens and prose words, then the totals; return the totals."""
    print(f"{'lines':>6} {'code':>7} {'prose':>7} file")
    totals = [0, 0, 0]
    for path in files:
        row = (lines(path), *tokens(path))
        totals = [t + x for t, x in zip(totals, row)]
        print(f"{row[0]:6d} {row[1]:7d} {row[2]:7d} {os.path.relpath(path, REPO)}")
    print(f"{totals[0]:6d} {totals[1]:7d} {totals[2]:7d} total in {len(files)} files")
    return tuple(totals)


def uncalled_functions(path: str, called: set) -> list[tuple[int, str]]:
    """(lines, name) of each function of `path` (decorators included) whose code never ran, nested ones inside an
    uncalled function not counted twice; longest first."""
    tree = ast.parse(open(path).read())
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                if not {(path, child.lineno), (path, first)} & called:
                    found.append((child.end_lineno - first + 1, child.name))
                    continue
            visit(child)

    visit(tree)
    return sorted(found, reverse=True)


def report_uncalled(files: list[str], called: set) -> int:
    """Print each file's lines of functions the run never called, with the longest of them; return the total."""
    total = 0
    print(f"\n{'uncalled':>8} {'of':>5} file: its longest uncalled functions")
    for path in files:
        unused = uncalled_functions(path, called)
        count = sum(n for n, _ in unused)
        total += count
        names = ", ".join(f"{name} {n}" for n, name in unused[:4])
        print(f"{count:8d} {lines(path):5d} {os.path.relpath(path, REPO)}: {names}")
    print(f"{total:8d} lines of functions never called")
    return total


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python benchmarks/copy_cost.py [--uncalled] SCRIPT [ARGS...] | --static SCRIPT")
    if sys.argv[1] == "--static":
        report(reachable_files(sys.argv[2]))
    else:
        traced = sys.argv[1] == "--uncalled"
        argv = sys.argv[2:] if traced else sys.argv[1:]
        called = set() if traced else None
        files = imported_files(argv[0], argv[1:], called)
        print(f"\nthe files `python {' '.join(argv)}` imported:", flush=True)
        report(files)
        if traced:
            report_uncalled(files, called)
