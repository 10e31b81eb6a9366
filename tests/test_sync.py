"""vitprune.measure.sync: the wait a timer calls before reading the clock."""

import torch

from vitprune.measure.sync import device_sync


def test_a_cuda_device_is_waited_for_by_its_own_index(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    device = torch.device("cuda", 1)
    wait = device_sync(device)
    assert waited == []  # nothing until called
    wait()
    assert waited == [device]


def test_a_cpu_has_nothing_to_wait_for(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    assert device_sync(torch.device("cpu"))() is None
    assert waited == []
