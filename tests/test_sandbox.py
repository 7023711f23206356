"""common/engines/sandbox.py: ordinary runs, and hostile code that must come back as a ToolResult in bounded time,
leaving no process behind and the test process alive.

Where no sandbox can start (bubblewrap missing) the whole module is skipped, the reason naming the fix; CI sets
REQUIRE_SANDBOX=1, so there they run and fail instead (tests/conftest.py).
"""

import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.engines.sandbox import ToolResult, isolation, run_python

pytestmark = pytest.mark.sandbox

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLACK_S = 3.0  # start-up, kill and teardown on a loaded 2-core machine


def sandbox_processes(marker: str) -> list[int]:
    """Host pids of live processes whose command line holds `marker`."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read() and int(pid) != os.getpid():
                    pids.append(int(pid))
        except OSError:  # exited meanwhile
            pass
    return pids


def hostile(code: str, **limits) -> tuple[ToolResult, list[int]]:
    """Run `code` re-executed with a unique marker in its argv (children inherit it), so that the processes it
    leaves can be found; checks the bounded wall time and returns (result, the marked processes left)."""
    marker = f"sandbox-test-{uuid.uuid4().hex}"
    prologue = ("import os, sys\nif len(sys.argv) < 2:\n"
                f"    os.execv(sys.executable, [sys.executable, '-I', '-S', '-u', sys.argv[0], {marker!r}])\n")
    start = time.monotonic()
    result = run_python(prologue + code, **limits)
    wall = time.monotonic() - start
    assert isinstance(result, ToolResult)
    assert wall < limits.get("timeout_s", 5.0) + SLACK_S, f"took {wall:.1f} s"
    return result, sandbox_processes(marker)


def test_isolation_is_available_and_named():
    assert "bubblewrap" in isolation()  # raises SandboxUnavailable with the fix when it is not


# --- ordinary runs -------------------------------------------------------------------------------------------


def test_prints_result():
    result = run_python("print(1 + 2)")
    assert (result.output, result.error) == ("3\n", None)
    assert 0 < result.seconds < SLACK_S


def test_exception_gives_traceback_and_exit_code():
    result = run_python("x = 1\nprint('before')\nx / 0")
    assert result.error == "exit 1"
    assert result.output.startswith("before\nTraceback")  # stdout and stderr in the order written
    assert "ZeroDivisionError: division by zero" in result.output and "x / 0" in result.output


def test_fresh_directory_each_call():
    first = run_python("open('note.txt', 'w').write('hi'); import os; print(sorted(os.listdir('.')))")
    assert first.error is None and "note.txt" in first.output
    second = run_python("import os; print(os.path.exists('note.txt'), os.getcwd())")
    assert second.output == "False /sandbox\n"


def test_concurrent_calls_are_independent():
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: run_python(f"import time; time.sleep(0.2); print({i} * {i})"), range(8)))
    assert [(r.output, r.error) for r in results] == [(f"{i * i}\n", None) for i in range(8)]


def test_odd_code_never_raises():
    assert run_python("print('\udc80')").error is None  # a lone surrogate, replaced
    assert run_python("a\0b").error == "exit 1"  # SyntaxError: null bytes
    assert run_python("x = 1\n" * 200_000 + "print(x)").output == "1\n"  # 1.2 MB of source


# --- hostile code --------------------------------------------------------------------------------------------


def test_infinite_loop_times_out_and_leaves_nothing():
    marked = []  # a control: while it runs, its processes are found by their marker
    probe = threading.Timer(1.0, lambda: marked.extend(sandbox_processes("sandbox-test-")))
    probe.start()
    result, left = hostile("while True: pass", timeout_s=2)
    probe.join()
    assert result.error == "timeout" and "[timed out after 2 s]" in result.output
    assert result.seconds >= 2 and marked and not left


def test_fork_bomb_is_capped_and_leaves_nothing():
    code = ("import time\nwhile True:\n"
            "    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n")
    counts = []
    probe = threading.Timer(1.0, lambda: counts.append(len(sandbox_processes("sandbox-test-"))))
    probe.start()
    result, left = hostile(code, timeout_s=2, max_processes=8)
    probe.join()
    assert result.error == "timeout" and not left
    assert 1 < counts[0] < 8  # RLIMIT_NPROC binds (bwrap's init is the 8th process)


def test_uncaught_fork_bomb_returns_quickly():
    result, left = hostile("while True:\n    os.fork()\n", timeout_s=5, max_processes=8)
    assert result.error == "exit 1" and "BlockingIOError" in result.output and not left
    assert result.seconds < 2.0  # ended by the process limit, not by the clock


def test_memory_hog_gets_memory_error():
    result, left = hostile("x = bytearray(4 << 30)\nprint('allocated')", memory_mb=512)
    assert result.error == "memory" and "allocated" not in result.output and not left
    assert result.output.endswith("MemoryError\n[out of memory: the limit is 512 MB]")


def test_huge_output_is_cut_at_the_cap():
    code = "chunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\n"
    result, left = hostile(code, max_output_bytes=8192)
    assert result.error == "output_limit" and not left
    assert result.output == "x" * 8192 + "\n[output truncated at 8192 bytes]"


def test_cannot_read_etc_passwd():
    assert os.path.exists("/etc/passwd")
    result, left = hostile("print(open('/etc/passwd').read())")
    assert result.error == "exit 1" and "FileNotFoundError" in result.output and "root:" not in result.output
    assert not left


def test_cannot_read_project_files():
    readme = os.path.join(REPO, "README.md")
    result, left = hostile(f"print(open({readme!r}).read()[:100])\n")
    assert result.error == "exit 1" and "FileNotFoundError" in result.output and not left
    listing = run_python(f"import os; print(os.path.exists({REPO!r}), os.listdir('/'))")
    assert listing.output.startswith("False [") and "'work'" not in listing.output and "'etc'" not in listing.output


def test_cannot_write_outside_its_directory():
    name = f"sandbox-test-{uuid.uuid4().hex}"
    targets = [f"/tmp/{name}", os.path.join(REPO, name), os.path.join(os.path.expanduser("~"), name), f"/{name}",
               f"/usr/{name}", f"/dev/{name}", os.path.join(os.path.dirname(os.__file__), name)]  # + the interpreter's
    code = ("for path in %r:\n"
            "    try:\n        open(path, 'w').write('x'); print('WROTE', path)\n"
            "    except OSError as e:\n        print('refused', path, type(e).__name__)\n") % targets
    result, left = hostile(code)
    assert result.error is None and "WROTE" not in result.output and result.output.count("refused") == len(targets)
    assert not any(os.path.exists(t) for t in targets) and not left


def test_no_network():
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    code = ("import socket\nfor address in [('127.0.0.1', %d), ('1.1.1.1', 53)]:\n"
            "    try:\n        socket.create_connection(address, timeout=1); print('CONNECTED', address)\n"
            "    except OSError as e:\n        print('refused', address, type(e).__name__)\n"
            "socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', %d))\n") % (port, port)
    with listener:
        result, left = hostile(code)
        try:
            listener.accept()
            raise AssertionError("the sandbox reached the test's listener")
        except TimeoutError:
            pass
    assert "CONNECTED" not in result.output and result.output.count("refused") == 2 and not left


def test_cannot_kill_its_parent_or_the_test():
    for kill in ["os.kill(os.getppid(), 9)", "os.killpg(os.getpgid(os.getppid()), 9)", "os.kill(-1, 9)",
                 f"os.kill({os.getpid()}, 9)", f"os.kill({os.getppid()}, 9)", "os.killpg(0, 9)"]:
        result, left = hostile(f"try:\n    {kill}\nexcept OSError as e:\n    print(type(e).__name__)\n")
        assert not left, kill
        assert result.error in (None, "signal SIGKILL"), (kill, result)  # killpg(0) kills the code itself
    assert run_python("print('still here')").output == "still here\n"  # and so is this process


def test_sandbox_failure_is_reported_not_raised(monkeypatch):
    import common.engines.sandbox as sandbox

    isolation()  # checked before the set-up is broken
    command = sandbox._command

    def broken(*args):  # bwrap is asked to bind a folder that does not exist
        argv = command(*args)
        at = argv.index("bwrap") + 1
        return argv[:at] + ["--ro-bind", "/no/such/dir", "/x"] + argv[at:]

    monkeypatch.setattr(sandbox, "_command", broken)
    result = run_python("print(1)")
    assert result.error == "sandbox" and "/no/such/dir" in result.output
    monkeypatch.undo()
    assert run_python("print('bwrap: fake'); raise SystemExit(1)").error == "exit 1"  # the code cannot pose as one
