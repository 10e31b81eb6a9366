"""Fine-tuning a patched model under DistributedDataParallel: 2 CPU processes (gloo),
``find_unused_parameters=False``, gives the single-process result on the whole batch."""

import os
import socket

import pytest
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import vitprune

WORLD, STEPS, BATCH = 2, 3, 8


def make_model():
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", img_size=64, depth=4, embed_dim=64, num_heads=4, num_classes=5)
    return vitprune.patch(model, indicator="var", keep_rate=0.6, stages=(1, 2))


def batches():
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, 3, 64, 64, generator=generator), torch.randint(0, 5, (BATCH,), generator=generator))
            for _ in range(STEPS)]


def train(model, data, rank=0, world=1):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    share = BATCH // world
    for x, y in data:
        loss = torch.nn.functional.cross_entropy(model(x[rank * share:(rank + 1) * share]),
                                                 y[rank * share:(rank + 1) * share])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = make_model().train()
        train(DistributedDataParallel(model, find_unused_parameters=False), batches(), rank, WORLD)
        torch.save(model.state_dict(), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_ddp_two_processes_match_one_process_on_the_whole_batch(tmp_path):
    mp.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    reference = make_model().train()
    train(reference, batches())
    expected = reference.state_dict()
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5, msg=f"rank {rank}: {name}")
