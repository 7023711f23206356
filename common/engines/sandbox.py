"""A sandbox for model-written Python: the tool calls of multi-turn, tool-integrated rollouts.

    result = run_python("print(1 + 2)")     # ToolResult(output="3\\n", error=None, seconds=0.02)

``run_python`` never raises for anything the code does: a timeout, a fork bomb, a memory hog, 100 MB
of output, a crash or an escape attempt each come back as a ``ToolResult`` whose ``error`` names the
kind. It raises ``SandboxUnavailable`` only when no sandbox can be started here at all, naming the
fix.

Layers, outermost first (README, "The code sandbox", says what each does not protect against):

1. bubblewrap (``bwrap``): new user, pid, network, IPC, UTS and cgroup namespaces. The root it
   builds holds /usr and the interpreter's prefix read-only, a /proc of the new pid namespace, a
   minimal read-only /dev, and two tmpfs, the only writable places: the working directory /sandbox
   (``memory_mb``, fresh each call) and /dev/shm (``SHM_MB``); no /etc, no home, no project files,
   no environment variables. The interpreter runs isolated (``-I -S``): standard library only.
2. Host uid 65534 (nobody) when we are root: the kernel never applies RLIMIT_NPROC to host uid 0,
   even inside a user namespace, so a fork bomb run as root would not stop at ``max_processes``.
3. rlimits (``prlimit``, inside the sandbox): CPU seconds, address space, processes (threads
   count), file size, open files, no core dumps.
4. This process: a wall-clock deadline and a hard cap on the bytes read; either one kills bwrap, and
   with it the sandbox's pid namespace and every process in it.
"""

import functools
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

NOBODY = 65534
INSTALL_HINT = "install bubblewrap: apt-get install -y bubblewrap"
SHM_MB = 64  # /dev/shm, for multiprocessing's locks and queues
# util-linux, mount, bash: always on Debian
_SETUP_TOOLS = ("unshare", "mount", "setpriv", "prlimit", "bash")


class SandboxUnavailable(RuntimeError):
    """No sandbox can be started on this machine (bubblewrap missing, or user namespaces
    disabled)."""


@dataclass
class ToolResult:
    # what the model sees as the tool turn: stdout and stderr interleaved (capped), a note on error
    output: str
    # None, "timeout", "memory", "output_limit", "exit <code>", "signal <name>" or "sandbox"
    error: str | None
    seconds: float


def _command(code_fd: int, started_fd: int, timeout_s: float, memory_mb: int,
             max_processes: int) -> list[str]:
    """The command line that runs /sandbox/main.py (copied from `code_fd`) under every layer."""
    prefix = sys.base_prefix  # the base interpreter, not a virtual environment's site-packages
    python = os.path.join(prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    as_root = os.geteuid() == 0
    cpu_s = math.ceil(timeout_s) + 1  # CPU over wall time only with several threads
    size = memory_mb << 20
    bwrap = [
        "bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
        "--new-session",
        "--uid", str(NOBODY), "--gid", str(NOBODY),
        "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64",
        "--symlink", "usr/bin", "/bin", "--ro-bind", "/mnt" if as_root else prefix, prefix,
        "--proc", "/proc", "--dev", "/dev", "--size", str(size), "--tmpfs", "/sandbox",
        "--size", str(SHM_MB << 20), "--tmpfs", "/dev/shm",
        "--file", str(code_fd), "/sandbox/main.py", "--chdir", "/sandbox", "--clearenv",
        "--setenv", "PATH", "/usr/bin", "--setenv", "LANG", "C.UTF-8",
        "--setenv", "HOME", "/sandbox", "--setenv", "TMPDIR", "/sandbox",
        "--remount-ro", "/", "--remount-ro", "/dev",  # writable: the two tmpfs
        "prlimit", f"--cpu={cpu_s}", f"--as={size}", f"--nproc={max_processes}", f"--fsize={size}",
        "--nofile=128", "--core=0", "--",
        # Then say "started" on `started_fd`, close it, and run the code (dash takes fds < 10 only,
        # so bash); -u: stdout and stderr reach the pipe in the order written.
        "bash", "-c", f'printf 1 >&{started_fd} && exec {started_fd}>&- && exec "$0" "$@"',
        python, "-I", "-S", "-u", "main.py"]
    if not as_root:
        return bwrap
    # Drop to uid 65534 before bwrap. That uid cannot reach an interpreter under /root (mode 700),
    # so bind the prefix to /mnt first, in a private mount namespace (the host's /mnt is untouched),
    # for bwrap to bind back.
    drop = ('mount --bind "$0" /mnt && exec setpriv --reuid={0} --regid={0} --clear-groups "$@"'
            .format(NOBODY))
    return ["unshare", "--mount", "sh", "-c", drop, prefix, *bwrap]


def _collect(proc: subprocess.Popen, deadline: float, limit: int) -> tuple[bytes, str | None]:
    """The output, read until EOF and exit, or until the deadline or `limit` bytes ("timeout",
    "output_limit")."""
    out = bytearray()
    # poll, not select: a trainer's process may hold over 1024 fds
    poller = select.poll()
    poller.register(proc.stdout, select.POLLIN)
    while len(out) <= limit:
        left = deadline - time.monotonic()
        if left <= 0:
            return bytes(out), "timeout"
        if poller.poll(left * 1000):
            # never more than limit + 1 in all
            chunk = os.read(proc.stdout.fileno(), limit + 1 - len(out))
            if not chunk:
                break  # EOF: every process in the sandbox has exited or closed its stdout
            out += chunk
    else:
        return bytes(out[:limit]), "output_limit"
    try:
        proc.wait(max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        return bytes(out), "timeout"
    return bytes(out), None


def _drain(stdout, seconds: float = 2.0) -> None:
    """Read to EOF, discarding: the pid namespace dies after bwrap does, and EOF means its processes
    are gone."""
    deadline = time.monotonic() + seconds
    poller = select.poll()
    poller.register(stdout, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            return
        if not os.read(stdout.fileno(), 1 << 16):
            return


def _started(started_fd: int) -> bool:
    """Whether the sandbox was set up and the code started (the code itself cannot fake a failed
    set-up)."""
    os.set_blocking(started_fd, False)  # bwrap's init may still hold the write end
    try:
        return os.read(started_fd, 1) == b"1"
    except OSError:
        return False


def _kind(returncode: int, out: bytes) -> str:
    """The error kind of a run that exited with `returncode` (bwrap passes 128 + N for a child
    killed by N)."""
    if returncode > 128 and returncode - 128 in signal.valid_signals():
        name = signal.Signals(returncode - 128).name
        # SIGXCPU: the CPU-seconds rlimit
        return "timeout" if name == "SIGXCPU" else f"signal {name}"
    last = out.rstrip().rsplit(b"\n", 1)[-1]
    return "memory" if last.startswith(b"MemoryError") else f"exit {returncode}"


_NOTES = {"timeout": "[timed out after {t:g} s]", "output_limit": "[output truncated at {n} bytes]",
          "memory": "[out of memory: the limit is {m} MB]"}


def _run(code: str, timeout_s: float, memory_mb: int, max_output_bytes: int,
         max_processes: int) -> ToolResult:
    start = time.monotonic()
    proc = None
    started_r, started_w = os.pipe()
    try:
        with tempfile.TemporaryFile() as source:
            # "replace": a lone surrogate must not raise
            source.write(code.encode("utf-8", "replace"))
            source.flush()
            source.seek(0)  # bwrap copies from the current offset
            argv = _command(source.fileno(), started_w, timeout_s, memory_mb, max_processes)
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, pass_fds=(source.fileno(), started_w),
                                    # its own group, to kill the setup chain too
                                    start_new_session=True)
        os.close(started_w)
        started_w = None
        out, error = _collect(proc, start + timeout_s, max_output_bytes)
        if error is None and proc.returncode != 0:
            error = _kind(proc.returncode, out) if _started(started_r) else "sandbox"
    except OSError as e:
        # no fork, no fds, no space for the code: the sandbox's fault, not the code's
        out = f"sandbox failed to start: {e}".encode()
        error = "sandbox"
    finally:
        if proc is not None:
            if proc.returncode is None:  # not reaped, so the group id cannot have been reused
                # bwrap's --die-with-parent takes the pid namespace along
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            _drain(proc.stdout)
            proc.stdout.close()
        os.close(started_r)
        if started_w is not None:
            os.close(started_w)
    text = out.decode("utf-8", "replace")
    if error in _NOTES:
        text += ("\n" if text and not text.endswith("\n") else "") + _NOTES[error].format(
            t=timeout_s, n=max_output_bytes, m=memory_mb)
    return ToolResult(output=text, error=error, seconds=time.monotonic() - start)


@functools.cache  # successes only: a failure raises, and is checked again on the next call
def isolation() -> str:
    """The isolation ``run_python`` uses, in words; raises ``SandboxUnavailable`` naming the fix if
    there is none."""
    missing = [tool for tool in ("bwrap", *_SETUP_TOOLS) if shutil.which(tool) is None]
    if missing:
        raise SandboxUnavailable(f"the code sandbox needs {', '.join(missing)}: {INSTALL_HINT} "
                                 "(the others come with util-linux, mount and bash)")
    probe = _run("print('ok')", timeout_s=30, memory_mb=256, max_output_bytes=4096,
                 max_processes=16)
    if probe.output != "ok\n":
        raise SandboxUnavailable(f"bubblewrap cannot start a sandbox here ({probe.error}): "
                                 f"{probe.output.strip()}\n"
                                 "If user namespaces are off: sysctl "
                                 "kernel.unprivileged_userns_clone=1 (older Debian), or "
                                 "kernel.apparmor_restrict_unprivileged_userns=0 (Ubuntu 24.04)")
    version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
    readable = " and ".join(sorted({"/usr", sys.base_prefix}))
    return (f"{version}: new user, pid, network, IPC and UTS namespaces; {readable} read-only; "
            f"host uid {NOBODY if os.geteuid() == 0 else os.geteuid()}; rlimits")


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512,
               max_output_bytes: int = 8192, max_processes: int = 16) -> ToolResult:
    """Run `code` as a Python script in a fresh sandbox; its stdout and stderr (capped) and the
    error kind.

    `memory_mb` caps the address space and, separately, the files written; `max_processes` counts
    every process and thread of the sandbox, bwrap's own init included.
    """
    isolation()
    return _run(code, timeout_s, memory_mb, max_output_bytes, max_processes)
