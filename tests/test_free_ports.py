"""free_ports: the ports handed to our servers are bindable, distinct, outside the range the
kernel hands to outgoing connections, and never handed out twice by one process."""
from __future__ import annotations

import socket

import pytest

from server import launch
from server.launch import PORT_FLOOR, ephemeral_port_range, free_ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    low, _ = ephemeral_port_range()
    ports = free_ports(12)
    assert len(set(ports)) == 12
    if low - PORT_FLOOR >= 1000:
        assert all(PORT_FLOOR <= port < low for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_is_never_handed_out_twice() -> None:
    first = free_ports(50)
    second = free_ports(50)
    assert not set(first) & set(second)


def test_a_port_bound_by_someone_else_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        taken = holder.getsockname()[1]
        # A range holding only the taken port and one more: the taken one must be passed over.
        monkeypatch.setattr(launch, "PORT_FLOOR", taken)
        monkeypatch.setattr(launch, "ephemeral_port_range", lambda: (taken + 2, taken + 100))
        monkeypatch.setattr(launch, "_ports_handed_out", set())
        ports = launch.free_ports(1)
        assert ports != [taken]


def test_falls_back_to_the_kernels_pick_without_room(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "ephemeral_port_range", lambda: (PORT_FLOOR, 60999))
    ports = launch.free_ports(3)
    assert len(set(ports)) == 3
