# A shim (helpers.zygote.write_shims): `ember`, `tinker` or `python` forked from a zygote.
# `write_shims` writes it after a `#!PYTHON -IS` line and a `CONFIG = {...}` line: "socket" (the
# zygote's), "python" (the venv's interpreter), "script" (the console script this shim stands
# for, or None for `python`). It imports only small standard modules, so it starts in
# milliseconds; the command itself runs in the zygote's fork with this process's argv,
# working directory, environment and stdin/stdout/stderr, and this process exits as it does.
import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def request_for(argv):
    """What the zygote runs for this command line, or None where only an exec runs it as written."""
    if CONFIG["script"]:  # a console script: its file runs as its `#!python` line would run it
        return {"script": CONFIG["script"], "argv": argv}
    if len(argv) >= 2 and argv[0] == "-m":
        return {"module": argv[1], "argv": argv[2:]}
    if argv and not argv[0].startswith("-") and os.path.isfile(argv[0]):
        return {"script": argv[0], "argv": argv[1:]}
    return None  # `python -c ...`, flags, the REPL


def exec_as_installed(argv):
    if CONFIG["script"]:
        os.execv(CONFIG["script"], [CONFIG["script"], *argv])
    os.execv(CONFIG["python"], [CONFIG["python"], *argv])


def exit_like(status):
    """End as the command ended: its exit code, or killed by the same signal."""
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status if status >= 0 else 128 - status)


def main():
    argv = sys.argv[1:]
    request = request_for(argv)
    if request is None:
        exec_as_installed(argv)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(CONFIG["socket"])
    except OSError:  # the zygote has ended: the command runs as installed
        exec_as_installed(argv)

    request.update(cwd=os.getcwd(), env=dict(os.environ))
    socket.send_fds(conn, [b"F"], [0, 1, 2])
    conn.sendall(json.dumps(request).encode() + b"\n")
    replies = conn.makefile("rb")
    replies.readline()  # {"pid"}: forked. Until then a signal ends this shim, and the zygote
    # answers a connection that closes with a SIGTERM to the child: the same end either way

    def forward(sig, _frame):
        conn.sendall(json.dumps({"signal": sig}).encode() + b"\n")

    for sig in FORWARDED:
        signal.signal(sig, forward)
    for line in replies:
        message = json.loads(line)
        if "status" in message:
            exit_like(message["status"])
    sys.stderr.write(f"{sys.argv[0]}: the zygote ended before the command did\n")
    os._exit(1)


main()
