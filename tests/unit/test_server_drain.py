"""services/server.py's stop on SIGTERM, in a child process of its own: a drain that finishes exits 0; one whose
drain hangs is ended by the backstop (exit 1, every thread's stack and asyncio task in its log) instead of hanging
forever."""
import signal
import subprocess
import sys
import textwrap
import time

import grpc

CHILD = textwrap.dedent("""
    import asyncio, logging, sys
    from tandem.services import server as server_mod

    logging.basicConfig(level=logging.INFO)
    server_mod.STOP_GRACE_S, server_mod.EXIT_GRACE_S = 0.1, 0.5

    async def stuck_leaving_the_registry():
        await asyncio.sleep(3600)

    async def leave_the_registry():
        print("left the registry", file=sys.stderr, flush=True)

    async def main(mode):
        server_mod.exit_on_signal_while_starting()  # (as every service main: a signal before start() ends it)
        server = server_mod.Server("decode", "decode-test", "127.0.0.1", 0, drain_timeout_s=0.5)
        await server.start()
        print(server.port, flush=True)
        if mode == "early":  # a signal while the service registers itself, between start() and serving
            await asyncio.sleep(1.0)
        await server.serve_until_signal(on_drain=stuck_leaving_the_registry if mode == "hang" else leave_the_registry)

    asyncio.run(main(sys.argv[1]))
""")


def stop_child(mode: str) -> tuple[int, str, float]:
    proc = subprocess.Popen([sys.executable, "-P", "-c", CHILD, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        port = int(proc.stdout.readline())
        if mode != "early":
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # (serving)
                grpc.channel_ready_future(channel).result(timeout=30)
            time.sleep(0.2)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        return code, proc.stderr.read(), time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()


def test_a_drain_that_finishes_exits_0_before_the_backstop():
    code, log, elapsed = stop_child("finish")
    assert code == 0, log
    assert "left the registry" in log and "drained: no call in flight" in log and "still running" not in log


def test_a_signal_between_start_and_serving_drains():
    """start() takes the signals over: one that lands while the service registers itself waits for the drain,
    which leaves the registry (the start-up handler's exit would have left the record behind)."""
    code, log, elapsed = stop_child("early")
    assert code == 0, log
    assert "left the registry" in log and "drained: no call in flight" in log, log


def test_a_drain_that_hangs_is_ended_with_every_threads_stack():
    code, log, elapsed = stop_child("hang")
    assert code == 1, log
    assert "still running 1 s after the drain began" in log  # (0.5 s drain + 0.1 s stop grace + 0.5 s)
    assert "drained" not in log
    # faulthandler's dump: the backstop's own thread and the main thread (its event loop, waiting)
    assert "Current thread 0x" in log and "\nThread 0x" in log, log
    # and the asyncio tasks' stacks: where the drain waits (the loop's thread shows only its idle select)
    assert "in stuck_leaving_the_registry" in log, log
    assert elapsed >= 1.0
