"""The rendezvous port: never handed to a second job while the first may still be binding it."""

import socket

import torch.distributed as dist

from orchestrator.rank_tasks import free_port


def _bind_any() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_a_rendezvous_port_is_not_handed_out_again_yet_the_store_can_bind_it():
    """A bound-and-released port came straight back from the next bind(0) (two jobs launched
    together shared a store and hung). free_port leaves its port in TIME_WAIT: later picks, ours or
    any process's bind(0), skip it, while torch's TCP store still binds it."""
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert not {_bind_any() for _ in range(3000)} & set(ports)
    store = dist.TCPStore("127.0.0.1", ports[0], 1, True, wait_for_workers=False)
    store.set("rendezvous", "ok")
    assert store.port == ports[0] and store.get("rendezvous") == b"ok"
