"""`workspace.tables`: the one resolver of a process's bucket table (no model loaded)."""

from __future__ import annotations

import pytest

from workspace.buckets import MAX_BUDGET, BucketError, BucketKey, BucketTable, default_table
from workspace.tables import (
    DEVICE_DEFAULTS,
    TowerShape,
    engine_table,
    process_plan,
    router_fallback_table,
)

QWEN = TowerShape(merge_unit=4, unit_patches=256)  # patch 14: a 224x224 image is 256 patches
QWEN3 = TowerShape(merge_unit=4, unit_patches=196)  # patch 16
CLIP = TowerShape(merge_unit=1, unit_patches=256, patches_per_image=256)


def test_the_engine_default_is_powers_of_two_on_the_models_unit_up_to_the_bound():
    assert engine_table(QWEN) == default_table() and engine_table(QWEN).largest.budget == MAX_BUDGET
    assert engine_table(QWEN3).keys[0].budget == 196 and engine_table(QWEN3).largest.budget == 196 * 128
    assert engine_table(QWEN, max_graph_tokens=8192).largest.budget == 8192  # sdpa's cap
    assert engine_table(QWEN, max_graph_tokens=10**6) == engine_table(QWEN)  # never above MAX_BUDGET
    fixed = engine_table(CLIP)
    assert [k.max_images for k in fixed] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert all(k.budget == 256 * k.max_images for k in fixed)
    assert engine_table(CLIP, max_graph_tokens=8192).largest == BucketKey(8192, 32)


def test_a_given_spec_is_the_table_whatever_the_cap():
    assert engine_table(QWEN, "256,1024", max_graph_tokens=512).keys == (BucketKey(256, 16), BucketKey(1024, 64))
    assert engine_table(QWEN, "256,1024", max_images=2).largest == BucketKey(1024, 2)
    assert engine_table(QWEN, [(256, 1), (512, 2)]).keys == (BucketKey(256, 1), BucketKey(512, 2))
    table = BucketTable.parse("512")
    assert engine_table(QWEN, table) is table
    assert engine_table(CLIP, "256,1024").keys == (BucketKey(256, 1), BucketKey(1024, 4))  # whole images
    with pytest.raises(BucketError, match="granule"):
        engine_table(QWEN, "258")


def test_max_images_alone_keeps_the_default_budgets_capped():
    assert engine_table(QWEN, max_images=4).largest == BucketKey(MAX_BUDGET, 4)
    assert engine_table(QWEN, max_images=4, max_graph_tokens=8192).largest == BucketKey(8192, 4)
    # patch 16 (Qwen3-VL / 3.5): the model's own budgets, 196 * 2^k; broken, they became pow2:256-32768
    budgets = [key.budget for key in engine_table(QWEN3)]
    assert budgets[0] == 196 and budgets[-1] == 25088
    assert engine_table(QWEN3, max_images=8).keys == tuple(BucketKey(b, 8) for b in budgets)
    assert process_plan(QWEN3, "cuda", bucket_max_images=8).table == engine_table(QWEN3, max_images=8)


def test_a_process_gets_its_devices_defaults_where_the_operator_set_none():
    cpu, gpu = process_plan(QWEN, "cpu"), process_plan(QWEN, "cuda:0")
    spec = DEVICE_DEFAULTS["cpu"]
    assert cpu.table == BucketTable.parse(spec.buckets, max_images=spec.bucket_max_images, granule=4)
    assert (cpu.max_batch_patches, cpu.max_batch_images) == (8192, 32)
    assert gpu.table == engine_table(QWEN) and (gpu.max_batch_patches, gpu.max_batch_images) == (32768, 256)
    # the operator's values win; the CPU batch defaults go with the CPU default table only
    own = process_plan(QWEN, "cpu", "256,512")
    assert own.table.keys == (BucketKey(256, 16), BucketKey(512, 32)) and own.max_batch_patches == 512
    assert process_plan(QWEN, "cpu", bucket_max_images=2).table.largest == BucketKey(1024, 2)
    assert process_plan(QWEN, "cuda", max_batch_patches=1000, max_batch_images=3).max_batch_patches == 1000
    assert process_plan(QWEN, "cuda", max_graph_tokens=8192).max_batch_patches == 8192


def test_the_router_falls_back_to_the_engine_default():
    assert router_fallback_table() == default_table()
