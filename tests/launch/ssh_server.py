"""A real SSH server for the launch tests: it runs every command it receives, like sshd.

``python ssh_server.py DIR`` writes a host key and a client key pair into DIR
(``client_key`` is what ``ssh -i`` takes), listens on a free port of 127.0.0.1, prints
``PORT`` on a line and serves until killed. A command runs as ``$SHELL -c COMMAND`` in
the home directory, with this server's environment plus what the client sent, in a new
session; its stdout, stderr and exit status (or signal) go back to the client, and it is
stopped (SIGTERM, then SIGKILL) when the channel closes first (e.g. the client is killed).
Every command is appended to ``DIR/commands.log``, one line each.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import asyncssh

GRACE = 5.0


async def _pump(reader: asyncio.StreamReader, writer) -> None:
    while data := await reader.read(65536):
        writer.write(data)


async def _feed(reader, proc: asyncio.subprocess.Process) -> None:
    try:
        while data := await reader.read(65536):
            proc.stdin.write(data)
            await proc.stdin.drain()
    except (asyncssh.Error, BrokenPipeError, ConnectionResetError):
        pass
    finally:
        if not proc.stdin.is_closing():
            proc.stdin.close()


def _stop(proc: asyncio.subprocess.Process, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def make_handler(log: Path):
    async def handle(process: asyncssh.SSHServerProcess) -> None:
        command = process.command or "exec $SHELL -l"
        with log.open("a") as f:
            f.write(command.replace("\n", " ") + "\n")
        env = {**os.environ, **dict(process.env)}
        proc = await asyncio.create_subprocess_exec(
            env.get("SHELL", "/bin/sh"),
            "-c",
            command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=os.path.expanduser("~"),
            start_new_session=True,
        )
        io = [
            asyncio.ensure_future(_feed(process.stdin, proc)),
            asyncio.ensure_future(_pump(proc.stdout, process.stdout)),
            asyncio.ensure_future(_pump(proc.stderr, process.stderr)),
        ]
        done = asyncio.ensure_future(proc.wait())
        closed = asyncio.ensure_future(process.wait_closed())
        await asyncio.wait([done, closed], return_when=asyncio.FIRST_COMPLETED)
        if not done.done():  # the client went away: stop what it started
            _stop(proc, signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(done), GRACE)
            except TimeoutError:
                _stop(proc, signal.SIGKILL)
                await done
            for task in io:
                task.cancel()
            return
        await asyncio.gather(*io[1:], return_exceptions=True)
        io[0].cancel()
        code = proc.returncode
        try:
            if code < 0:
                process.exit_with_signal(signal.Signals(-code).name.removeprefix("SIG"))
            else:
                process.exit(code)
        except (asyncssh.Error, OSError):
            pass
        closed.cancel()

    return handle


def write_keys(directory: Path) -> tuple[Path, Path]:
    """The host key and the client's private key (mode 600), created once."""
    host_key, client_key = directory / "host_key", directory / "client_key"
    if not host_key.exists():
        asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(host_key))
    if not client_key.exists():
        key = asyncssh.generate_private_key("ssh-ed25519")
        key.write_private_key(str(client_key))
        key.write_public_key(str(directory / "client_key.pub"))
    os.chmod(client_key, 0o600)
    return host_key, client_key


async def serve(directory: Path) -> None:
    host_key, _ = write_keys(directory)
    server = await asyncssh.create_server(
        asyncssh.SSHServer,
        "127.0.0.1",
        0,
        server_host_keys=[str(host_key)],
        authorized_client_keys=str(directory / "client_key.pub"),
        process_factory=make_handler(directory / "commands.log"),
        encoding=None,
    )
    port = server.sockets[0].getsockname()[1]
    print(port, flush=True)
    await server.wait_closed()


if __name__ == "__main__":
    asyncio.run(serve(Path(sys.argv[1])))
