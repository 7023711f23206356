"""The copy cost of a script: the project modules it imports at module level, transitively, and their lines.

    python benchmarks/copy_cost.py grpo.py          # 2,500 lines in 13 files (2,726 at 3cd949a, 5,057 at 6375f11)

Imports inside functions (the optional features: vLLM, the toy, multi-turn, the math grader, ...) are not counted:
they load only when their flag is on (README, "Copying one script").
"""

import ast
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_file(name: str) -> str | None:
    path = os.path.join(REPO, *name.split(".")) + ".py"
    return path if os.path.exists(path) else None


def module_level_imports(path: str) -> list[str]:
    names = []
    for node in ast.parse(open(path).read()).body:  # the module's own statements, not function bodies
        for n in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(n, ast.Import):
                names += [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.module:
                names += [n.module] + [f"{n.module}.{a.name}" for a in n.names]
    return names


def copied_files(script: str) -> list[str]:
    """The script and every project module it imports at module level, transitively (paths under REPO)."""
    seen, todo = set(), [os.path.join(REPO, script)]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo += [f for f in map(module_file, module_level_imports(path)) if f]
    return sorted(seen)


def main(script: str) -> None:
    total = 0
    for path in copied_files(script):
        lines = sum(1 for _ in open(path))
        total += lines
        print(f"{lines:6d} {os.path.relpath(path, REPO)}")
    print(f"{total:6d} total in {len(copied_files(script))} files")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "grpo.py")
