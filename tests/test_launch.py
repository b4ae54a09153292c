"""overlapc.launch: results come back by rank, a raising rank's exception and
traceback come back, a dead or hung rank is named and every rank is ended
within the deadline, progress messages arrive in order."""
import os
import signal
import time

import pytest

from overlapc import launch


def _sum_of_ranks(rank, world_size, scale):
    import torch
    import torch.distributed as dist
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)   # the launcher joined the gloo group
    time.sleep(0.5 * (world_size - 1 - rank))   # rank 0 finishes last: order is not arrival order
    return rank * scale, int(total.item()), os.environ["WORLD_SIZE"]


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise KeyError("the value rank 1 looked for")
    return rank


def _die_on_rank_1(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(300)


def _hang_on_rank_0(rank, world_size):
    launch.progress(("pid", os.getpid()))
    if rank == 0:
        _wait_forever()
    return rank


def _wait_forever():
    while True:
        time.sleep(0.1)


def _count_out_loud(rank, world_size, n):
    for i in range(n):
        launch.progress((rank, i))
    return "done"


def test_results_come_back_in_rank_order_with_the_group_joined():
    assert launch.run(_sum_of_ranks, 3, (10,), timeout=180) == [(0, 3, "3"), (10, 3, "3"), (20, 3, "3")]


@pytest.fixture
def taken_port():
    """A port on 127.0.0.1 that a socket of this process holds bound and listening."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_a_port_taken_before_the_ranks_join_is_replaced(monkeypatch, taken_port):
    """The port ``free_port`` picked is bound by someone else by the time rank 0 listens
    on it (EADDRINUSE): the launcher ends that attempt and joins on a new port."""
    ports = [taken_port]
    original = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda: ports.pop(0) if ports else original())
    assert launch.run(_sum_of_ranks, 2, (1,), timeout=180) == [(0, 1, "2"), (1, 1, "2")]
    assert ports == []   # the taken port was tried first


def test_a_port_taken_every_time_fails_naming_it(monkeypatch, taken_port):
    monkeypatch.setattr(launch, "free_port", lambda: taken_port)
    with pytest.raises(Exception, match="EADDRINUSE"):
        launch.run(_sum_of_ranks, 2, (1,), timeout=180)


def test_a_raising_rank_is_reraised_with_its_traceback():
    with pytest.raises(KeyError, match="the value rank 1 looked for") as caught:
        launch.run(_raise_on_rank_1, 2, gloo=False, timeout=120)
    cause = caught.value.__cause__
    assert isinstance(cause, launch.RemoteTraceback) and cause.rank == 1
    assert "traceback of rank 1" in str(cause) and "_raise_on_rank_1" in str(cause)


def test_a_dead_rank_is_named_and_the_others_ended():
    begin = time.monotonic()
    with pytest.raises(launch.RankFailure, match=r"rank 1 died: killed by signal SIGKILL") as caught:
        launch.run(_die_on_rank_1, 2, gloo=False, timeout=120)
    assert caught.value.ranks == [1] and caught.value.how == "died"
    assert time.monotonic() - begin < 100   # rank 0 sleeps 300 s: it was killed, not waited for


def test_a_hung_rank_is_named_its_stack_dumped_and_every_rank_killed(capfd):
    pids = []
    begin = time.monotonic()
    with pytest.raises(launch.RankFailure, match=r"rank\(s\) \[0\] hung: no result after 20 s") as caught:
        launch.run(_hang_on_rank_0, 2, gloo=False, timeout=20,
                   on_message=lambda rank, message: pids.append(message[1]))
    assert time.monotonic() - begin < 20 + 15
    assert caught.value.ranks == [0] and caught.value.how == "hung"
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "_wait_forever" in capfd.readouterr().err   # faulthandler's dump of the hung rank


def test_progress_messages_arrive_in_order_before_the_results():
    seen = []
    assert launch.run(_count_out_loud, 2, (5,), gloo=False, timeout=120,
                      on_message=lambda rank, message: seen.append((rank, message))) == ["done", "done"]
    for rank in (0, 1):
        assert [m for r, m in seen if r == rank] == [(rank, i) for i in range(5)]


def test_progress_outside_a_rank_sends_nothing():
    assert launch.progress("hello") is False


def test_only_module_level_functions_are_launched():
    with pytest.raises(ValueError, match="module-level function"):
        launch.run(lambda rank, world_size: rank, 2, gloo=False)
