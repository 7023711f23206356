"""README.md and docs/: the README stays a five-minute read, every page is in the site's nav, every relative link
and anchor resolves (on GitHub and on the MkDocs site alike), the code the pages quote is the live code, and no
tracked file points outside the repository (users have only the repository).

The site itself is built by CI's docs stage (`mkdocs build --strict`, requirements-docs.txt); these checks need
neither mkdocs nor the network.
"""

import dataclasses
import glob
import gzip
import importlib
import importlib.util
import json
import os
import re
import shlex
import statistics
import subprocess

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs")
README = os.path.join(REPO, "README.md")
PAGES = sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def rel(path: str) -> str:
    return os.path.relpath(path, REPO)


def nav_pages(nav) -> list[str]:
    """The .md files an mkdocs nav names, at any depth."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    return []


def slug(heading: str) -> str:
    """A heading's anchor as GitHub and MkDocs' toc both make it for the headings used here."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    text = FENCE.sub("", read(path))
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_readme_is_a_five_minute_read():
    """A user's document (issue 52): what it is, install, the toy, the real model, data and rewards, GPUs, which
    estimator, where to read on. Timings, budgets and history belong to docs/contributing.md."""
    lines = read(README).count("\n")
    assert lines <= 150, f"README.md has {lines} lines (at most 150): move the detail to a page of docs/"


CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)")


def pipes_in_table_code(text: str) -> list[str]:
    """The code spans holding a `|` in the rows of Markdown tables (a line starting with `|`, outside fenced code).
    GitHub splits a table row at every `|`, inside backticks too, so such a cell breaks the table there; an escaped
    `\\|` renders differently on GitHub and on the MkDocs site. Write abs(x) or "or" instead."""
    found, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or not line.startswith("|"):
            continue
        found += [f"line {number}: {m.group(0)}" for m in CODE_SPAN.finditer(line) if "|" in m.group(2)]
    return found


def rows_with_another_cell_count(text: str) -> list[str]:
    """The table rows whose number of unescaped `|` differs from their table's header row's: a missing or an extra
    cell, which GitHub renders shifted (a table is a run of lines starting with `|`, outside fenced code)."""
    found, fenced, header = [], False, None
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("|"):
            header = None
            continue
        count = len(re.findall(r"(?<!\\)\|", line.rstrip()))
        if header is None:
            header = count
        elif count != header:
            found.append(f"line {number}: {count - 1} cells, the header {header - 1}")
    return found


def test_the_table_checks_find_a_pipe_in_a_cells_code_and_a_missing_cell():
    table = "| a | b |\n| --- | --- |\n| `abs(x)` | `|x|` |\n| `x || y` | `a\\|b` |\n"
    assert pipes_in_table_code(table) == ["line 3: `|x|`", "line 4: `x || y`", "line 4: `a\\|b`"]
    assert rows_with_another_cell_count(table) == ["line 3: 4 cells, the header 2", "line 4: 4 cells, the header 2"]
    fenced = "```\n| `|x|` |\n```\nA line with `|x|` outside a table.\n| ``a`b`` | `a` | b |\n| 1 | 2 | 3 |\n"
    assert pipes_in_table_code(fenced) == [] and rows_with_another_cell_count(fenced) == []
    assert rows_with_another_cell_count("| a | b |\n| --- | --- |\n| 1 |\n\n| c |\n| --- |\n") == [
        "line 3: 1 cells, the header 2"]


@pytest.mark.parametrize("page", [README, *PAGES], ids=rel)
def test_every_table_renders_on_github(page):
    text = read(page)
    found = pipes_in_table_code(text)
    assert not found, f"{rel(page)}: a `|` inside a table cell's code splits the cell on GitHub: {found}"
    found = rows_with_another_cell_count(text)
    assert not found, f"{rel(page)}: a table row with a cell missing or too many: {found}"


def test_readme_keeps_the_lines_ci_runs():
    """.ci/run greps README.md for its test lines (`readme_line 'PATTERN'`) and runs them as written: each must
    match a line of a code block. The toy line is the quick start."""
    readme = read(README)
    code_lines = [line for block in FENCE.findall(readme) for line in block.splitlines()]
    patterns = re.findall(r"=\$\(readme_line '([^']+)'\)", read(os.path.join(REPO, ".ci", "run")), re.M)
    assert len(patterns) >= 2, "found no readme_line calls in .ci/run"
    toy = r"^pip install -r requirements-\S+\.txt && python grpo\.py --preset toy$"
    for pattern in [*patterns, toy]:
        first = next((line for line in readme.splitlines() if re.search(pattern, line)), None)
        assert first is not None, f"README.md has no line matching {pattern}"
        assert first in code_lines, f"README.md's first line matching {pattern} is not in a code block: {first}"


def test_ci_stops_each_stream_inside_its_90_minutes():
    """.ci/run bounds every stage (`in_venv NAME LIMIT ...`) so that a stage that hangs fails CI with a log, not past
    CI's 5,400 s without one: the limits of each stream (stream_a, stream_b) add up to under 5,400 s, with room for
    the environments' installs (their pip lines are inside the stages) and the SIGKILL grace (60 s a stage)."""
    ci = read(os.path.join(REPO, ".ci", "run"))
    for stream in ("stream_a", "stream_b"):
        body = re.search(rf"^{stream}\(\) {{\n(.*?)^}}", ci, re.M | re.S).group(1)
        stages = re.findall(r"in_venv \S+ (\d+) ", body)
        calls = re.findall(r"in_venv ", body)
        assert stages and len(stages) == len(calls), f"{stream}: a stage without its limit in .ci/run"
        assert sum(int(s) for s in stages) + 60 * len(stages) <= 5400 - 600, (stream, stages)


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    config = yaml.safe_load(read(os.path.join(REPO, "mkdocs.yml")))
    assert config["docs_dir"] == "docs"
    nav = nav_pages(config["nav"])
    on_disk = {os.path.relpath(page, DOCS) for page in PAGES}
    assert not on_disk - set(nav), f"pages missing from mkdocs.yml's nav: {sorted(on_disk - set(nav))}"
    assert not set(nav) - on_disk, f"nav entries with no page: {sorted(set(nav) - on_disk)}"
    assert len(nav) == len(set(nav)), "a page is listed twice in the nav"


@pytest.mark.parametrize("page", [README, *PAGES], ids=rel)
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", read(page))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(resolved):
            broken.append(f"{target}: no file {rel(resolved)}")
        elif page != README and not resolved.startswith(DOCS + os.sep):
            broken.append(f"{target}: outside docs/, which the site does not have (name the file in `code` instead)")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {rel(resolved)}")
    assert not broken, f"{rel(page)}: " + "; ".join(broken)


def test_quoted_code_is_the_live_code():
    """The `diff -u grpo.py X.py` blocks and grpo.py's ALGO LOGIC on the estimator pages, the README's excerpt, the
    layout of common/ and the studies' tables."""
    make_diffs = load_make_diffs()
    problems = make_diffs.check()
    assert not problems, "\n".join(problems)
    for name in ("gspo", "snib", "ctpo", "p3o"):
        page = read(os.path.join(DOCS, "estimators", f"{name}.md"))
        assert f"<!-- begin: diff -u grpo.py {name}.py -->" in page, f"docs/estimators/{name}.md quotes no diff"


def load_make_diffs():
    spec = importlib.util.spec_from_file_location("make_diffs", os.path.join(DOCS, "make_diffs.py"))
    make_diffs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_diffs)
    return make_diffs


def test_a_study_against_a_baseline_by_hand(tmp_path, monkeypatch):
    """Issue 53: `study-vs TAG grpo`. IPO's two finals (50%, 50%) against GRPO's three (60, 70, 80%): -20.0 points;
    of the 10 ways to pick 2 of the 5 pooled values, {50, 50} (the observed, 0.20 apart) and {70, 80} (0.217)
    are as extreme: p = 0.20, also the smallest 2 seeds against 3 can give. Diagnostics and minutes: GRPO's runs'
    means (ESS 0.9, 0.8, 0.7: 0.800; minutes 10, 12, 14: 12.0); IPO's runs were recorded without them: "-"."""
    make_diffs = load_make_diffs()
    monkeypatch.setattr(make_diffs, "ROOT", str(tmp_path))
    os.makedirs(tmp_path / "docs" / "studies")

    def run(algo, seed, final, ess=None):
        r = {"algo": algo, "seed": seed, "value": None, "seconds": 60.0, "evals": [[0, 0.4], [10, final]]}
        if ess is not None:
            r.update(minutes=[0.0, 8.0 + 2 * seed], diagnostics={"policy/ess": ess, "policy/clip_frac": 0.05,
                                                                 "policy/entropy": 0.5, "policy/log_ratio_std": 0.25})
        return r

    results = [run("grpo", 1, 0.6, 0.9), run("grpo", 2, 0.7, 0.8), run("grpo", 3, 0.8, 0.7), run("ipo", 1, 0.5),
               run("ipo", 2, 0.5)]
    study = {"command": "python -m evals.compare --tag t", "commit": "0123456789abcdef", "vary": None,
             "results": results}
    (tmp_path / "docs" / "studies" / "t.json").write_text(json.dumps(study))
    lines = make_diffs.study_against("t", "grpo")
    assert "(the smallest p these seeds can give: 0.2 with 2 seeds against 3)" in lines[0]
    assert lines[2:] == [
        "| estimator | accuracy, mean +- std | vs grpo | p | ESS | log-ratio std | clip | entropy | KL | "
        "training minutes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        "| grpo | 70.0 +- 10.0% |  |  | 0.800 | 0.250 | 5.0% | 0.500 | - | 12.0 |",
        "| ipo | 50.0 +- 0.0% | -20.0 | 0.20 | - | - | - | - | - | - |"]
    with pytest.raises(SystemExit, match="has no runs of dro"):
        make_diffs.study_against("t", "dro")
    (tmp_path / "docs" / "studies" / "v.json").write_text(json.dumps({**study, "vary": "rollout_lag"}))
    with pytest.raises(SystemExit, match="varies --rollout_lag: a study-vs block takes a study without --vary"):
        make_diffs.study_against("v", "grpo")
    assert make_diffs.short("a" * 40 + "," + "b" * 40) == "aaaaaaa, bbbbbbb"  # a study whose runs span two commits
    # a study whose runs recorded their machines (evals.compare's machine()) names them beside the commit
    carried = {**study, "machines": ["AMD EPYC (family 25, model 17), torch AVX512", "Intel Xeon, torch AVX2"]}
    (tmp_path / "docs" / "studies" / "m.json").write_text(json.dumps(carried))
    assert make_diffs.study_against("m", "grpo")[0].startswith(
        "`python -m evals.compare --tag t` (commit 0123456; ran on AMD EPYC (family 25, model 17), torch AVX512; "
        "Intel Xeon, torch AVX2). The held-out greedy accuracy at step 10, step 10's difference")
    # P3O's clip column is its share capped at the ESS; Clip-Cov's dropped tokens get a column of their own
    own = [{**r, "algo": a, "diagnostics": {**r["diagnostics"], **extra}} for r in results[:3] for a, extra in (
        ("grpo", {}), ("p3o", {"policy/clip_frac": None, "p3o/capped_frac": 0.02}),
        ("covpo", {"covpo/selected_frac": 0.001}))]
    for r in own:
        r["diagnostics"] = {k: v for k, v in r["diagnostics"].items() if v is not None}
    (tmp_path / "docs" / "studies" / "o.json").write_text(json.dumps({**study, "results": own}))
    lines = make_diffs.study_against("o", "grpo")
    assert lines[2].endswith("| training minutes | dropped (Clip-Cov) |") and lines[3].count("---") == 11
    assert [line.split(" | ")[6:] for line in lines[4:]] == [
        ["5.0%", "0.500", "-", "12.0", "- |"], ["2.0%", "0.500", "-", "12.0", "- |"],
        ["5.0%", "0.500", "-", "12.0", "0.1% |"]]
    # an evaluation between the start and the last gets a column of its own, before the last's
    for r in results:
        r["evals"] = [[0, 0.4], [5, r["evals"][-1][1] - 0.1], r["evals"][-1]]
    (tmp_path / "docs" / "studies" / "e.json").write_text(json.dumps({**study, "results": results}))
    lines = make_diffs.study_against("e", "grpo")
    assert "The held-out greedy accuracy at step 5 and at step 10, step 10's difference" in lines[0]
    assert lines[2].startswith("| estimator | step 5, mean +- std | accuracy, mean +- std | vs grpo |")
    assert lines[3].count("---") == 11
    assert lines[4].startswith("| grpo | 60.0 +- 10.0% | 70.0 +- 10.0% |  |  | 0.800 |")
    assert lines[5].startswith("| ipo | 40.0 +- 0.0% | 50.0 +- 0.0% | -20.0 | 0.20 |")


def test_a_study_block_is_the_table_of_its_runs_file(tmp_path, monkeypatch):
    """Issue 52, item 7: a study's figures have one source, the study.json its runs wrote (docs/studies/TAG.json);
    the page's block is rendered from it (hand-computed here), and a block whose file is missing is named."""
    make_diffs = load_make_diffs()
    monkeypatch.setattr(make_diffs, "ROOT", str(tmp_path))
    os.makedirs(tmp_path / "docs" / "studies")

    def run(algo, seed, final, value=None):
        return {"algo": algo, "seed": seed, "value": value, "seconds": 60.0 * seed,
                "evals": [[0, 0.4], [50, 0.5], [100, final]]}

    results = [run("grpo", 1, 0.6), run("grpo", 2, 0.7), run("grpo", 3, 0.8), run("ipo", 1, 0.5), run("ipo", 2, 0.5)]
    study = {"command": "python -m evals.compare --tag t", "commit": "0123456789abcdef", "vary": None,
             "results": results}
    (tmp_path / "docs" / "studies" / "t.json").write_text(json.dumps(study))
    assert make_diffs.study_table("t") == [
        "`python -m evals.compare --tag t` (commit 0123456); held-out greedy accuracy over seeds 1, 2, 3:", "",
        "| estimator | step 0 | step 100, mean +- std | each seed's | minutes per run |",
        "| --- | --- | --- | --- | --- |",
        "| grpo | 40.0% | 70.0 +- 10.0% | 60.0%, 70.0%, 80.0% | 2.0 |",
        "| ipo | 40.0% | 50.0 +- 0.0% | 50.0%, 50.0% | 1.5 |"]
    assert make_diffs.study_table("t", only="ipo")[2:] == [
        "| estimator | step 0 | step 100, mean +- std | each seed's | minutes per run |",
        "| --- | --- | --- | --- | --- |",
        "| ipo | 40.0% | 50.0 +- 0.0% | 50.0%, 50.0% | 1.5 |"]
    # --vary: a column per value, each cell the mean +- std over seeds and each seed's
    study.update(vary="rollout_lag", results=[run("grpo", 1, 0.6, "0"), run("grpo", 2, 0.8, "0"),
                                              run("grpo", 1, 0.3, "2"), run("grpo", 2, 0.3, "2"),
                                              run("ipo", 1, 0.5, "0"), run("ipo", 1, 0.5, "2")])
    (tmp_path / "docs" / "studies" / "v.json").write_text(json.dumps(study))
    assert make_diffs.study_table("v")[2:] == [
        "| estimator | step 0 | rollout_lag 0, step 100 | rollout_lag 2, step 100 | minutes per run |",
        "| --- | --- | --- | --- | --- |",
        "| grpo | 40.0% | 70.0 +- 14.1% (60.0%, 80.0%) | 30.0 +- 0.0% (30.0%, 30.0%) | 1.5 |",
        "| ipo | 40.0% | 50.0% (50.0%) | 50.0% (50.0%) | 1.0 |"]  # one seed: no std
    page = tmp_path / "page.md"
    page.write_text("<!-- begin: study t -->\nold\n<!-- end -->\n<!-- begin: study gone -->\n<!-- end -->\n")
    monkeypatch.setattr(make_diffs, "pages", lambda: [str(page)])
    assert make_diffs.check() == ["page.md: the block 'study t' is stale: run python docs/make_diffs.py",
                                  "page.md: the study 'gone' has no docs/studies/gone.json"]
    with pytest.raises(SystemExit, match="has no docs/studies/gone.json"):  # writing stops, in one line, and
        make_diffs.write()  # writes nothing
    assert page.read_text().startswith("<!-- begin: study t -->\nold\n")


def differ_table(path: str) -> list[str]:
    lines = read(path).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| | grpo |"))  # a column per estimator
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return lines[start:end]


def test_the_table_of_differences_has_a_column_per_estimator_and_the_readme_links_it():
    """docs/estimators/index.md's "How they differ" holds a column for every estimator script (evals.ALGORITHMS);
    the README, a short read, links it instead of repeating its 14 columns."""
    from evals import ALGORITHMS

    table = differ_table(os.path.join(DOCS, "estimators", "index.md"))
    columns = [cell.strip() for cell in table[0].strip("|").split("|")][1:]
    assert sorted(columns) == sorted(ALGORITHMS), columns
    assert all(row.count("|") == table[0].count("|") for row in table), "a row of the table has another cell count"
    readme = read(README)
    assert not any(line.startswith("| | grpo |") for line in readme.splitlines()), "README.md repeats the table"
    assert "(docs/estimators/index.md#how-they-differ)" in readme
    assert "(docs/estimators/choosing.md)" in readme, "README.md's 'which estimator' section links its page"


def test_every_estimator_table_lists_every_script():
    """The README's table of scripts and papers and docs/index.md's table of pages name every estimator script (the
    top-level scripts with a compute_loss, evals.ALGORITHMS), so a new one cannot be left out of either."""
    from evals import ALGORITHMS

    for path in (README, os.path.join(DOCS, "index.md")):
        listed = set(re.findall(r"^\|(?:[^|\n]*\|)? `(\w+)\.py` \|", read(path), re.M))  # the first or second cell
        assert listed == set(ALGORITHMS), (rel(path), sorted(set(ALGORITHMS) ^ listed))


# Paths that exist only beside a development checkout (a sibling folder, a spec and house rules kept outside the
# repository, a machine's home or work folders). Built from pieces so that this file does not match itself.
OUTSIDE = ["../" + "shared", "ESTIMATORS" + ".md", "STYLE" + ".md", "/" + "work/", "/" + "root/", "/" + "home/"]


def tracked_text(path: str) -> str | None:
    """A tracked file's text (a .gz file's decompressed text); None for a binary file (.png: a NUL byte or not
    UTF-8), which cannot hold a path a reader would follow."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        data = f.read()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_the_repository_points_nowhere_outside_itself():
    """Every file git tracks, code, docs, configs and data alike (tests/data's .jsonl.gz decompressed; only binary
    files such as the docs' .png figures are skipped), names nothing outside the repository: the shared conventions
    are docs/estimators/conventions.md, and a script or test that needs a path takes it as an argument."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    hits, read_files = [], 0
    for name in listed.decode().split("\0"):
        path = os.path.join(REPO, name)
        if not name or not os.path.isfile(path):  # deleted in the work tree, not yet committed
            continue
        text = tracked_text(path)
        if text is None:
            continue
        read_files += 1
        for number, line in enumerate(text.splitlines(), 1):
            found = [s for s in OUTSIDE if s in line]
            if found:
                hits.append(f"{name}:{number}: {', '.join(found)}: {line.strip()[:120]}")
    assert read_files > 100, f"read only {read_files} tracked text files"
    assert not hits, "files point outside the repository:\n" + "\n".join(hits)


def expand_braces(text: str) -> list[str]:
    """`{grpo,gspo}_qwen3_{4b,14b}.yaml` -> the four names it stands for (shell brace expansion, no nesting)."""
    match = re.search(r"\{([^{}]*)\}", text)
    if match is None:
        return [text]
    return [name for option in match.group(1).split(",")
            for name in expand_braces(text[: match.start()] + option + text[match.end():])]


def test_replicating_lists_every_recipe():
    """docs/replicating.md's table (its first column) names every file of configs/recipes/ (brace forms expanded),
    and no other."""
    cells = re.findall(r"^\| ([^|]+) \|", read(os.path.join(DOCS, "replicating.md")), re.M)
    listed = {name for cell in cells for quoted in re.findall(r"`([^`]+\.yaml)`", cell)
              for name in expand_braces(quoted)}
    on_disk = {os.path.basename(p) for p in glob.glob(os.path.join(REPO, "configs", "recipes", "*.yaml"))}
    assert listed == on_disk, f"replicating.md: missing {sorted(on_disk - listed)}, extra {sorted(listed - on_disk)}"


def test_every_metric_key_the_code_writes_is_in_metrics_md():
    """Every literal metric key of the scripts and common/ (a string `namespace/name` in a namespace the logs use:
    policy/, loss/, optim/, reward/, ... and each estimator's own, snib/, p3o/, ...) appears in docs/metrics.md as
    `key`. Keys built at run time (reward/<fn>/mean, ctpo's position buckets) are documented by their pattern."""
    from evals import ALGORITHMS

    spaces = ["policy", "loss", "optim", "reward", "completion", "dynamic", "rollout", "tool", "time", "memory",
              "eval", *ALGORITHMS]
    key = re.compile(r"[\"']((?:" + "|".join(spaces) + r")/[\w@.=-]+)[\"']")
    written = {}
    for path in glob.glob(os.path.join(REPO, "*.py")) + glob.glob(os.path.join(REPO, "common", "**", "*.py"),
                                                                 recursive=True):
        for name in key.findall(read(path)):
            written.setdefault(name, set()).add(rel(path))
    page = read(os.path.join(DOCS, "metrics.md"))
    assert len(written) > 40, sorted(written)
    missing = {name: sorted(where) for name, where in written.items() if f"`{name}`" not in page}
    assert not missing, f"metric keys written but not in docs/metrics.md: {missing}"


def readme_script_commands() -> list[tuple[str, list[str]]]:
    """Every command of README.md's code blocks that runs an estimator script, directly or under
    `accelerate launch`: (the script's name, the arguments after it), continuation lines joined and
    comments dropped."""
    from evals import ALGORITHMS

    commands = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", read(README), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|;", line.split("  #")[0]):
                if not part.strip().startswith(("python ", "accelerate ")):
                    continue  # a pip line, or a line of a Python example
                words = shlex.split(part)
                scripts = [i for i, w in enumerate(words) if w.endswith(".py") and w[:-3] in ALGORITHMS]
                if scripts and words[0] in ("python", "accelerate"):
                    commands.append((words[scripts[0]][:-3], words[scripts[0] + 1:]))
    return commands


def test_every_readme_command_parses(tmp_path, monkeypatch):
    """Issue 68: each script command the README shows parses with its script's own parser, TRL
    habits and typos refused as they would be; a bare `--resume_from RUN` reads the settings its run
    folder recorded, so the run it names (an earlier command's --run_name) is recorded first."""
    from common.args import parse_args

    monkeypatch.chdir(tmp_path)
    commands = readme_script_commands()
    assert len(commands) >= 6, commands
    for name, argv in commands:
        args_cls = importlib.import_module(name).Args
        if "--resume_from" in argv:
            run_dir = argv[argv.index("--resume_from") + 1]
            assert os.path.isdir(run_dir), f"README resumes {run_dir}, which no command before it names"
        args = parse_args(args_cls, argv)
        if args.run_name:
            os.makedirs(os.path.join("runs", args.run_name), exist_ok=True)
            with open(os.path.join("runs", args.run_name, "args.json"), "w") as f:
                json.dump(dataclasses.asdict(args), f)


def test_the_readme_reward_example_runs(tmp_path, monkeypatch):
    """README's custom reward function, saved as the file its first line names, selected by the `--reward_funcs`
    of the command under it, and called as the trainer calls it (common/tasks/rewards.py compute_rewards) on toy rows:
    one finite number per completion, the right sum above a wrong one. At most ten lines, as the README says."""
    from common.tasks.reward_names import get_reward_function
    from common.tasks.rewards import compute_rewards

    readme = read(README)
    section = readme[readme.index("## Your own data and reward"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 10, code
    filename = re.match(r"# (\w+\.py)", code).group(1)
    spec = re.search(r"--reward_funcs (\S+)", section).group(1)
    assert spec.split(":")[0] == filename[: -len(".py")], (spec, filename)
    (tmp_path / filename).write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward_function(spec)
    prompts, answers = ["12+34=", "12+34=", "5+5="], ["46", "46", "10"]
    total, per_function = compute_rewards([fn], None, prompts, ["46", "47", "10"], {"answer": answers})
    assert total.shape == (3,) and bool(total.isfinite().all()) and total[0] > total[1], total


def test_the_count_of_bad_inputs_in_the_safety_page_is_the_tests_count():
    """docs/safety.md says how many bad inputs tests/test_rails.py refuses: the number of rows of its *_CASES."""
    import test_rails

    count = sum(len(getattr(test_rails, name)) for name in dir(test_rails) if name.endswith("_CASES"))
    assert f"`tests/test_rails.py` holds {count} bad inputs" in read(os.path.join(REPO, "docs", "safety.md")), count


def test_the_real_run_table_in_the_safety_page_is_the_tests():
    """docs/safety.md's "What a real run can meet" is tests/test_real_runs.py's REAL_RUNS, row for row (the case,
    what happens, the test that holds it), and says how many there are."""
    import test_real_runs

    section = read(os.path.join(REPO, "docs", "safety.md")).split("## What a real run can meet\n")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and line.rstrip().endswith("` |")]
    assert rows == [f"| {case} | {what} | `{test}` |" for case, what, test in test_real_runs.REAL_RUNS]
    assert f"(issue 43): {len(rows)} cases, each tried and held by a test" in " ".join(section.split()), len(rows)


# A mean +- std followed by the runs it summarises, as the pages' tables and sentences write them: "80.1 +- 1.8% |
# 81.2%, 78.0%, 81.0%" or "43.6 +- 3.0% | 40.6, 46.6, 43.6%" (three runs or more: sdpo.md's studies have five).
SUMMARY_AND_RUNS = re.compile(r"(\d+\.\d) \+- (\d+\.\d)% \| ((?:\d+\.\d%?, ){2,}\d+\.\d)%")


def test_every_mean_and_spread_is_that_of_the_runs_beside_it():
    """Issue 52, item 7: a summary retyped beside its runs cannot drift from them: each mean and (sample) standard
    deviation is recomputed from the runs it stands beside, to the rounding of one decimal."""
    import statistics

    checked = 0
    for path in [README, *PAGES]:
        for match in SUMMARY_AND_RUNS.finditer(read(path)):
            mean, std = float(match[1]), float(match[2])
            runs = [float(x.rstrip("%")) for x in match[3].split(", ")]
            assert abs(statistics.mean(runs) - mean) <= 0.051, (rel(path), match[0])
            assert abs(statistics.stdev(runs) - std) <= 0.051, (rel(path), match[0])
            checked += 1
    assert checked > 40, checked


QUOTED_GAINS = re.compile(r"gained \+(\d\.\d{3}) \+- (\d\.\d{3}) on the seed-0 toy and "
                          r"\+(\d\.\d{3}) \+- (\d\.\d{3}) on the seed-1 toy "
                          r"\(\+(\d\.\d{3}) \+- (\d\.\d{3}) over the six runs\)")


def test_an_estimator_pages_learning_gains_are_the_learning_bars_file():
    """Issue 52, item 7: the gains an estimator's page quotes from its learning test's runs are those of
    tests/data/learning_bars.json, which benchmarks/learning_bars.py wrote (so a new sampler's bars update them)."""
    with open(os.path.join(REPO, "tests", "data", "learning_bars.json")) as f:
        bars = json.load(f)
    summary = bars["summary"]
    quoted = 0
    for name in sorted(summary):
        path = os.path.join(DOCS, "estimators", f"{name}.md")
        if not os.path.exists(path):
            continue
        for match in QUOTED_GAINS.finditer(" ".join(read(path).split())):
            want = [summary[name][toy][key] for toy in ("seed0", "seed1", "all") for key in ("mean", "std")]
            assert [float(x) for x in match.groups()] == [round(x, 3) for x in want], (name, match[0])
            quoted += 1
    assert quoted >= 3, quoted
    gains = {toy: [f"{r['gain']:.3f}" for r in bars["runs"] if r["name"] == "grpo" and r["toy"] == toy]
             for toy in ("seed0", "seed1")}
    said = "GRPO gained {}, {} and {}; on the seed-1 toy, {}, {} and {}.".format(*gains["seed0"], *gains["seed1"])
    assert said in " ".join(read(os.path.join(DOCS, "install.md")).split()), said


def test_the_readme_quotes_the_pages_that_measured_its_figures():
    """Issue 52, item 7: the README's two learning figures are the ones of the runs that measured them (the real
    model's three GRPO seeds, from their study's file; the quick start's timed runs, from the contributing page)."""
    import statistics

    readme = read(README)
    with open(os.path.join(DOCS, "studies", "smollm2_grpo.json")) as f:
        runs = json.load(f)["results"]  # the real model's three GRPO seeds (docs/real-model.md's study block)
    warm = statistics.mean(r["evals"][0][1] for r in runs)
    final = [r["evals"][-1][1] for r in runs]
    said = f"held-out accuracy {100 * warm:.1f}% -> {100 * statistics.mean(final):.1f} +- "
    said += f"{100 * statistics.stdev(final):.1f}% in 20 steps"
    assert said in readme, said
    rows = [re.findall(r"(\d+\.\d)% -> (\d+\.\d)%", line) for line in read(os.path.join(DOCS, "contributing.md"))
            .splitlines() if "python grpo.py --preset toy" in line]
    start, end = next(found[0] for found in rows if found)
    assert f"went from {start}% to {end}% held out" in readme, (start, end)


def test_the_2026_estimators_lag_figures_in_prose_are_their_studies():
    """Issue 52, item 7: the figures the pages' sentences quote from the 2026 estimators' lag studies (the tables
    themselves are study blocks) are those of docs/studies/lag_new5.json and dro_tau_lag2.json: each (page, phrase)
    below (the README's table too) is rebuilt from the runs and must be on its page."""
    import statistics

    def runs(tag, algo, value):
        with open(os.path.join(DOCS, "studies", f"{tag}.json")) as f:
            results = json.load(f)["results"]
        finals = [100 * r["evals"][-1][1] for r in sorted(results, key=lambda r: r["seed"])
                  if r["algo"] == algo and r["value"] == value]
        assert len(finals) == 3, (tag, algo, value)
        return finals

    def cell(tag, algo, value):
        finals = runs(tag, algo, value)
        return f"{statistics.mean(finals):.1f} +- {statistics.stdev(finals):.1f}%"

    def mean(tag, algo, value):
        return f"{statistics.mean(runs(tag, algo, value)):.1f}%"

    dro = [mean("lag_new5", "dro", v) for v in "0124"]
    dro_lag2 = sorted(runs("lag_new5", "dro", "2"))
    quoted = [
        ("off-policy.md", f"{dro[0]} on-policy, then {dro[1]}, {dro[2]} and {dro[3]} at lag 1, 2 and 4"),
        ("off-policy.md", f"IPO ({mean('lag_new5', 'ipo', '4')} at lag 4, one seed "
                          f"{min(runs('lag_new5', 'ipo', '2')):.1f}% at lag 2)"),
        ("off-policy.md", f"`--tau 0.5` gives {cell('dro_tau_lag2', 'dro', '0.5')}, GRPO's level"),
        ("estimators/ipo.md", f"one seed at lag 2 at {min(runs('lag_new5', 'ipo', '2')):.1f}%"),
        ("estimators/dro.md", f"({dro_lag2[0]:.1f}-{dro_lag2[-1]:.1f}%), where GRPO gains "
                              f"{statistics.mean(runs('lag_new5', 'grpo', '2')) - 41.0:.0f} points"),
        ("estimators/dro.md", f"`--tau 0.5` matches GRPO at lag 2 ({cell('lag_new5', 'grpo', '2')} above)"),
        ("estimators/choosing.md", f"DRO from lag 1: {cell('lag_new5', 'dro', '2')} at lag 2 against GRPO's "
                                   f"{cell('lag_new5', 'grpo', '2')} "
                                   f"(`--tau 0.5`: {cell('dro_tau_lag2', 'dro', '0.5')})"),
    ]
    quoted.append(("../README.md", f"DRO from lag 1 (lag 2: {mean('lag_new5', 'dro', '2')} "
                                   f"against {mean('lag_new5', 'grpo', '2')}; `--tau 0.5`: "
                                   f"{mean('dro_tau_lag2', 'dro', '0.5')})"))
    for page, phrase in quoted:
        assert phrase in " ".join(read(os.path.join(DOCS, page)).split()), (page, phrase)


def test_the_2026_estimators_real_model_prose_is_their_study():
    """Issue 54, item 4: the sentences about the 2026 estimators on the real model quote docs/studies/smollm2_new5.json:
    VESPO's and GDPO's runs are one run (the same reward at every step is in their metrics, not in the study file;
    here their held-out evaluations are equal), and the range of the five at step 20 is the study's."""
    with open(os.path.join(DOCS, "studies", "smollm2_new5.json")) as f:
        results = {r["algo"]: r["evals"] for r in json.load(f)["results"]}
    assert sorted(results) == ["dro", "gdpo", "ipo", "luspo", "vespo"]
    assert results["vespo"] == results["gdpo"]
    (_, at10), (_, at20) = results["vespo"][1], results["vespo"][2]
    finals = [100 * evals[-1][1] for evals in results.values()]
    with open(os.path.join(DOCS, "real-model.md")) as f:
        assert f"({100 * at10:.1f}% at step 10, {100 * at20:.1f}% at step 20)" in f.read()
    with open(os.path.join(DOCS, "estimators", "choosing.md")) as f:
        assert f"in the same range, {min(finals):.1f}-{max(finals):.1f}%, one seed each" in f.read()


# the estimators' names as the pages write them, for the prose the study tests rebuild
NAMES = {"grpo": "GRPO", "gspo": "GSPO", "snib": "SNIB", "ctpo": "CTPO", "p3o": "P3O", "cispo": "CISPO", "gmpo": "GMPO",
         "sapo": "SAPO", "rloo": "RLOO", "dppo": "DPPO", "reinforcepp": "REINFORCE++", "maxrl": "MaxRL",
         "covpo": "Clip-Cov", "ipo": "IPO", "dro": "DRO", "vespo": "VESPO", "luspo": "LUSPO", "gdpo": "GDPO"}


def same_runs(algos: list[str], finals) -> str:
    """"GSPO = GMPO; CTPO = P3O": the estimators whose runs end the same, seed for seed (finals(algo): each seed's
    final accuracy), each group once, in the study's order."""
    groups = []
    for algo in algos:
        same = [b for b in algos if finals(b) == finals(algo)]
        if len(same) > 1 and same[0] == algo:
            groups.append(" = ".join(NAMES[b] for b in same))
    return "; ".join(groups)


def test_every_estimator_under_lag_prose_is_its_study():
    """Issue 52, item 7: the lag tables of every estimator's page, the side-by-side page and off-policy.md are study
    blocks of docs/studies/lag_all.json; the sentences that sum them up are rebuilt here from its runs: which
    estimators end with every seed under (or above) every GRPO seed at a lag, which are one run at lag 0, and the
    means the pages quote."""
    import statistics

    with open(os.path.join(DOCS, "studies", "lag_all.json")) as f:
        results = json.load(f)["results"]
    algos = list(dict.fromkeys(r["algo"] for r in results))
    lags = list(dict.fromkeys(r["value"] for r in results))
    assert sorted(algos) == sorted(NAMES) and lags == ["0", "1", "2", "4"] and len(results) == 18 * 4 * 3

    def finals(algo, lag):
        return [100 * r["evals"][-1][1] for r in sorted(results, key=lambda r: r["seed"])
                if r["algo"] == algo and r["value"] == lag]

    def mean(algo, lag):
        return f"{statistics.mean(finals(algo, lag)):.1f}%"

    def side(apart):
        found = [(algo, [lag for lag in lags if apart(finals(algo, lag), finals("grpo", lag))]) for algo in algos[1:]]
        return "; ".join(f"{NAMES[a]} at lag {', '.join(where)}" for a, where in found if where) or "none"

    below = side(lambda a, g: max(a) < min(g))
    above = side(lambda a, g: min(a) > max(g))
    equal = same_runs(algos, lambda algo: finals(algo, "0"))  # one run at lag 0
    quoted = [
        ("off-policy.md", f"(evaluation.md#comparing-estimators)): {below}."),
        ("off-policy.md", f"**Every seed above**: {above}."),
        ("off-policy.md", f"SAPO at lag 4 ({mean('sapo', '4')}, against GRPO's {mean('grpo', '4')})"),
        ("off-policy.md", f"CISPO ({mean('cispo', '4')} at lag 4"),
        ("off-policy.md", f"MaxRL above it at lag 4 ({mean('maxrl', '4')} against {mean('grpo', '4')})"),
        ("off-policy.md", f"**On-policy (lag 0) the reductions hold seed for seed**: {equal}."),
        ("estimators/index.md", f"Every seed under every GRPO seed at a lag: {below}; every seed above: {above}."),
        ("estimators/index.md", f"on-policy {equal} seed for seed"),
        ("estimators/sapo.md", f"SAPO breaks at lag 4 ({mean('sapo', '4')} against GRPO's {mean('grpo', '4')};"),
        ("estimators/cispo.md", f"({mean('cispo', '4')} against {mean('grpo', '4')})"),
        ("estimators/maxrl.md", f"({mean('maxrl', '4')} against {mean('grpo', '4')})"),
        ("estimators/ctpo.md", f"({mean('ctpo', '0')} at lag 0, {mean('ctpo', '4')} at lag 4"),
        ("../README.md", f"SAPO breaks at lag 4 ({mean('sapo', '4')} against GRPO's {mean('grpo', '4')})"),
        ("estimators/choosing.md", f"MaxRL above it at lag 4 ({mean('maxrl', '4')} against {mean('grpo', '4')})"),
    ]
    assert "GSPO at lag 2, 4" in below and "P3O at lag 2, 4" in below and "MaxRL at lag 4" in above  # the pages' prose
    for page, phrase in quoted:
        assert phrase in " ".join(read(os.path.join(DOCS, page)).split()), (page, phrase)


def test_every_estimator_on_policy_prose_is_its_study():
    """Issue 52, item 7: the toy's on-policy tables are study blocks of docs/studies/onpolicy_all.json (eighteen
    estimators, three seeds, 500 steps); the sentences that sum them up are rebuilt here from its runs: which runs are
    one run seed for seed, the range of the means, GRPO's, the permutation p-values against GRPO, SAPO's rounding."""
    import statistics

    from evals.stats import permutation_p, shift_for_chance

    with open(os.path.join(DOCS, "studies", "onpolicy_all.json")) as f:
        results = json.load(f)["results"]
    algos = list(dict.fromkeys(r["algo"] for r in results))
    assert sorted(algos) == sorted(NAMES) and len(results) == 18 * 3
    finals = {a: [100 * r["evals"][-1][1] for r in sorted(results, key=lambda r: r["seed"]) if r["algo"] == a]
              for a in algos}

    def cell(algo):
        return f"{statistics.mean(finals[algo]):.1f} +- {statistics.stdev(finals[algo]):.1f}%"

    equal = same_runs(algos, finals.get)
    means = [statistics.mean(v) for v in finals.values()]
    span = f"between {min(means):.1f}% and {max(means):.1f}%"
    p = {a: permutation_p(finals[a], finals["grpo"]) for a in algos[1:]}
    closest = min(p, key=p.get)
    lead = statistics.mean(finals[closest]) - statistics.mean(finals["grpo"])
    apart = [a for a in algos[1:] if max(finals[a]) < min(finals["grpo"]) or min(finals[a]) > max(finals["grpo"])]
    assert apart == [] and closest == "covpo" and max(p.values()) == 1.0, (apart, p)
    quoted = [
        ("toy.md", f"The reductions hold seed for seed: {equal} (the first pair"),
        ("toy.md", f"All eighteen end {span} (means over seeds), GRPO at {cell('grpo')}."),
        ("toy.md", f"gives p from {p[closest]:.1f} (Clip-Cov, +{lead:.1f} points) to 1"),
        ("estimators/index.md", f"On-policy the reductions hold seed for seed: {equal} ([conventions]"),
        ("estimators/index.md", f"All eighteen end {span} (means over seeds), GRPO at {cell('grpo')}:"),
        ("estimators/choosing.md", f"all eighteen end {span} (means over seeds), GRPO at {cell('grpo')}"),
        ("../README.md", f"on the toy all eighteen ended at {min(means):.1f}-{max(means):.1f}%"),
        ("estimators/sapo.md", f"{cell('sapo')} against GSPO's {cell('gspo')} and GRPO's {cell('grpo')}"),
        ("estimators/gspo.md", f"{cell('gspo')} against GRPO's {cell('grpo')}, and GMPO's runs are GSPO's seed for "
                               f"seed"),
        ("estimators/reinforcepp.md", f"REINFORCE++ ends at {cell('reinforcepp')} against GRPO's {cell('grpo')} "
                                      f"(exact permutation p = {p['reinforcepp']:.1f})"),
        ("estimators/maxrl.md", f"MaxRL ends at {cell('maxrl')} against GRPO's {cell('grpo')} (exact permutation "
                                f"p = {p['maxrl']:.1f})"),
        ("estimators/covpo.md", f"Clip-Cov ends at {cell('covpo')} against GRPO's {cell('grpo')} (exact permutation "
                                f"p = {p['covpo']:.1f}, the smallest of the eighteen"),
    ]
    assert "GSPO = GMPO" in equal and "CISPO = DPPO" in equal and "SAPO" not in equal  # the pages' prose
    seed_1 = next(r for r in results if r["algo"] == "grpo" and r["seed"] == 1)  # the quick start's run
    accuracies = ", ".join(f"{100 * value:.1f}" for _, value in seed_1["evals"])
    quoted.append(("toy.md", f"Held-out accuracy at steps 0, 50, ..., 500: {accuracies}%."))
    quoted.append(("toy.md", f"(`step 50: held-out accuracy {100 * seed_1['evals'][1][1]:.1f}%`"))
    shift = shift_for_chance(3, 3, 0.8)
    seen = shift * statistics.stdev(finals["grpo"])
    assert all(abs(statistics.mean(v) - statistics.mean(finals["grpo"])) < seen for v in finals.values())
    quoted.append(("evaluation.md", f"differ by {shift:.1f} standard deviations of a run (`evals/stats.py` "
                                    f"`shift_for_chance(3, 3, 0.8)`). On the toy, on-policy, GRPO's three seeds have "
                                    f"a standard deviation of {statistics.stdev(finals['grpo']):.1f} points"))
    quoted.append(("evaluation.md", f"see a difference of about {seen:.1f} points four times in five; none of the "
                                    f"eighteen was that far from GRPO there."))
    for page, phrase in quoted:
        assert phrase in " ".join(read(os.path.join(DOCS, page)).split()), (page, phrase)


def test_the_kl_defaults_the_choice_page_lists_are_the_scripts():
    """docs/estimators/choosing.md names the scripts whose default --beta is not 0 (each costs a reference model, or
    a KL in the reward), held to the scripts' own Args."""
    from evals import ALGORITHMS

    defaults = {name: importlib.import_module(name).Args().beta for name in ALGORITHMS}
    assert {k: v for k, v in defaults.items() if v} == {"grpo": 0.04, "landscape": 0.04, "gdpo": 0.04, "snib": 0.1,
                                                      "rloo": 0.05, "reinforcepp": 0.01}
    phrase = ("the defaults: GRPO, its landscape variants and GDPO 0.04, SNIB 0.1, RLOO 0.05 and REINFORCE++ 0.01 "
              "(in the reward), the others 0")
    assert phrase in " ".join(read(os.path.join(DOCS, "estimators", "choosing.md")).split())


def test_the_siblings_cost_figures_are_their_measurement():
    """Issue 53 item 4: every script's CPU time a step against grpo.py's at equal beta, on-policy and stale, is one
    measurement (docs/benchmarks/siblings_cpu.json, from the two step_time.py commands docs/performance.md gives);
    performance.md's table and the figures that choosing.md and the README quote are rebuilt here from it."""
    with open(os.path.join(DOCS, "benchmarks", "siblings_cpu.json")) as f:
        measured = json.load(f)
    on, stale = measured["cpu_per_step"]["on-policy"], measured["cpu_per_step"]["stale"]
    ratio = {"on": {a: t / on["grpo"] for a, t in on.items()},
             "stale": {a: t / stale["grpo"] for a, t in stale.items()}}
    performance = read(os.path.join(DOCS, "performance.md"))
    for algo in on:
        row = (f"| {algo} | {on[algo]:.3f} s | {ratio['on'][algo]:.2f} | {stale[algo]:.3f} s | "
               f"{ratio['stale'][algo]:.2f} |")
        assert row in performance, row
    for command in measured["commands"].values():
        assert command.replace("grpo,gspo,snib,ctpo,p3o,cispo,gmpo,sapo,rloo,dppo,reinforcepp,maxrl,covpo,ipo,dro,"
                               "vespo,luspo,gdpo", "$ALL") in performance, command
    paying = {"snib", "p3o", "covpo"}  # a no-grad pass at the current weights off-policy (Clip-Cov's on-policy too)
    # the pages quote the table's ratios, rounded to two decimals
    others_on = max(abs(round(r, 2) - 1) for a, r in ratio["on"].items() if a != "covpo")
    others_stale = [round(r, 2) for a, r in ratio["stale"].items() if a not in paying]
    within = round(100 * max(others_on, *(abs(r - 1) for r in others_stale)))
    gib = [g for setting in measured["peak_gib"].values() for g in setting.values()]
    x = {a: f"{ratio['stale'][a]:.2f}" for a in paying}
    quoted = [
        ("performance.md", f"On-policy, every sibling is within {round(100 * others_on)}% of `grpo.py` "
                           f"but Clip-Cov / KL-Cov ({ratio['on']['covpo']:.2f}:"),
        ("performance.md", f"Stale, SNIB ({x['snib']}), P3O ({x['p3o']}) and Clip-Cov ({x['covpo']}) pay"),
        ("performance.md", f"the rest are within {round(100 * max(abs(r - 1) for r in others_stale))}% of"),
        ("performance.md", f"the peak RSS was {min(gib):.2f}-{max(gib):.2f} GiB for every script"),
        ("estimators/choosing.md", f"SNIB {x['snib']}x, P3O {x['p3o']}x grpo.py's; the others but Clip-Cov "
                                   f"{min(others_stale):.2f}-{max(others_stale):.2f}x"),
        ("estimators/choosing.md", f"{ratio['on']['covpo']:.2f}x grpo.py's on-policy, {x['covpo']}x stale"),
        ("estimators/choosing.md", f"on the toy every script's peak RSS was {min(gib):.2f}-{max(gib):.2f} GiB"),
        ("estimators/p3o.md", f"(the ESS), {x['p3o']}x grpo.py's step on the toy"),
        ("../README.md", f"stale: SNIB {x['snib']}x, P3O {x['p3o']}x, Clip-Cov {x['covpo']}x grpo.py's (a no-grad "
                         f"pass per optimizer step; Clip-Cov's on-policy too: {ratio['on']['covpo']:.2f}x); the others "
                         f"within {within}%"),
    ]
    for page, phrase in quoted:
        assert phrase in " ".join(read(os.path.join(DOCS, page)).split()), (page, phrase)


def test_the_sapo_ablation_prose_is_its_studies():
    """docs/off-policy.md's SAPO ablation at lag 4 is three studies (a narrow gate, a KL term, GRPO without its KL
    term); the figures that off-policy.md, SAPO's page and choosing.md quote are rebuilt here from them."""
    import statistics

    def cell(tag, algo):
        with open(os.path.join(DOCS, "studies", f"{tag}.json")) as f:
            finals = [100 * r["evals"][-1][1] for r in json.load(f)["results"] if r["algo"] == algo]
        assert len(finals) == 3
        return f"{statistics.mean(finals):.1f} +- {statistics.stdev(finals):.1f}%"

    narrow, anchored = cell("sapo_lag4_tau4", "sapo"), cell("sapo_lag4_beta", "sapo")
    grpo = cell("grpo_lag4_beta0", "grpo")
    quoted = [
        ("off-policy.md", f"**A narrow gate does not help** ({narrow})."),
        ("off-policy.md", f"lifts SAPO to {anchored} (KL to the reference"),
        ("off-policy.md", f"without it, {grpo} (its clip removed"),
        ("estimators/sapo.md", f"does not help ({narrow}), GRPO's KL term does (`--beta 0.04`: {anchored}), and GRPO "
                               f"without its KL term holds ({grpo})."),
        ("estimators/choosing.md", f"did not help ({narrow}); a KL term (`--beta 0.04`) lifted it to {anchored}, still "
                                   f"below GRPO; GRPO without its KL term held ({grpo})"),
    ]
    for page, phrase in quoted:
        assert phrase in " ".join(read(os.path.join(DOCS, page)).split()), (page, phrase)


def test_the_2026_estimators_off_policy_prose_is_its_study():
    """Issue 54, item 4: real-model.md's reading of docs/studies/offpolicy_new5.json (one seed each, in the
    comparison's regime): IPO, VESPO and LUSPO above GRPO's seed, GDPO level with it (within a point), DRO under it."""
    with open(os.path.join(DOCS, "studies", "offpolicy_new5.json")) as f:
        final = {r["algo"]: 100 * r["evals"][-1][1] for r in json.load(f)["results"]}
    assert all(final[a] > final["grpo"] for a in ("ipo", "vespo", "luspo")), final
    assert round(abs(final["gdpo"] - final["grpo"]), 1) <= 1.0 and final["dro"] < final["grpo"], final
    phrase = "IPO, VESPO and LUSPO ended above GRPO's seed, GDPO level with it, DRO under it"
    assert phrase in " ".join(read(os.path.join(DOCS, "real-model.md")).split())


def test_every_estimator_on_stale_data_prose_is_its_study():
    """Issue 52, item 7: the toy's stale-data tables are study blocks of docs/studies/stale_all.json (eighteen
    estimators at their defaults, three seeds, 250 steps, eight optimizer steps a batch), of its two KL ablations
    (stale_grpo_beta0, stale_cispo_beta) and of KL-Cov's runs (stale_klcov); the sentences that sum them up are
    rebuilt here from their runs: the span of the means, which estimators end with every seed under every GRPO seed,
    which ended under the warm start, the scripts with a KL term (held to their own Args), the ablations."""
    import statistics

    from evals.stats import permutation_p

    def finals(tag):
        with open(os.path.join(DOCS, "studies", f"{tag}.json")) as f:
            results = json.load(f)["results"]
        runs = {}
        for r in sorted(results, key=lambda r: r["seed"]):
            runs.setdefault(r["algo"], []).append(100 * r["evals"][-1][1])
        return runs, 100 * results[0]["evals"][0][1]

    def cell(values):
        return f"{statistics.mean(values):.1f} +- {statistics.stdev(values):.1f}%"

    stale, start = finals("stale_all")
    algos = list(stale)
    assert sorted(algos) == sorted(NAMES) and all(len(v) == 3 for v in stale.values())
    words = {6: "six", 15: "fifteen", 16: "sixteen", 17: "seventeen"}
    means = {a: statistics.mean(v) for a, v in stale.items()}
    others = {a: m for a, m in means.items() if a != "grpo"}
    low, high = min(others, key=others.get), max(others, key=others.get)
    assert means["grpo"] > means[high]  # "the highest mean of the eighteen"
    span = f"{means[low]:.1f}% ({NAMES[low]}) to {means[high]:.1f}% ({NAMES[high]})"
    below = [a for a in algos[1:] if max(stale[a]) < min(stale["grpo"])]
    under = [a for a in algos if means[a] < start]
    assert [a for a in algos[1:] if a not in below] == ["gdpo"], below  # the prose names GDPO as the one
    rest = [v for a in algos if a not in ("grpo", "gdpo") for v in stale[a]]
    assert min(stale["grpo"] + stale["gdpo"]) > max(rest)  # README: "ahead of the other sixteen, every seed"
    beta = {a: importlib.import_module(a).Args().beta for a in algos}
    assert all(beta[a] == 0 for a in under)  # "all ... among the thirteen without one"
    onpolicy_start = finals("onpolicy_all")[1]
    grpo_beta0, cispo_beta = finals("stale_grpo_beta0")[0]["grpo"], finals("stale_cispo_beta")[0]["cispo"]
    klcov = finals("stale_klcov")[0]["covpo"]
    without_kl = sorted((a for a in algos if not beta[a]), key=means.get, reverse=True)
    assert "ctpo" in without_kl[:3]  # ctpo.md: "one of the three ahead" of the estimators without a KL term
    # "SNIB, RLOO and REINFORCE++, with a KL term, end under MaxRL, P3O and CTPO, without one"
    assert set(without_kl[:3]) == {"maxrl", "p3o", "ctpo"}
    assert {"snib", "rloo", "reinforcepp"} <= {a for a in beta if beta[a]}
    assert max(means[a] for a in ("snib", "rloo", "reinforcepp")) < min(means[a] for a in without_kl[:3])
    ahead = [a for a in without_kl[:3] if a != "ctpo"]
    # "each with every seed beyond every seed of its default"; "with GRPO's KL term CISPO still ends under GRPO"
    assert max(grpo_beta0) < min(stale["grpo"]) and min(cispo_beta) > max(stale["cispo"])
    assert max(cispo_beta) < min(stale["grpo"])
    lift = statistics.mean(cispo_beta) - statistics.mean(stale["cispo"])
    cost = statistics.mean(stale["grpo"]) - statistics.mean(grpo_beta0)
    assert 10 <= cost <= 20 and 10 <= lift <= 20  # covpo.md: "moved GRPO and CISPO by 10-20 points"
    snib = ", ".join(f"{v:.1f}" for v in stale["snib"])
    quoted = [
        ("toy.md", f"its warm start is {start:.1f}% held out, the on-policy runs' {onpolicy_start:.1f}%."),
        ("toy.md", f"GRPO ends at {cell(stale['grpo'])}, the highest mean of the eighteen; the others' span {span}. "
                   f"Every seed of {words[len(below)]} of the other seventeen ends under every GRPO seed"),
        ("toy.md", f"keeps GRPO's KL term ({cell(stale['gdpo'])}, p = "
                   f"{permutation_p(stale['gdpo'], stale['grpo']):.1f})."),
        ("toy.md", f"**{words[len(under)].capitalize()} ended under their warm start**: "
                   f"{', '.join(f'{NAMES[a]} {means[a]:.1f}%' for a in under)}."),
        ("toy.md", f"GRPO without its KL term (`--beta 0`) ends at {cell(grpo_beta0)}, CISPO with GRPO's (`--beta "
                   f"0.04`) at {cell(cispo_beta)} (at its default, {cell(stale['cispo'])})"),
        ("toy.md", f"In the study above no SNIB seed collapsed ({snib}%)"),
        ("estimators/index.md", f"GRPO ends at {cell(stale['grpo'])}, the highest mean; the others' span {span}, "
                                f"and every seed of {words[len(below)]} of the other seventeen ends under every GRPO "
                                f"seed"),
        ("estimators/covpo.md", f"Clip-Cov {cell(stale['covpo'])}, KL-Cov {cell(klcov)}, against GRPO's "
                                f"{cell(stale['grpo'])}"),
        ("estimators/choosing.md", f"GRPO {cell(stale['grpo'])}, GDPO {cell(stale['gdpo'])}"),
        ("estimators/choosing.md", f"GRPO without its KL term falls from {cell(stale['grpo'])} to {cell(grpo_beta0)}, "
                                   f"CISPO with GRPO's rises from {cell(stale['cispo'])} to {cell(cispo_beta)}"),
        ("estimators/choosing.md", f"a KL term lifted CISPO by about {lift:.0f} points and its absence cost GRPO "
                                   f"{cost:.0f}."),
        ("estimators/choosing.md", f"KL-Cov {cell(klcov)}"),
        ("estimators/index.md", f"GRPO without its KL term falls to {cell(grpo_beta0)}, CISPO with GRPO's rises from "
                                f"{cell(stale['cispo'])} to {cell(cispo_beta)}"),
        ("../README.md", f"largely by their KL term (GRPO without it: {statistics.mean(grpo_beta0):.1f}%)"),
        ("estimators/ctpo.md", f"without a KL term it is one of the three ahead, with {NAMES[ahead[0]]} and "
                               f"{NAMES[ahead[1]]}"),
        ("../README.md", f"GRPO ({means['grpo']:.1f}%) and GDPO ({means['gdpo']:.1f}%) ahead of the other sixteen"),
    ]
    for page, phrase in quoted:
        assert phrase in " ".join(read(os.path.join(DOCS, page)).split()), (page, phrase)


def test_the_h200_figures_are_their_measurement():
    """Issue 50: the third GPU run's tables (docs/gpu.md) and the ratios that performance.md and the README quote are
    rebuilt here from the step_time.py and update_mfu.py files the run wrote (docs/benchmarks/gpu_h200_2026-11-28)."""
    folder = os.path.join(DOCS, "benchmarks", "gpu_h200_2026-11-28")

    def load(name):
        with open(os.path.join(folder, name)) as f:
            return json.load(f)

    def row(label, m, step_digits):
        return (f"| {label} | {m['time/step']:.{step_digits}f} | {m['time/rollout']:.{step_digits}f} | "
                f"{m['time/logprobs']:.{step_digits}f} | {m['time/update']:.{step_digits}f} | "
                f"{m['time/tokens_per_s']:,.0f} | {m['memory/peak_gib']:.{1 if step_digits == 2 else 2}f} |")

    gpu = read(os.path.join(DOCS, "gpu.md"))
    flat = " ".join(gpu.split())
    small = load("step_time_0.6b.json")
    assert small["settings"]["no_cudnn_sdp"] and "runs/qwen3_0.6b" in small["settings"]["extra"]
    grpo, trl = small["runs"]["grpo"]["summary"], small["runs"]["trl"]["summary"]
    assert row("grpo.py", grpo, 2) in gpu, row("grpo.py", grpo, 2)
    assert row("TRL 1.16 GRPOTrainer", trl, 2) in gpu
    ratio = small["ratios"]["grpo/trl time/step"]
    assert f"**{ratio:.2f}x TRL's step**" in flat
    assert f"the rollout is {grpo['time/rollout'] / trl['time/rollout']:.2f}x TRL's" in flat
    assert f"and {ratio:.2f}x TRL's on one H200 (Qwen3-0.6B" in " ".join(read(os.path.join(REPO, "README.md")).split())
    performance = " ".join(read(os.path.join(DOCS, "performance.md")).split())
    assert (f"took {grpo['time/step']:.1f} s against TRL's {trl['time/step']:.1f} s ({ratio:.2f}x)") in performance
    share, noshare = load("step_time_share_r2.json"), load("step_time_noshare_r2.json")
    assert share["settings"]["repeat"] == noshare["settings"]["repeat"] == 2
    assert "--share_prompts" not in share["settings"]["extra"] and "--share_prompts" in noshare["settings"]["extra"]
    for label, run in [("grpo.py (shared prompts, the default)", share["runs"]["grpo"]),
                       ("grpo.py `--share_prompts false`", noshare["runs"]["grpo"])]:
        m = run["summary"]
        assert (f"| {label} | {m['time/step']:.3f} | {m['time/rollout']:.3f} | {m['time/logprobs']:.3f} | "
                f"{m['time/update']:.3f} | {m['time/tokens_per_s']:,.0f} | {m['memory/peak_gib']:.2f} |") in gpu, label
    r_share, r_noshare = share["ratios"]["grpo/trl time/step"], noshare["ratios"]["grpo/trl time/step"]
    assert f"**{r_share:.2f}x TRL's step with shared prompts, {r_noshare:.2f}x without**" in flat
    assert f"are level ({r_share:.2f}x TRL's step, median of two runs" in performance
    for name, chunk in [("update_mfu_0.6b_r0_16384.json", "2^24"),
                        ("update_mfu_0.6b_r0_16384_chunk268435456.json", "2^28")]:
        u = load(name)
        assert u["device_name"] == "NVIDIA H200" and u["tokens"] == 16384
        assert (f"{u['seconds_per_step']:.3f} s" in flat and f"{u['tokens_per_s']:,.0f} tokens/s, MFU "
                f"{100 * u['mfu']:.1f}%, peak {u['peak_memory_gib']:.1f} GiB" in flat), chunk


def test_the_real_model_off_policy_prose_is_its_study():
    """Issue 53: the thirteen off-policy on SmolLM2 (docs/studies/offpolicy13.json, three seeds each) and GRPO
    on-policy beside them (onpolicy_ref.json). The table is a study-vs block; the sentences and the claims' rows that
    sum it up on real-model.md, choosing.md and the README are rebuilt here from the runs: the regime's distance from
    on-policy, GRPO's spread and what three seeds can detect with it, the separations, the seed-for-seed pairs,
    SNIB's collapse, and each claim's figures."""
    import statistics

    from evals.stats import permutation_p, shift_for_chance

    def load(tag):
        with open(os.path.join(DOCS, "studies", f"{tag}.json")) as f:
            runs = {}
            for r in sorted(json.load(f)["results"], key=lambda r: r["seed"]):
                runs.setdefault(r["algo"], []).append(r)
        return runs

    runs, on_runs = load("offpolicy13"), load("onpolicy_ref")["grpo"]
    thirteen = "grpo gspo snib ctpo p3o cispo gmpo sapo rloo dppo reinforcepp maxrl covpo".split()
    assert sorted(runs) == sorted(thirteen) and all(len(v) == 3 for v in runs.values())
    final = {a: [100 * r["evals"][-1][1] for r in rs] for a, rs in runs.items()}
    grpo, on = final["grpo"], [100 * r["evals"][-1][1] for r in on_runs]

    def cell(values):
        return f"{statistics.mean(values):.1f} +- {statistics.stdev(values):.1f}%"

    def listing(values, digits=1, unit=""):
        return ", ".join(f"{x:.{digits}f}{unit}" for x in values[:-1]) + f" and {values[-1]:.{digits}f}{unit}"

    def mean_of(algo, name):
        return statistics.mean(r["diagnostics"][name] for r in runs[algo])

    def by_seed(algo, name, scale=1.0):
        return [scale * r["diagnostics"][name] for r in runs[algo]]

    def p(a, b="grpo"):
        return f"{permutation_p(final[a], final[b]):.1f}"

    def pairs_above(a, b="grpo"):
        return sum(x > y for x, y in zip(final[a], final[b]))

    ess = [mean_of(a, "policy/ess") for a in runs]
    spread = [mean_of(a, "policy/log_ratio_std") for a in runs]
    means = {a: statistics.mean(v) for a, v in final.items() if a != "grpo"}
    low, high = min(means, key=means.get), max(means, key=means.get)
    beyond = [a for a in means if max(final[a]) < min(grpo) or min(final[a]) > max(grpo)]
    ahead = [NAMES[a] for a in means if pairs_above(a) == 3]
    behind = [NAMES[a] for a in means if pairs_above(a) == 0]
    snib = runs["snib"]
    fell = min(snib, key=lambda r: r["evals"][-1][1])
    rose = [r for r in snib if r is not fell]
    trough = {r["seed"]: min(v for _, v in r["series"]["snib/ess"]) for r in snib}
    under_start = [(a, r["seed"]) for a, rs in runs.items() for r in rs if r["evals"][-1][1] < r["evals"][0][1]]
    assert ("snib", fell["seed"]) in under_start
    snib_steps = [v for r in snib for _, v in r["series"]["policy/clip_frac"]]

    def halves(r):
        values = [v for _, v in r["series"]["policy/clip_frac"]]
        return f"{100 * statistics.mean(values[:5]):.1f} and {100 * statistics.mean(values[5:]):.1f}%"

    grpo_clip, gspo_clip = by_seed("grpo", "policy/clip_frac", 100), by_seed("gspo", "policy/clip_frac", 100)
    ctpo_clip = by_seed("ctpo", "policy/clip_frac", 100)
    assert max(grpo_clip) < min(ctpo_clip) and max(ctpo_clip) < min(gspo_clip)  # CTPO's clip "between": agree
    gmpo_spread, grpo_spread = by_seed("gmpo", "policy/log_ratio_std"), by_seed("grpo", "policy/log_ratio_std")
    assert statistics.mean(gmpo_spread) > statistics.mean(grpo_spread)  # wider on average: "leans against it"
    assert min(gmpo_spread) < max(grpo_spread)  # "though not in every seed": cannot tell
    p3o_start = [round(100 * r["series"]["p3o/capped_frac"][0][1]) for r in runs["p3o"]]
    page = [
        f"the batch ESS was {min(ess):.2f}-{max(ess):.2f} and the standard deviation of the token log-ratios "
        f"{min(spread):.2f}-{max(spread):.2f}, where GRPO's on-policy runs had "
        f"{statistics.mean(r['diagnostics']['policy/ess'] for r in on_runs):.3f} and "
        f"{statistics.mean(r['diagnostics']['policy/log_ratio_std'] for r in on_runs):.3f}",
        f"the clip column runs from CISPO's {100 * mean_of('cispo', 'policy/clip_frac'):.1f}% (the tokens whose weight "
        f"its cap bounded; every token keeps its gradient) to GSPO's {100 * mean_of('gspo', 'policy/clip_frac'):.0f}% "
        f"of completions, and P3O capped "
        f"{100 * mean_of('p3o', 'p3o/capped_frac'):.0f}% of its tokens",
        f"GRPO's own seeds ended at {listing(grpo)}% (a standard deviation of {statistics.stdev(grpo):.1f} points)",
        f"about {shift_for_chance(3, 3, 0.8) * statistics.stdev(grpo):.0f} points here",
        f"The means at step 10 span {means[low]:.1f}% ({NAMES[low]}) to {means[high]:.1f}% ({NAMES[high]}), "
        f"GRPO's {cell(grpo)}",
        "; ".join(f"every seed of {NAMES[a]} ends {'under' if max(final[a]) < min(grpo) else 'above'} every GRPO "
                  f"seed ({cell(final[a])}, p = {p(a)})" for a in beyond) if beyond else
        "no estimator has every seed beyond every GRPO seed",
        f"{', '.join(ahead)} ended above GRPO in all three pairs and {', '.join(behind)} under it in all three",
        f"SNIB's seed {fell['seed']} collapsed: {100 * fell['evals'][1][1]:.1f}% held out at step 5, "
        f"{100 * fell['evals'][2][1]:.1f}% at step 10, its group ESS down to {trough[fell['seed']]:.2f} and its raw "
        f"log-weights' standard deviation up to "
        f"{max(v for _, v in fell['series']['snib/raw_logweight_std']):.1f}; its seeds {rose[0]['seed']} and "
        f"{rose[1]['seed']} went through the same trough (group ESS {trough[rose[0]['seed']]:.2f} and "
        f"{trough[rose[1]['seed']]:.2f} at their lowest) and came out at {100 * rose[0]['evals'][-1][1]:.1f} and "
        f"{100 * rose[1]['evals'][-1][1]:.1f}%. Of the 39 runs, "
        + " and ".join(f"{NAMES[a]}'s seed {seed} ({100 * runs[a][seed - 1]['evals'][-1][1]:.1f}%)"
                       for a, seed in under_start)
        + f" ended under their start ({100 * snib[0]['evals'][0][1]:.1f}% held out)",
        f"GRPO on-policy (the reference, one optimizer step a batch) ended at {cell(on)}, against {cell(grpo)} "
        f"off-policy (p = {permutation_p(on, grpo):.1f})",
        f"| GRPO on-policy {cell(on)}, off-policy {cell(grpo)} (p = {permutation_p(on, grpo):.1f})",
        f"| GSPO {cell(final['gspo'])}, GRPO {cell(grpo)} (p = {p('gspo')}); GSPO above GRPO's same seed in "
        f"all three pairs ({', '.join(f'{x - y:+.1f}' for x, y in zip(final['gspo'], grpo))} points)",
        f"| SNIB's seeds ended at {listing(final['snib'])}%, GSPO's at {listing(final['gspo'])}%",
        f"| its 0.2 clip changed {listing(by_seed('snib', 'policy/clip_frac', 100), unit='%')} of the completions' "
        f"weights by seed (means over steps); {sum(v < 0.05 for v in snib_steps)} of its {len(snib_steps)} steps "
        f"clipped under 5% | disagree |",
        f"| CTPO clipped {listing(ctpo_clip, unit='%')} of tokens by seed, between GRPO's "
        f"{min(grpo_clip):.1f}-{max(grpo_clip):.1f}% and GSPO's {min(gspo_clip):.1f}-{max(gspo_clip):.1f}% of "
        f"completions; its first five steps' mean against its last five: "
        f"{', '.join(halves(r) for r in runs['ctpo'])} | agree |",
        f"| CTPO {cell(final['ctpo'])}: under GRPO's same seed in {3 - pairs_above('ctpo')} of 3 pairs (p = "
        f"{p('ctpo')} against GRPO) and every seed under every GSPO seed ({cell(final['gspo'])}, p = "
        f"{p('ctpo', 'gspo')})",
        f"| its capped share rose from {p3o_start[0]}%, {p3o_start[1]}% and {p3o_start[2]}% of tokens at step 1 to "
        f"{listing(by_seed('p3o', 'p3o/capped_frac', 100), unit='%')} on average over the steps",
        f"but P3O ended at {cell(final['p3o'])}",
        f"| CISPO {cell(final['cispo'])} against GRPO's {cell(grpo)} (p = {p('cispo')}), above GRPO's same seed in "
        f"{pairs_above('cispo')} of 3 | cannot tell |",
        f"GMPO {listing(gmpo_spread, 3)} by seed, GRPO {listing(grpo_spread, 3)}: wider under GMPO on average "
        f"({statistics.mean(gmpo_spread):.3f} against {statistics.mean(grpo_spread):.3f}), though not in every seed | "
        f"cannot tell; leans against it |",
        f"| SAPO {cell(final['sapo'])} against GRPO's {cell(grpo)} (p = {p('sapo')}) and GSPO's "
        f"{cell(final['gspo'])} (p = {p('sapo', 'gspo')})",
        f"| DPPO {cell(final['dppo'])} against GRPO's {cell(grpo)} (p = {p('dppo')})",
    ]
    assert max(final["ctpo"]) < min(final["gspo"]) and pairs_above("gspo") == 3  # the two rows' "every"/"all"
    assert beyond == ["p3o"] and max(final["p3o"]) < min(grpo)  # choosing.md and the README name P3O alone
    half = {a: [100 * r["evals"][1][1] for r in rs] for a, rs in runs.items()}
    assert runs["grpo"][0]["evals"][1][0] == 5
    apart = [a for a in half if a != "grpo" and permutation_p(half[a], half["grpo"]) < 0.11]
    assert apart == ["gspo"] and min(half["gspo"]) > max(half["grpo"])
    p_half = f"p = {permutation_p(half['gspo'], half['grpo']):.1f})"
    flat = " ".join(read(os.path.join(DOCS, "real-model.md")).split())
    assert (f"At step 5, halfway, GSPO was the one so separated, above ({cell(half['gspo'])} against GRPO's "
            f"{cell(half['grpo'])}, {p_half}") in flat
    assert (f"at step 5 every GSPO seed above every GRPO seed ({cell(half['gspo'])} against {cell(half['grpo'])}, "
            f"{p_half}") in flat
    detect = f"{shift_for_chance(3, 3, 0.8) * statistics.stdev(grpo):.0f}"
    words = {11: "eleven"}
    elsewhere = [
        ("estimators/choosing.md", f"GRPO's seeds ended at {listing(grpo)}% held out, so three seeds a side separate "
                                   f"only differences of about {detect} points. P3O's did: every seed under every GRPO "
                                   f"seed ({cell(final['p3o'])} against {cell(grpo)}, p = {p('p3o')})"),
        ("estimators/choosing.md", f"SNIB collapsed in one seed of three ({100 * fell['evals'][-1][1]:.1f}% held out "
                                   f"at step 10;"),
        ("estimators/choosing.md", f"The other {words[len(means) - 1]} ended within the seeds' spread; seed for seed "
                                   f"(the seeds share their prompts), GSPO ended above GRPO in all three pairs"),
        ("estimators/choosing.md", f"GRPO's own seeds spread by {max(grpo) - min(grpo):.0f} points there"),
    ]
    minutes = [statistics.mean(r["minutes"][-1] for r in rs) for rs in runs.values()]
    elsewhere.append(("estimators/choosing.md", f"training minutes ({min(minutes):.1f}-{max(minutes):.1f} a run, means "
                                                f"over seeds,"))
    assert sum(r["evals"][-1][1] < 0.1 for r in snib) == 1  # "collapsed in one seed of three"
    for page, phrase in elsewhere:
        assert phrase in " ".join(read(os.path.join(DOCS, page)).split()), (page, phrase)
    # two more seeds of GRPO and GSPO (offpolicy13_more.json: seeds 1-3 are the study's own runs)
    from evals.stats import paired_p

    more = load("offpolicy13_more")
    assert [r["evals"] for r in more["gspo"][:3]] == [r["evals"] for r in runs["gspo"]]
    at = {(a, k): [100 * r["evals"][k][1] for r in more[a]] for a in ("grpo", "gspo") for k in (1, 2)}
    gap = [x - y for x, y in zip(at["gspo", 2], at["grpo", 2])]
    gap5 = [x - y for x, y in zip(at["gspo", 1], at["grpo", 1])]
    p10 = permutation_p(at["gspo", 2], at["grpo", 2])
    sentence = (f"With five seeds a side GSPO ended at {cell(at['gspo', 2])} against GRPO's {cell(at['grpo', 2])} "
                f"(p = {p10:.2f}; the floor for five a side is 0.008), above GRPO's same seed in "
                f"{sum(x > 0 for x in gap)} of 5 pairs ({', '.join(f'{x:+.1f}' for x in gap)} points; the sign-flip "
                f"test over the pairs, `evals/stats.py` `paired_p`: p = {paired_p(gap):.3f}, its floor for five "
                f"pairs); at step 5, {cell(at['gspo', 1])} against {cell(at['grpo', 1])} (p = "
                f"{permutation_p(at['gspo', 1], at['grpo', 1]):.2f}; above in {sum(x > 0 for x in gap5)} of 5 pairs). "
                f"GSPO learned faster than GRPO here, and ended ahead in every pair, a difference five seeds show only "
                f"at p = {paired_p(gap):.2f} paired and {p10:.2f} unpaired.")
    assert min(gap) > 0 and sentence in flat, sentence
    assert f"above GRPO's same seed in 5 of 5 pairs (paired p = {paired_p(gap):.2f}) | cannot tell at step 10" in flat
    text = " ".join(read(os.path.join(DOCS, "real-model.md")).split())
    for phrase in page:
        assert phrase in text, phrase


def test_the_studys_verdicts_are_quoted_as_its_files_give_them():
    """Issue 67: the figures README.md, choosing.md, real-model.md, the study's page and SDPO's page quote from the
    planned study are its files' (docs/studies/study67*.json, sdpo_smollm2/), recomputed here by evals.plan."""
    from evals import plan

    runs = plan.read_runs(os.path.join(REPO, "docs", "studies"))
    rows = {row["claim"].effect: row for row in plan.verdicts(runs)}
    assert all(len(row["seeds"]) == plan.SEEDS for row in rows.values())

    def mean(effect):
        return f"{abs(rows[effect]['summary'].mean):.1f}"

    def interval(effect):
        summary = rows[effect]["summary"]
        return f"[{summary.low:+.1f}, {summary.high:+.1f}]"

    verdict = {effect: row["verdict"] for effect, row in rows.items()}
    assert verdict == {"snib - gspo, accuracy": "disagree", "snib clip share": "disagree",
                       "ctpo - gspo, accuracy": "cannot tell", "ctpo - grpo, accuracy": "cannot tell",
                       "ctpo clip share inside grpo's..gspo's": "agree",
                       "ctpo clip share, steps 6-10 minus 1-5": "cannot tell",
                       "p3o - grpo, accuracy": "disagree", "p3o capped share, stale minus fresh": "agree",
                       "grpo on-policy - off-policy, accuracy": "cannot tell"}
    arm = {name: f"{statistics.mean(plan.accuracy(r) for r in by_seed.values()):.1f}" for name, by_seed in runs.items()}
    snib, p3o = "snib - gspo, accuracy", "p3o - grpo, accuracy"
    sdpo = plan.read_runs(os.path.join(REPO, "docs", "studies"), plan.SDPO_ARMS)
    sdpo_gap = statistics.mean(plan.accuracy(sdpo["sdpo"][s]) - plan.accuracy(sdpo["grpo_on"][s]) for s in sdpo["sdpo"])
    quoted = {
        "../README.md": [f"collapsed, {mean(snib)} points under GSPO", f"clipped {mean('snib clip share')}% of its",
                         f"it ended {mean(p3o)} points under GRPO", f"{abs(sdpo_gap):.1f} points under GRPO on-policy"],
        "estimators/choosing.md": [f"{mean(snib)} points under GSPO on average", f"P3O ended {mean(p3o)} points under",
                                   f"ended at {arm['grpo']}, {arm['gspo']}, {arm['ctpo']} and {arm['grpo_on']}%",
                                   f"-{mean('ctpo - gspo, accuracy')} points, 95% interval "
                                   f"{interval('ctpo - gspo, accuracy')}"],
        "real-model.md": [f"P3O ended {mean(p3o)} points under GRPO"],
        "study-plan.md": [f"{mean(snib)} points under GSPO on average (95% interval {interval(snib)})",
                          f"{mean(p3o)} points under GRPO's ({interval(p3o)})"],
        "estimators/sdpo.md": [f"by {abs(sdpo_gap):.1f} points on average"],
    }
    # SNIB's pilot of the stop-gradient KL (estimators/snib.md), as its prose reads it: every seed above the study's
    # SNIB run of its seed, three of four under the untrained model, the KL past 4 nats in seeds 3 and 4 only
    pilot = plan.read_runs(os.path.join(REPO, "docs", "studies"), plan.SNIB_SG_ARMS)
    assert sorted(pilot["sg"]) == [1, 2, 3, 4]
    assert all(plan.accuracy(pilot["sg"][s]) > plan.accuracy(pilot["snib"][s]) for s in pilot["sg"])
    assert [s for s in sorted(pilot["sg"]) if plan.accuracy(pilot["sg"][s]) < plan.UNTRAINED] == [2, 3, 4]
    assert [s for s in sorted(pilot["sg"]) if max(v for _, v in pilot["sg"][s]["series"]["policy/kl"]) > 4] == [3, 4]
    quoted["estimators/snib.md"] = ["Every seed ended higher with the stop-gradient form", "three of the four still "
                                    "ended under the untrained model", "(seeds 3 and 4) the KL to the reference still "
                                    "ran past 4 nats"]
    quoted["estimators/choosing.md"].append("every seed ended above the paper's form of the same seed, yet three of "
                                            "four still ended under the untrained model")
    for page, phrases in quoted.items():
        flat = " ".join(read(os.path.join(DOCS, page)).split())
        for phrase in phrases:
            assert phrase in flat, (page, phrase)
