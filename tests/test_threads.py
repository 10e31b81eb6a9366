"""Several threads running one patched model at once (an inference server sharing a model
across workers): every output, and every thread's ``kept_positions`` and ``token_groups``,
equal what the same forward gives alone."""

import threading

import pytest
import torch

import vitprune
from conftest import FAMILIES, assert_same_per_stage, build, images, paper

THREADS, FORWARDS = 4, 3


def run_together(model, inputs):
    """Each thread runs its inputs in turn, all threads starting at once; returns per thread
    a list of (output, kept positions, token groups) in input order."""
    start = threading.Barrier(len(inputs))
    results = [None] * len(inputs)
    errors = []

    def work(index):
        try:
            start.wait()
            mine = []
            for x in inputs[index]:
                with torch.no_grad():
                    out = model(x)
                mine.append((out, vitprune.kept_positions(model), vitprune.token_groups(model)))
            results[index] = mine
        except Exception as error:  # re-raised below, in the test's thread
            errors.append(error)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("options", [dict(keep_rate=0.5), paper(indicator="var", keep_rate=0.5, stages=(1, 2))],
                         ids=["defaults", "paper"])
@pytest.mark.parametrize("name", FAMILIES)
def test_threads_sharing_a_patched_model_get_their_own_results(name, options):
    model = vitprune.patch(build(name), **options)
    inputs = [[images(model, batch=2, seed=10 * t + f) for f in range(FORWARDS)] for t in range(THREADS)]
    expected = []
    for batch in inputs:
        mine = []
        for x in batch:
            with torch.no_grad():
                mine.append((model(x), vitprune.kept_positions(model), vitprune.token_groups(model)))
        expected.append(mine)
    got = run_together(model, inputs)
    stages = len(vitprune.get_config(model).stages)
    for thread_expected, thread_got in zip(expected, got):
        for (out, kept, groups), (out_t, kept_t, groups_t) in zip(thread_expected, thread_got):
            torch.testing.assert_close(out_t, out, rtol=1e-5, atol=1e-6)
            assert_same_per_stage(kept_t, kept, stages)
            assert_same_per_stage(groups_t, groups, stages)


@pytest.mark.parametrize("options", [dict(keep_rate=0.5), paper(indicator="var", keep_rate=0.5, stages=(1, 2))],
                         ids=["defaults", "paper"])
@pytest.mark.parametrize("name", ["DINOv2", "Eva02 (rope, SwiGLU, avg pool)", "BEiT (relative position bias)"])
def test_gradient_checkpointing_with_the_backward_on_another_thread(name, options):
    """Autograd runs the backward of CUDA tensors on a thread of its own, where gradient
    checkpointing recomputes the blocks: they must read the forward's records (size bias,
    kept positions, the class-token shortcut) there too, and give the gradients of the
    same model without checkpointing."""
    model = vitprune.patch(build(name), **options).train()
    reference = vitprune.patch(build(name), **options).train()
    model.set_grad_checkpointing(True)
    x = images(model, batch=2)
    reference(x).square().mean().backward()
    loss, finished = model(x).square().mean(), []

    def backward():
        loss.backward()
        finished.append(True)

    worker = threading.Thread(target=backward)
    worker.start()
    worker.join()
    assert finished  # the backward ran to the end on that thread (an error there is printed, not raised)
    for (label, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=label)
