"""The sweep of every timm ViT model name (examples/timm_sweep.py): its checks and its verdict."""

import sys
from pathlib import Path

import pytest
import timm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import timm_sweep  # noqa: E402


def test_a_patchable_model_passes_every_check():
    record = timm_sweep.check("test_vit", depth=2, fvcore_max_width=1024)
    assert record["depth"] == 2 and record["class"] == "VisionTransformer"
    assert record["keep1_error"] < 1e-5 and record["unpatch_error"] == 0
    assert record["unpatch_state"] and record["unpatch_class"]
    assert record["defaults_finite"] and record["paper_finite"]
    assert all(0.99 < record[f"flops_{label}"] < 1.01 for label in ("unpruned", "defaults", "paper"))
    assert timm_sweep.passed(record, tolerance=1e-4) is True


def test_a_variant_is_built_with_its_options_and_named_by_them():
    options = dict(use_shared_rel_pos_bias=True, use_rel_pos_bias=False)  # failed after a stage until stop 50
    record = timm_sweep.check("beit_base_patch16_224", depth=2, fvcore_max_width=0, options=options)
    assert record["name"] == "beit_base_patch16_224(use_shared_rel_pos_bias=True, use_rel_pos_bias=False)"
    assert record["class"] == "Beit" and timm_sweep.passed(record, tolerance=1e-4) is True
    text = timm_sweep.summary([record], ["beit"], "cmd", 1e-4, variants=True)
    assert text.startswith("# timm ViT variants through vitprune") and "**1 variants (one constructor" in text


def test_every_variant_names_a_model_of_the_swept_modules():
    for name, options in timm_sweep.VARIANTS.items():
        if timm.is_model(name):  # older timm releases lack some
            assert timm.models._registry._model_to_module[name] in timm_sweep.MODULES
        assert options and all(options), name


def test_a_refused_model_is_recorded_untouched_with_its_reason():
    record = timm_sweep.check("samvit_base_patch16_224", depth=1, fvcore_max_width=0)
    assert record["refused"].startswith("TypeError: vitprune cannot patch")
    assert "windowed attention" in record["refused"] and record["untouched"] is True
    assert "flops_unpruned" not in record  # wider than fvcore_max_width: not traced
    assert timm_sweep.passed(record, tolerance=1e-4) is None


def test_any_failed_check_fails_the_model_and_the_summary_lists_it():
    good = {"name": "a", "keep1_error": 1e-7, "defaults_finite": True, "paper_finite": True, "unpatch_error": 0.0,
            "unpatch_state": True, "unpatch_class": True, "flops_unpruned": 0.998}
    assert timm_sweep.passed(good, 1e-4)
    for key, value in (("keep1_error", 1e-3), ("paper_finite", False), ("unpatch_error", 1e-9),
                       ("unpatch_state", False), ("flops_unpruned", 0.985)):
        assert not timm_sweep.passed({**good, key: value}, 1e-4), key
    text = timm_sweep.summary([good, {**good, "name": "b", "unpatch_state": False},
                               {"name": "c", "refused": "TypeError: no", "untouched": True}], ["deit"], "cmd", 1e-4)
    assert "**2 patched**; of those, 1 pass every check" in text and "- `b`: " in text
    assert "**1 refused**" in text and "- no (1: `c`)" in text
    assert "counted on a model `patch` refuses" not in text
    counted = {"name": "d", "refused": "TypeError: no", "untouched": True, "flops_unpruned": 0.89}
    assert "counted on a model `patch` refuses:** `d`" in timm_sweep.summary([counted], ["vit"], "cmd", 1e-4)


@pytest.mark.skipif(not timm.is_model("vit_large_patch16_sapiens2"), reason=f"timm {timm.__version__} has no Sapiens2")
def test_per_block_settings_come_from_evenly_spaced_blocks_of_the_own_depth():
    # Sapiens2-L: 24 blocks, grouped key/value heads (8 of 16) in blocks 8 to 15 only
    assert timm_sweep.per_block_options("vit_large_patch16_sapiens2", 3) == {"num_kv_heads": (16, 8, 16)}
    model, depth, per_block = timm_sweep.build("vit_large_patch16_sapiens2", 3)
    assert depth == 3 and [block.attn.num_kv_heads for block in model.blocks] == [16, 8, 16]
    assert per_block == {"num_kv_heads": (16, 8, 16)}
    assert timm_sweep.build("test_vit", 2)[1:] == (2, {})  # no per-block setting: none read


@pytest.mark.skipif(not timm.is_model("vit_base_patch16_sapiens2"), reason=f"timm {timm.__version__} has no Sapiens2")
def test_a_model_with_per_block_settings_is_checked_at_the_depth_and_listed():
    # timm refuses depth=2 for Sapiens2 unless its key/value heads are given per block
    record = timm_sweep.check("vit_base_patch16_sapiens2", depth=2, fvcore_max_width=0)
    assert record["depth"] == 2 and record["per_block"] == {"num_kv_heads": [12, 12]}
    assert timm_sweep.passed(record, tolerance=1e-4) is True
    text = timm_sweep.summary([record], ["eva"], "cmd", 1e-4)
    assert "own depth, first and last among them: `vit_base_patch16_sapiens2` (num_kv_heads=(12, 12))." in text


def test_a_model_timm_cannot_build_at_the_depth_is_recorded_apart(monkeypatch):
    def unbuildable(name, depth, options=None):
        raise AssertionError("num_kv_heads sequence must have one entry per block")

    monkeypatch.setattr(timm_sweep, "build", unbuildable)
    record = timm_sweep.check("m", depth=2, fvcore_max_width=0)
    assert record == {"name": "m", "unbuilt": "AssertionError: num_kv_heads sequence must have one entry per block"}
    text = timm_sweep.summary([record], ["eva"], "cmd", 1e-4)
    assert "**0 raised an unexpected error.**" in text and "not checked here: `m` (the first one's error: " \
        "AssertionError: num_kv_heads" in text
