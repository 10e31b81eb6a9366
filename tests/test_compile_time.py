"""The compile-time benchmark (examples/compile_time.py): its opaque step is the defaults' step
as one custom operator, with the same outputs and records, one call per merging block in a
compiled graph; a setting that runs out of time gets a row that says so."""

import json
import sys
from pathlib import Path

import pytest
import torch

import vitprune
import vitprune.core.state as state_module
from conftest import assert_same_per_stage, images, small_vit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import compile_time  # noqa: E402

opaque_merge = compile_time.make_opaque_merge()


@pytest.mark.parametrize("batch", [1, 3])  # a batch of one indexes its rows another way
def test_opaque_step_gives_the_defaults_outputs_and_records(monkeypatch, batch):
    model = vitprune.patch(small_vit(), keep_rate=0.7)
    x = images(model, batch)
    with torch.inference_mode():
        expected = model(x), vitprune.kept_positions(model), vitprune.token_groups(model)
        monkeypatch.setattr(state_module, "bipartite_merge", opaque_merge)
        got = model(x), vitprune.kept_positions(model), vitprune.token_groups(model)
    assert torch.equal(got[0], expected[0])
    for got_stages, expected_stages in zip(got[1:], expected[1:]):  # kept positions, token groups
        assert_same_per_stage(got_stages, expected_stages, len(vitprune.get_config(model).stages))


@pytest.mark.slow  # compiles; one graph needs torch 2.6 or newer (README), the minimum run is 2.4
def test_a_compiled_graph_calls_the_opaque_step_once_per_merging_block(monkeypatch):
    model = vitprune.patch(small_vit(), keep_rate=0.7)
    x = images(model, 2)
    graphs = []

    def record(graph, inputs):
        graphs.append(graph)
        return graph.forward

    steps = []
    monkeypatch.setattr(state_module, "bipartite_merge", lambda *args: steps.append(args) or opaque_merge(*args))
    with torch.inference_mode():
        eager = model(x)  # counts the blocks that merge
        monkeypatch.setattr(state_module, "bipartite_merge", opaque_merge)
        torch._dynamo.reset()
        out = torch.compile(model, backend=record, fullgraph=True)(x)
    assert len(graphs) == 1
    operator = torch.ops.vitprune_examples.bipartite_merge
    calls = [node for node in graphs[0].graph.nodes if node.target in (operator, operator.default)]
    assert len(calls) == len(steps) > 0
    assert not [node for node in graphs[0].graph.nodes if "sort" in str(node.target)]  # the step's own operations
    torch.testing.assert_close(out, eager)


def test_a_setting_out_of_time_gets_a_row_that_says_so(tmp_path, monkeypatch, capsys):
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["compile_time.py", "--settings", "defaults", "--timeout", "0.01",
                                      "--json", str(out)])
    compile_time.main()
    rows = json.loads(out.read_text())
    assert rows == [{"model": "deit_small_patch16_224", "setting": "defaults", "batch": 32, "device": "cpu",
                     "first_call_s": None, "timed_out_after_s": 0.01}]
    assert "not compiled within 0.01 s" in capsys.readouterr().out
