"""Fine-tuning a patched model on 2 CPU processes (gloo), each on its half of every batch,
under DistributedDataParallel (``find_unused_parameters=False``) or sharded by
``fully_shard`` (FSDP2), gives the single-process result on the whole batch: the defaults
(merging in every block, the class token alone in the last) and the paper's method."""

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
METHODS = {"defaults": {}, "paper": {"indicator": "var", "stages": (1, 2)}}
fully_shard = getattr(getattr(dist, "fsdp", None), "fully_shard", None)  # public from torch 2.6


def make_model(method):
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", img_size=64, depth=4, embed_dim=64, num_heads=4, num_classes=5)
    return vitprune.patch(model, keep_rate=0.6, **METHODS[method])


def distribute(model, how):
    """``model`` under DDP, or sharded block by block and whole (FSDP2: in place)."""
    if how == "ddp":
        return DistributedDataParallel(model, find_unused_parameters=False)
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def full_state(model):
    """The state dict with every sharded tensor gathered whole (a collective: every rank calls it)."""
    return {name: value.full_tensor() if hasattr(value, "full_tensor") else value
            for name, value in model.state_dict().items()}


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


def worker(rank, port, out, method, how):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = make_model(method).train()
        train(distribute(model, how), batches(), rank, WORLD)
        torch.save(full_state(model), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("how", ["ddp", "fsdp2"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_two_processes_match_one_process_on_the_whole_batch(tmp_path, method, how):
    if how == "fsdp2" and fully_shard is None:
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard")
    mp.spawn(worker, args=(free_port(), str(tmp_path), method, how), nprocs=WORLD, join=True)
    reference = make_model(method).train()
    train(reference, batches())
    expected = reference.state_dict()
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5, msg=f"rank {rank}: {name}")
