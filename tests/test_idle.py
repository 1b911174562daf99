"""IdleQueue: deferred work runs in order, when the event loop is idle, within bounds."""

from __future__ import annotations

import asyncio
import socket

import pytest

from proxy.mitm.idle import IdleQueue


def test_outside_a_loop_items_run_at_once():
    queue = IdleQueue()
    ran: list[int] = []
    queue.push(ran.append, 1)
    queue.push(ran.append, 2)
    assert ran == [1, 2]
    assert len(queue) == 0


async def _until(predicate, timeout: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


def test_items_run_later_in_order_when_the_loop_is_idle():
    async def main() -> None:
        queue = IdleQueue()
        ran: list[int] = []
        for i in range(100):
            queue.push(ran.append, i)
        assert ran == []  # deferred: nothing ran inside push
        await _until(lambda: len(ran) == 100)
        assert ran == list(range(100))
        assert queue.overdue == 0

    asyncio.run(main())


def test_a_ready_socket_goes_first_until_max_delay():
    """While a socket is ready to read, items wait; past max_delay they run anyway."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        queue = IdleQueue(max_delay=0.2)
        a, b = socket.socketpair()
        a.setblocking(False)
        reads = 0

        def on_readable() -> None:  # never drains the socket: stays ready
            nonlocal reads
            reads += 1

        b.send(b"x")
        loop.add_reader(a.fileno(), on_readable)
        try:
            ran: list[float] = []
            pushed = loop.time()
            queue.push(lambda: ran.append(loop.time()))
            await asyncio.sleep(0.1)
            assert ran == [] and reads > 10  # the socket was served, the item waited
            await _until(lambda: ran)
            assert ran[0] - pushed >= 0.2
            assert queue.overdue == 1
        finally:
            loop.remove_reader(a.fileno())
            a.close()
            b.close()

    asyncio.run(main())


def test_max_items_bounds_the_queue():
    """With the loop never idle, items beyond max_items run anyway, oldest first."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        queue = IdleQueue(max_items=10, max_delay=60.0)
        a, b = socket.socketpair()
        b.send(b"x")
        loop.add_reader(a.fileno(), lambda: None)  # ready until read: the loop is busy
        try:
            ran: list[int] = []
            for i in range(25):
                queue.push(ran.append, i)
            await asyncio.sleep(0.1)
            assert ran == list(range(15)) and len(queue) == 10
            assert queue.overdue == 15
        finally:
            loop.remove_reader(a.fileno())
            a.close()
            b.close()
        await _until(lambda: len(ran) == 25)
        assert ran == list(range(25))

    asyncio.run(main())


def test_drain_runs_everything_now_in_order():
    async def main() -> None:
        queue = IdleQueue()
        ran: list[int] = []
        for i in range(5):
            queue.push(ran.append, i)
        queue.drain()
        assert ran == [0, 1, 2, 3, 4] and len(queue) == 0
        await asyncio.sleep(0.01)  # the scheduled turn finds nothing left
        assert ran == [0, 1, 2, 3, 4]

    asyncio.run(main())


def test_a_failing_item_is_counted_and_the_rest_still_run():
    async def main() -> None:
        queue = IdleQueue()
        ran: list[int] = []
        queue.push(ran.append, 1)
        queue.push(lambda: 1 / 0)
        queue.push(ran.append, 2)
        await _until(lambda: len(ran) == 2)
        assert queue.errors == 1

    asyncio.run(main())


@pytest.mark.parametrize("slice_seconds", [0.0, 0.002])
def test_long_runs_yield_to_the_loop_between_slices(slice_seconds):
    """Items run a slice at a time: a timer due meanwhile runs between them."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        queue = IdleQueue(slice_seconds=slice_seconds)
        order: list[str] = []

        def item() -> None:
            order.append("item")
            end = loop.time() + 0.003
            while loop.time() < end:
                pass

        for _ in range(4):
            queue.push(item)
        loop.call_later(0.001, order.append, "timer")
        await _until(lambda: order.count("item") == 4)
        assert order.index("timer") < 4  # not after all four items

    asyncio.run(main())


def test_on_error_hears_of_each_failing_item():
    heard: list[str] = []
    queue = IdleQueue(on_error=lambda e: heard.append(type(e).__name__))
    queue.push(lambda: {}["missing"])
    queue.push(lambda: None)
    assert heard == ["KeyError"] and queue.errors == 1


def test_a_generator_item_runs_a_step_per_turn_and_nothing_overtakes_it():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        queue = IdleQueue()
        order: list[str] = []

        def stepped():
            for i in range(3):
                order.append(f"step{i}")
                yield

        queue.push(stepped)
        queue.push(order.append, "after")
        loop.call_soon(order.append, "loop")  # other work gets a turn between steps
        await _until(lambda: "after" in order)
        assert [o for o in order if o != "loop"] == ["step0", "step1", "step2", "after"]
        assert order.index("loop") < order.index("step2")

    asyncio.run(main())


def test_drain_finishes_a_generator_under_way():
    async def main() -> None:
        queue = IdleQueue()
        order: list[str] = []

        def stepped():
            order.append("a")
            yield
            order.append("b")

        queue.push(stepped)
        queue.push(order.append, "c")
        queue.drain()
        assert order == ["a", "b", "c"] and len(queue) == 0

    asyncio.run(main())


def test_an_item_of_many_steps_is_overdue_once():
    """A generator item past max_delay runs step by step without waiting for idle: one
    overdue item, however many steps (the metric counts items: at most one an exchange)."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        queue = IdleQueue(max_delay=0.0)
        a, b = socket.socketpair()
        b.send(b"x")
        loop.add_reader(a.fileno(), lambda: None)  # ready until read: the loop is busy
        steps: list[int] = []

        def scan():
            for i in range(50):
                steps.append(i)
                yield

        try:
            queue.push(scan)
            queue.push(steps.append, -1)
            await _until(lambda: len(steps) == 51)
            assert steps == [*range(50), -1]
            assert queue.overdue == 2  # two items, not 51 steps
        finally:
            loop.remove_reader(a.fileno())
            a.close()
            b.close()

    asyncio.run(main())
