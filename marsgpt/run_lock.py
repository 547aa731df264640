"""One run per out_dir: out_dir/run.lock, created only where none exists, held for the run's life, refreshed by a
heartbeat, taken over from a dead holder -- and checked before every write a run commits, so that a holder whose
lock was taken writes nothing more.

fcntl locks are not honoured by every network filesystem and do not reach across nodes, but creating a file that
must not exist yet (O_EXCL) is atomic on all of them (NFS since v3, Lustre, GPFS). The file records its holder --
host, pid, when it started, the machine identity and process start time that tell a live holder from a reused pid,
the directory it guards (path and inode), and its lock_timeout_s -- and a heartbeat: a thread refreshes its
modification time every timeout_s / 4 seconds and checks that the file is still its own (`lost` says when not).

A launch that finds the lock judges the holder. A lock that guards another directory (out_dir is a copy of a
run's, `cp -r` or rsync taking run.lock along) is no holder's here. On the same machine a holder is alive while its
process is. On another machine it is alive while its heartbeat is younger than the longer of the two launches'
lock_timeout_s (a launch with a shorter timeout never judges by its own): the launch watches the heartbeat for the
rest of that bound, and one that moves is alive. A heartbeat stamped in the future by another node's clock is set
to this machine's now, so that it ages by one clock. A lock that holds no readable record (empty, cut short, not
UTF-8, not JSON: a launch killed between creating and writing it, a power loss, a disk error) is no live holder's:
a holder never rewrites its record, and one that finds its record unreadable stops writing. A live holder refuses
the launch in one line naming it; a dead one's lock is taken over, with a line saying why.

Takeovers go through a second O_EXCL file, run.lock.takeover, holding its taker's record, so two launches that find
the same dead holder do not both take its place; one left by a taker that died is removed, with a line.
"""

import contextlib
import json
import os
import socket
import stat
import threading
import time
import uuid

from marsgpt.files import process_alive

LOCK_NAME = "run.lock"
CLAIM_SUFFIX = ".takeover"


class LockError(Exception):
    """The lock cannot be taken: a live holder has it, or what is in its place is not a lock. The message is the one
    line the user sees."""


class LockLost(Exception):
    """This launch's lock was taken or removed: nothing more may be written to out_dir."""


def _process_start(pid):
    """When process `pid` started (clock ticks after boot, /proc/<pid>/stat's 22nd field), or None where that
    cannot be read: it tells a live holder from another process that was given its pid later."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _machine():
    """What processes that can see each other's pids share: the boot (a reboot ends every holder) and the pid
    namespace (two containers on one host each have their own pids)."""
    parts = []
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        parts.append(f.read().strip())
    with contextlib.suppress(OSError):
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    return "/".join(parts)


def _alive_here(record, mine):
    """Whether the process `record` names runs on this machine (None: it names another machine, or nothing)."""
    if not isinstance(record, dict) or (record.get("host"), record.get("machine")) != (mine["host"], mine["machine"]):
        return None
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0 or not process_alive(pid):
        return False
    return _process_start(pid) in (None, record.get("process_start"))


def describe_holder(holder):
    if holder is None:
        return "an unknown holder (its record cannot be read)"
    since = holder.get("since")
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return f"pid {holder.get('pid')} on {holder.get('host')} since {since}"


def _read(path):
    """(the file's bytes, its holder record or None when they are not one, its mtime in ns), or (None, None, None)
    when it is gone."""
    try:
        with open(path, "rb") as f:
            mtime_ns = os.fstat(f.fileno()).st_mtime_ns
            data = f.read(1 << 16)
    except FileNotFoundError:
        return None, None, None
    try:
        holder = json.loads(data.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError too: being written this moment, or damaged
        holder = None
    return data, holder if isinstance(holder, dict) else None, mtime_ns


def _not_a_file(path):
    """What is at `path` when it is something a lock cannot be (a directory, a symlink, ...), else None."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return "a symlink" if os.path.exists(path) else "a dangling symlink"
    return "a directory" if stat.S_ISDIR(mode) else "not a regular file"


class RunLock:
    """The lock this launch holds on a directory (acquire); `lost` is set once it is no longer its own."""

    EMPTY_LOCK_WAIT_S = 2.0  # a launch writes its record microseconds after creating the file (NFS: one round trip)
    CLAIM_WAIT_S = 5.0  # a takeover holds its claim for milliseconds: one unchanged this long was left by a dead one
    FUTURE_S = 2.0  # a heartbeat further ahead of this machine's clock than this was stamped by another clock

    def __init__(self, path, token, timeout_s):
        self.path, self.token, self.timeout_s = path, token, timeout_s
        self.lost = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="run.lock heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, directory, timeout_s, wait_limit_s=float("inf")):
        """The lock on `directory`, taken over from a dead holder if need be; LockError when a live one holds it or
        run.lock is not a file; OSError when the directory cannot be written. `wait_limit_s` bounds how long a
        launch watches a heartbeat (under DDP the other ranks wait for this decision)."""
        path = os.path.join(directory, LOCK_NAME)
        for name in (path, path + CLAIM_SUFFIX):
            what = _not_a_file(name)
            if what is not None:
                raise LockError(f"{name} is {what}, not a lock file this program writes: remove it, then launch again")
        mine = dict(
            host=socket.gethostname(),
            machine=_machine(),
            pid=os.getpid(),
            process_start=_process_start(os.getpid()),
            since=time.time(),
            token=uuid.uuid4().hex,
            directory=os.path.realpath(directory),
            inode=os.stat(directory).st_ino,
            timeout_s=timeout_s,
        )
        judge = _Judge(directory, path, mine, timeout_s, wait_limit_s)
        for _attempt in range(20):  # each round ends with the lock, or with its holder judged
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                data, holder, mtime_ns = cls._read_written(path)
                if data is None:  # released meanwhile
                    continue
                reason = judge(data, holder, mtime_ns)
                if _take_over(path, data, mine):
                    print(f"out_dir {directory}: took over the lock of {describe_holder(holder)}: {reason}", flush=True)
                continue
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps(mine))
                    f.flush()
                    os.fsync(f.fileno())
            except OSError:  # a full disk: no empty lock is left for the next launch to wonder about
                with contextlib.suppress(OSError):
                    os.remove(path)
                raise
            return cls(path, mine["token"], timeout_s)
        raise LockError(f"out_dir {directory}: could not take {path}: other launches keep taking it; try again")

    @classmethod
    def _read_written(cls, path):
        """_read, once the lock holds a record or EMPTY_LOCK_WAIT_S have passed: a launch that has just created it
        (the loser of two launches at the same moment finds the winner's) writes its record at once."""
        deadline = time.monotonic() + cls.EMPTY_LOCK_WAIT_S
        data, holder, mtime_ns = _read(path)
        while data is not None and holder is None and time.monotonic() < deadline:
            time.sleep(0.01)
            data, holder, mtime_ns = _read(path)
        return data, holder, mtime_ns

    def check(self):
        """Raise LockLost unless run.lock is still this launch's, read now: the guard before each write a run
        commits to out_dir (a checkpoint's rename, its copies, a metrics record)."""
        if self.lost is None:
            data, holder, _ = _read(self.path)
            if holder is None or holder.get("token") != self.token:
                self.lost = self._loss(data, holder)
        if self.lost is not None:
            raise LockLost(self.lost)

    def _loss(self, data, holder):
        if data is None:
            taker = "removed"
        elif holder is None:
            taker = "overwritten with bytes that are not a lock record"
        else:
            taker = f"taken by {describe_holder(holder)}"
        return f"the lock on its out_dir ({self.path}) was {taker}"

    def _beat(self):
        unreadable = 0
        while not self._stop.wait(max(self.timeout_s / 4, 0.05)):
            data, holder, _ = _read(self.path)
            unreadable = unreadable + 1 if data is not None and holder is None else 0
            if unreadable == 1:  # a read that met a taker's write: look again at the next beat
                continue
            if holder is None or holder.get("token") != self.token:
                self.lost = self.lost or self._loss(data, holder)
                return
            with contextlib.suppress(OSError):  # a passing filesystem error: the next beat tries again
                os.utime(self.path)

    def release(self):
        self._stop.set()
        self._thread.join()
        _, holder, _ = _read(self.path)
        if holder is not None and holder.get("token") == self.token:
            with contextlib.suppress(OSError):
                os.remove(self.path)


class _Judge:
    """Decides whether the holder of a lock found in place is dead: returns the reason to print, or raises
    LockError when it is alive."""

    def __init__(self, directory, path, mine, timeout_s, wait_limit_s):
        self.directory, self.path, self.mine = directory, path, mine
        self.timeout_s, self.wait_limit_s = timeout_s, wait_limit_s

    def refusal(self, holder):
        return LockError(
            f"out_dir {self.directory} is in use by the run of {describe_holder(holder)} (it holds {self.path}); "
            "wait for it to end or stop it, or use another --out_dir"
        )

    def __call__(self, data, holder, mtime_ns):
        if not data:
            return "the lock is empty: the launch that created it ended before writing to it (a full disk, a kill)"
        if holder is None:
            return (
                f"the lock holds {len(data):,} bytes that are not a lock record (a power loss or a disk error); no "
                "live run's lock reads so"
            )
        # Another path and another inode: a copy. One of the two alone is this directory seen through another
        # mount point or symlink (the path), or moved or restored in place (the inode): judged as its holder.
        guarded = holder.get("directory")
        if guarded is not None and guarded != self.mine["directory"] and holder.get("inode") != self.mine["inode"]:
            return f"it guards {guarded}; this out_dir is a copy of that run's"
        alive = _alive_here(holder, self.mine)
        if alive:
            raise self.refusal(holder)
        if alive is False:
            return "its process is gone"
        return self.heartbeat(holder, mtime_ns)

    def heartbeat(self, holder, mtime_ns):
        """A holder on another machine: alive while its heartbeat is younger than the longer lock_timeout_s."""
        theirs = holder.get("timeout_s")
        timeout = max(self.timeout_s, theirs if isinstance(theirs, (int, float)) and theirs > 0 else 0)
        named = f"lock_timeout_s={timeout:g}" + (" (the holder's)" if timeout > self.timeout_s else "")
        age = time.time() - mtime_ns / 1e9
        if age < -RunLock.FUTURE_S:
            with contextlib.suppress(OSError):
                os.utime(self.path)
                mtime_ns = os.stat(self.path).st_mtime_ns
            print(
                f"out_dir {self.directory}: the heartbeat of {self.path} was {-age:.0f} s ahead of this machine's "
                "clock (another node's clock): it now ages from this machine's",
                flush=True,
            )
            age = 0.0
        if age >= timeout:
            return f"its heartbeat stopped {age:.0f} s ago ({named})"
        wait = min(timeout - age, self.wait_limit_s)
        print(
            f"out_dir {self.directory} is locked by {describe_holder(holder)}, last refreshed {age:.0f} s ago: "
            f"watching for {wait:.0f} s whether that run is alive",
            flush=True,
        )
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(min(1.0, timeout / 20))
            try:
                if os.stat(self.path).st_mtime_ns != mtime_ns:
                    raise self.refusal(holder)
            except FileNotFoundError:
                return "it was released"
        if wait < timeout - age:
            raise LockError(
                f"out_dir {self.directory} is locked by {describe_holder(holder)}, not refreshed for "
                f"{age + wait:.0f} s; it is taken over once it is {named} s old: launch again then"
            )
        return f"its heartbeat stopped for {named} s"


def _take_over(path, data, mine):
    """Remove the lock judged dead, if it is still the one judged (`data`); False when another launch is taking it
    over or has taken it (the caller looks again). The claim holds this launch's record."""
    claim = path + CLAIM_SUFFIX
    try:
        fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        _clear_dead_claim(claim, mine)
        return False
    try:
        with contextlib.suppress(OSError):
            os.write(fd, json.dumps({k: mine[k] for k in ("host", "machine", "pid", "process_start")}).encode())
        if _read(path)[0] != data:
            return False
        os.remove(path)
        return True
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.remove(claim)


def _clear_dead_claim(claim, mine):
    """Remove the takeover claim `claim` when its taker is dead (a line says so); return when it is gone or its
    taker may be alive. A taker on this machine is judged by its process; any other claim by whether it stays
    unchanged for CLAIM_WAIT_S on this machine's clock (a takeover holds it for milliseconds)."""
    data, taker, _ = _read(claim)
    if data is None:
        return
    alive = _alive_here(taker, mine)
    if alive is None:
        try:
            before = os.stat(claim)
        except FileNotFoundError:
            return
        deadline = time.monotonic() + RunLock.CLAIM_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
            try:
                now = os.stat(claim)
            except FileNotFoundError:
                return
            if (now.st_ino, now.st_mtime_ns) != (before.st_ino, before.st_mtime_ns):
                return
        why = f"it stayed unchanged for {RunLock.CLAIM_WAIT_S:g} s"
    elif alive:
        time.sleep(0.05)
        return
    else:
        why = f"its taker, {describe_holder(taker)}, is gone"
    with contextlib.suppress(FileNotFoundError):
        os.remove(claim)
        print(f"removed {claim}, left by a launch that died taking the lock over: {why}", flush=True)
