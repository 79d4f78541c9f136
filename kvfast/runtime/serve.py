"""A warm server that forks ``kvfast check``'s child process (``kvfast serve``), and its client.

A fresh child (:func:`kvfast.runtime.child.start_child`) is ``python -c BOOT``: it imports NumPy, Numba and
the checker before its first model call, most of a second on a small machine. A server (:func:`serve`) has
done that work once (its caller's ``prepare``: imports, Numba's CPU target, kvfast's own kernels loaded) and
**forks** one child per check, like multiprocessing's forkserver: a forked child has the process state of a
fresh child after its imports, and the same contract (:mod:`kvfast.runtime.child`): its own session and
process group, killed with its group, the parent's watchdog pipe, the ready byte, the result file,
``os._exit``.

**The key.** A server is used only by a client whose fresh child would be the same process: the same
``sys.executable``, ``sys.path`` (``''`` and relative directories made absolute), interpreter flags,
environment (every variable but :data:`IGNORED_ENV`) and kvfast sources (each ``.py`` file's path, size and
modification time: :func:`key`). The socket's name is the key's digest, in a per-user directory made 0700
(:func:`socket_dir`: ``$XDG_RUNTIME_DIR/kvfast``, else ``~/.cache/kvfast/serve``); the server also compares
the whole key and the peer's uid (``SO_PEERCRED``) before it forks. ``KVFAST_SERVE_SOCKET=PATH``: look for
the server at PATH (``kvfast serve --socket PATH``) instead; ``KVFAST_SERVE=0``: never look.

**The client** (:func:`served_child`): a missing socket, a stale one (its server killed) or a key that
differs costs a failed ``connect`` (no wait) and returns ``None``: the caller starts a fresh child, and a
timeline mark says why (:func:`kvfast.runtime.child.mark`). Otherwise it sends its pipe ends (watch,
request, ready), ``/dev/null`` as stdin and its own stdout and stderr (``socket.send_fds``), with the boot
info, its working directory, environment and umask; the server forks and answers the child's pid, later its
exit status (:class:`ServedChild`, the interface of :class:`~kvfast.runtime.child.Child`). A server that ends
before it reports the status reads as the child ending without a report (its group is killed), never as a
success.

**The server** (:func:`serve`) is single-threaded (it refuses to start with a second Python thread: a lock
another thread holds, the import lock say, would deadlock every forked child): one ``select`` loop over its
socket, its clients and a self-pipe that ``SIGCHLD``, ``SIGTERM``, ``SIGINT`` and ``SIGHUP`` write to
(``signal.set_wakeup_fd``); children are reaped with ``waitpid(WNOHANG)``. It exits after ``idle`` seconds
without a request (while no child runs) and on ``SIGTERM``, Ctrl-C or ``SIGHUP``, removing its socket. The forked child
(:func:`_become_child`) starts its own session, closes the server's sockets, restores the default signal
handlers, takes the client's descriptors as 0/1/2 (new ``sys.std*`` objects, buffered as a fresh
interpreter's), its working directory, environment, umask, ``sys.path`` and ``sys.argv``, a fresh
``__main__``, reseeds NumPy's global generator (Python's ``random`` reseeds itself on fork), then runs the
caller's ``entry(boot)``, which must end the process (``os._exit``). Not carried over: resource limits
(``ulimit``) and the nice value are the server's.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvfast.runtime.child import SOCKET_ENV, Child, ChildOutcome, kill_group, mark, may_be_served
from kvfast.runtime.child import socket_dir as _socket_dir

#: environment variables that do not make a fresh child differ (shells' bookkeeping, kvfast's own timeline and
#: server switches, pytest's per-test note): the rest are part of the key
IGNORED_ENV = frozenset(
    {"PWD", "OLDPWD", "_", "SHLVL", "KVFAST_TIMELINE", "KVFAST_SERVE_SOCKET", "KVFAST_SERVE", "PYTEST_CURRENT_TEST"}
)
REPLY_S = 5.0  # how long a client waits for the server's answer (the child's pid) before it starts its own
HEADER = struct.Struct("!I")  # the length of a message's JSON, before it
KVFAST_DIR = Path(__file__).resolve().parents[1]


def sources_digest(root: Path = KVFAST_DIR) -> str:
    """A digest of kvfast's sources: each ``.py`` file's relative path, size and modification time."""
    h = hashlib.sha256(str(root).encode())
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                st = os.stat(os.path.join(folder, name))
                h.update(
                    f"{os.path.relpath(os.path.join(folder, name), root)} {st.st_size} {st.st_mtime_ns}\n".encode()
                )
    return h.hexdigest()


def _path_entry(entry: str) -> str:
    """A ``sys.path`` entry as the key has it: ``''`` and a relative directory made absolute (they are the working
    directory's), anything else as it is (an absolute path, a path hook's name such as an editable install's)."""
    if entry == "" or (not os.path.isabs(entry) and os.path.isdir(entry)):
        return os.path.abspath(entry)
    return entry


def key() -> dict:
    """What makes this process's fresh child what it is (see the module doc)."""
    k = {
        "executable": sys.executable,
        "path": [_path_entry(p) for p in sys.path],
        "flags": list(sys.flags),
        "xoptions": sorted(f"{k}={v}" for k, v in sys._xoptions.items()),
        "warnoptions": list(sys.warnoptions),
        "env": sorted((k, v) for k, v in os.environ.items() if k not in IGNORED_ENV),
        "kvfast": sources_digest(),
    }
    return json.loads(json.dumps(k))  # as the server reads a client's: lists, not tuples


def key_difference(theirs: object, own: dict) -> str:
    """What differs between a client's key and the server's, in words (the fields; the environment's variables)."""
    if not isinstance(theirs, dict):
        return "no key"
    fields = [name for name in own if theirs.get(name) != own[name]]
    if "env" in fields:
        a, b = dict(map(tuple, theirs.get("env") or [])), dict(map(tuple, own["env"]))
        names = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        fields[fields.index("env")] = f"the environment ({', '.join(names[:5])}{more})"
    return ", ".join(fields) or "none"


def digest(k: dict) -> str:
    """The key's digest: the socket's name."""
    return hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:32]


def socket_dir() -> Path:
    """The per-user directory of the servers' sockets: ``$XDG_RUNTIME_DIR/kvfast`` if that variable names a
    directory, else ``~/.cache/kvfast/serve``."""
    return Path(_socket_dir())


def socket_path(k: dict) -> Path:
    """Where the server of key ``k`` listens: ``$KVFAST_SERVE_SOCKET``, else :func:`socket_dir`/DIGEST.sock."""
    named = os.environ.get(SOCKET_ENV)
    return Path(named) if named else socket_dir() / f"{digest(k)}.sock"


def private_dir(path: Path) -> Path:
    """``path`` created 0700 if missing; ``ValueError`` unless it is a directory of this user's that nobody else
    can enter."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(
            f"the socket's directory: {str(path)!r} is not allowed; allowed: a directory of this user's that nobody "
            f"else can read or enter (it has mode {st.st_mode & 0o777:o}, owner uid {st.st_uid})"
        )
    return path


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _send(sock: socket.socket, message: dict, fds: list[int] | tuple = ()) -> None:
    data = json.dumps(message).encode()
    data = HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def _receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message and the descriptors sent with it; ``(None, [])`` at EOF."""
    if max_fds:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, max_fds)
    else:
        data, fds = sock.recv(1 << 16), []
    if not data:
        return None, fds
    while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
        more = sock.recv(1 << 16)
        if not more:
            for fd in fds:
                os.close(fd)
            return None, []
        data += more
    return json.loads(data[HEADER.size : HEADER.size + HEADER.unpack_from(data)[0]]), fds


# -- the client -----------------------------------------------------------------------------------------------


def served_child() -> ServedChild | None:
    """A child forked by the server of this process's key (:func:`kvfast.commands.check.child` waiting for its
    request), or ``None`` (no server, a stale socket, a key that differs, ``KVFAST_SERVE=0``): the caller starts
    a fresh one. A timeline mark says which."""
    if not may_be_served():
        return None
    k = key()
    path = socket_path(k)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(REPLY_S)
        sock.connect(str(path))
        if _peer_uid(sock) != os.getuid():
            raise PermissionError("the server runs as another user")
    except OSError as exc:
        sock.close()
        mark(f"parent: no kvfast serve ({type(exc).__name__} at {path})")
        return None
    try:
        child = ServedChild(sock, k)
    except (OSError, ValueError, TypeError) as exc:  # refused (another key), gone, too slow: a fresh child
        sock.close()
        mark(f"parent: kvfast serve not used ({exc})")
        return None
    mark("parent: child forked by kvfast serve")
    return child


class ServedChild:
    """A child the server forked for this process (:func:`served_child`): :meth:`send`, :meth:`wait` and
    :meth:`discard` as :class:`~kvfast.runtime.child.Child`'s. ``pid``: the child's (it leads its own process
    group). ``ready_info``: what the child wrote after its ready byte (JSON; ``{}`` if nothing)."""

    served = True

    def __init__(self, sock: socket.socket, k: dict) -> None:
        self._sock = sock
        self._tmp = tempfile.mkdtemp(prefix="kvfast-child-")
        self.result_path = os.path.join(self._tmp, "result.json")
        self._request_path = os.path.join(self._tmp, "request.json")
        theirs: list[int] = []
        mine: list[int] = []
        try:
            watch_read, self._watch_write = os.pipe()
            theirs.append(watch_read)
            mine.append(self._watch_write)
            request_read, self._request_write = os.pipe()
            theirs.append(request_read)
            mine.append(self._request_write)
            self._ready_read, ready_write = os.pipe()
            theirs.append(ready_write)
            mine.append(self._ready_read)
            devnull = os.open(os.devnull, os.O_RDONLY)
            theirs.append(devnull)
            umask = os.umask(0o22)
            os.umask(umask)
            boot = {"path": [str(p) for p in sys.path], "result": self.result_path, "request": self._request_path}
            header = {"key": k, "boot": boot, "cwd": os.getcwd(), "env": dict(os.environ), "umask": umask}
            # fds: stdin, stdout, stderr, then the pipes' child ends (watch, request, ready)
            _send(sock, header, [devnull, 1, 2, watch_read, request_read, ready_write])
            reply, _ = _receive(sock)
        except BaseException:
            for fd in theirs + mine:
                os.close(fd)
            os.rmdir(self._tmp)
            raise
        for fd in theirs:
            os.close(fd)
        if reply is None or "pid" not in reply:
            for fd in mine:
                os.close(fd)
            os.rmdir(self._tmp)
            raise ValueError(f"refused: {reply.get('refused') if reply else 'the server ended'}")
        sock.settimeout(None)
        self.pid: int = reply["pid"]
        self.ready_info: dict = {}
        self.returncode: int | None = None
        self._lost = False
        self._sent = False
        self._closed = False

    send = Child.send  # the same request file and pipe (the same attribute names)

    def _status(self, timeout: float | None) -> bool:
        """Read the server's report of the child's end if it comes within ``timeout`` seconds (``None``: wait);
        whether the child has ended (its ``returncode`` set; the server gone first: the child killed, ``_lost``)."""
        if self.returncode is not None:
            return True
        readable, _, _ = select.select([self._sock], [], [], timeout)
        if not readable:
            return False
        try:
            message, _ = _receive(self._sock)
        except (OSError, ValueError):
            message = None
        if message is None or "status" not in message:  # the server ended first: the child is killed, no report
            self._lost = True
            self._kill()
            self.returncode = -signal.SIGKILL
        else:
            self.returncode = int(message["status"])
        return True

    def _kill(self) -> None:
        kill_group(self.pid)
        if self.returncode is None and not self._lost:  # not reaped yet (still the server's child): before setsid
            try:
                os.kill(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _wait_until_ready(self) -> None:
        while True:
            readable, _, _ = select.select([self._ready_read, self._sock], [], [])
            if self._ready_read in readable:
                data = os.read(self._ready_read, 4096)  # b"r" (and JSON), or b"" when the child ended first
                if len(data) > 1:
                    self.ready_info = json.loads(data[1:])
                return
            if self._status(0):
                return

    def wait(self, timeout: float | None = None, grace: float = 1.5) -> ChildOutcome:
        """As :meth:`Child.wait <kvfast.runtime.child.Child.wait>`; ``timeout``: the child's ready info's
        ``timeout`` if it sends one (it parsed the arguments itself)."""
        try:
            self._wait_until_ready()
            timeout = self.ready_info.get("timeout", timeout)
            if not self._status(None if timeout is None else timeout + grace):
                self._kill()
                if not self._status(REPLY_S):  # a server that cannot even report it (stopped): killed all the same
                    self.returncode = -signal.SIGKILL
                return ChildOutcome(None, self.returncode, timed_out=True)
        except KeyboardInterrupt:
            self._kill()
            self._status(REPLY_S)
            raise
        finally:
            self._kill()  # whatever the user's code left running in the child's session
        if self._lost:
            return ChildOutcome(None, self.returncode, server_lost=True)
        try:
            with open(self.result_path) as f:
                return ChildOutcome(json.load(f), self.returncode)
        except FileNotFoundError:
            return ChildOutcome(None, self.returncode)

    def discard(self) -> None:
        """As :meth:`Child.discard <kvfast.runtime.child.Child.discard>` (it waits a moment for the server's report
        of the child's end)."""
        if self._closed:
            return
        self._closed = True
        self._kill()
        if not self._sent:
            os.close(self._request_write)
        os.close(self._watch_write)
        os.close(self._ready_read)
        self._status(REPLY_S)
        self._sock.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


# -- the server -----------------------------------------------------------------------------------------------


class _Stop(Exception):
    pass


def listen(own: dict, path: Path | str | None = None) -> tuple[socket.socket, Path]:
    """A listening socket on ``path`` (default :func:`socket_path` of key ``own``, its directory made private),
    replacing a stale socket file there (a server killed without its cleanup); ``ValueError`` (bad input) if
    a server listens there, or the path is taken by something else."""
    if path is None:
        path = socket_path(own)
        if not os.environ.get(SOCKET_ENV):
            private_dir(path.parent)
    path = Path(path)
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:  # a server killed without its cleanup: its stale socket
            path.unlink()
        except OSError as exc:
            raise ValueError(f"--socket: {str(path)!r} is not allowed; allowed: a free path ({exc})") from None
        else:
            raise ValueError(f"--socket: {str(path)!r} is not allowed; allowed: a path no kvfast serve listens on")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the socket 0600
    try:
        listener.bind(str(path))
    except OSError as exc:
        listener.close()
        raise ValueError(
            f"--socket: {str(path)!r} is not allowed; allowed: a path to bind a socket on ({exc})"
        ) from None
    finally:
        os.umask(old_umask)
    listener.listen(64)
    return listener, path


def serve(
    entry, own: dict, env: dict[str, str], listener: socket.socket, path: Path, idle: float = 600.0, announce=None
) -> int:
    """Fork ``entry(boot)`` for each client of ``listener`` (:func:`listen`, on ``path``) whose key is ``own``,
    until ``idle`` seconds pass without a request (and no child runs), a ``SIGTERM``, ``SIGINT`` or ``SIGHUP``;
    the socket is removed. ``announce(path)`` once it serves. ``RuntimeError`` if this process runs a second
    thread (forking it would not be safe). Why it stopped, in words (``idle for 600 s``, ``SIGTERM``).

    ``own`` and ``env``: this process's :func:`key` and ``os.environ`` taken before its warm-up; what the warm-up
    changed in ``os.environ`` (kvfast's import sets ``NUMBA_CACHE_DIR``, as a fresh child's does) is changed in
    each child's environment, the client's, too."""
    inode = path.stat().st_ino
    if threading.active_count() != 1:
        path.unlink()
        listener.close()
        raise RuntimeError(f"kvfast serve: {threading.active_count()} threads; it forks, so it must run only one")
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    os.set_blocking(wake_read, False)
    stop: list[str] = []
    previous = {
        sig: signal.signal(sig, handler)
        for sig, handler in (
            (signal.SIGCHLD, lambda *_: None),
            (signal.SIGTERM, lambda *_: stop.append("SIGTERM")),
            (signal.SIGINT, lambda *_: stop.append("SIGINT")),
            (signal.SIGHUP, lambda *_: stop.append("SIGHUP")),  # its terminal closed
        )
    }
    previous_wakeup = signal.set_wakeup_fd(wake_write)
    clients: dict[socket.socket, int] = {}  # a client's connection -> its child's pid
    children: dict[int, socket.socket | None] = {}  # a child's pid -> its client's connection (None: gone)
    changed = {k: v for k, v in os.environ.items() if env.get(k) != v}
    removed = [k for k in env if k not in os.environ]
    server = (listener, wake_read, wake_write, clients, changed, removed)
    last = time.monotonic()
    if announce is not None:
        announce(path)
    try:
        while not stop:
            timeout = None if children else last + idle - time.monotonic()
            if timeout is not None and timeout <= 0:
                stop.append(f"idle for {idle:g} s")
                break
            readable, _, _ = select.select([listener, wake_read, *clients], [], [], timeout)
            if wake_read in readable:
                _drain(wake_read)
            if _reap(children, clients):
                last = time.monotonic()
            _forget_gone([c for c in readable if c in clients], clients, children)
            if listener in readable and not stop:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                last = time.monotonic()
                pid = _fork_for(conn, own, entry, server)
                if pid is None:
                    conn.close()
                else:
                    clients[conn] = pid
                    children[pid] = conn
    finally:
        signal.set_wakeup_fd(previous_wakeup)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            if path.stat().st_ino == inode:  # still ours (not a newer server's)
                path.unlink()
        except FileNotFoundError:
            pass
        listener.close()
        for conn in clients:
            conn.close()
        os.close(wake_read)
        os.close(wake_write)
    return stop[0]


def _drain(fd: int) -> None:
    """Read the self-pipe empty (the signals' bytes: the loop looks at what they mean itself)."""
    while True:
        try:
            if not os.read(fd, 512):
                return
        except BlockingIOError:
            return


def _reap(children: dict, clients: dict) -> bool:
    """Reap the children that ended and send each one's exit status to its client; whether any ended."""
    reaped = False
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        reaped = True
        conn = children.pop(pid, None)
        if conn is not None:
            clients.pop(conn, None)
            try:
                _send(conn, {"status": os.waitstatus_to_exitcode(status)})
            except OSError:
                pass
            conn.close()
    return reaped


def _forget_gone(readable: list, clients: dict, children: dict) -> None:
    """Clients whose connection is readable have gone away (a client writes nothing after its request; one that
    does is dropped too): their children are reaped without a report (a child whose client is gone kills its
    group: its watch pipe ends)."""
    for conn in readable:
        children[clients.pop(conn)] = None
        conn.close()


def _fork_for(conn: socket.socket, own: dict, entry, server) -> int | None:
    """Read a client's request and fork its child; the child's pid, or ``None`` (refused, a bad request)."""
    fds: list[int] = []
    try:
        conn.settimeout(REPLY_S)
        if _peer_uid(conn) != os.getuid():
            return None
        header, fds = _receive(conn, max_fds=6)
        if header is None or len(fds) != 6:
            return None
        if header.get("key") != own:
            _send(conn, {"refused": f"another key: {key_difference(header.get('key'), own)}"})
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                boot = _become_child(conn, header, fds, server)
                entry(boot)
            except BaseException:  # noqa: BLE001 - never back into the server's loop
                import traceback

                traceback.print_exc()
            finally:
                os._exit(70)
        try:
            _send(conn, {"pid": pid})
            conn.settimeout(None)
        except OSError:  # the client is gone: its child ends by itself (its pipes closed), reaped as any other
            pass
        return pid
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        for fd in fds:
            os.close(fd)


def _become_child(conn: socket.socket, header: dict, fds: list[int], server) -> dict:
    """In the forked child: the process state of a fresh ``python -c BOOT`` of the client's (module doc); its
    boot info."""
    os.setsid()
    listener, wake_read, wake_write, clients, changed, removed = server
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sock in (listener, conn, *clients):
        os.close(sock.detach())
    os.close(wake_read)
    os.close(wake_write)
    stdin, stdout, stderr, watch, request, ready = fds
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
    for fd in {stdin, stdout, stderr} - {0, 1, 2}:
        os.close(fd)
    _fresh_std_streams()
    os.chdir(header["cwd"])
    environ = {**header["env"], **changed}
    for k in removed:
        environ.pop(k, None)
    os.environ.clear()
    os.environ.update(environ)
    os.umask(header["umask"])
    boot = dict(header["boot"], watch_fd=watch, request_fd=request, ready_fd=ready)
    sys.argv[:] = ["-c", json.dumps(boot)]
    sys.path[:] = boot["path"]
    import types

    sys.modules["__main__"] = types.ModuleType("__main__")
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()  # the legacy global generator: a fresh child's is seeded from the OS, not the server's
    return boot


def _fresh_std_streams() -> None:
    """``sys.stdin/stdout/stderr`` anew over descriptors 0, 1, 2, buffered as a fresh interpreter's: stdout
    line-buffered on a terminal, stderr line-buffered, both write-through with ``-u``/``PYTHONUNBUFFERED``."""
    streams = []
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        old = getattr(sys, f"__{name}__", None) or getattr(sys, name)
        kwargs = {"encoding": old.encoding, "errors": old.errors} if old is not None else {}
        stream = open(fd, mode, closefd=False, **kwargs)  # noqa: SIM115 - the process's own stream
        if mode == "w":  # write-through: -u or PYTHONUNBUFFERED, the server's as the client's (the key)
            unbuffered = bool(getattr(old, "write_through", False))
            stream.reconfigure(line_buffering=name == "stderr" or stream.isatty(), write_through=unbuffered)
        streams.append(stream)
    sys.stdin = sys.__stdin__ = streams[0]
    sys.stdout = sys.__stdout__ = streams[1]
    sys.stderr = sys.__stderr__ = streams[2]
