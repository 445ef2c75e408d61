"""Tests for workspace.buckets: keys, table construction and parsing, lookup, packing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workspace.buckets import BucketError, BucketKey, BucketTable, Pack

# -- BucketKey -----------------------------------------------------------------------------------------


def test_bucket_key_orders_by_budget_then_images():
    assert BucketKey(256, 4) < BucketKey(256, 8) < BucketKey(512, 1)
    assert sorted([BucketKey(1024, 2), BucketKey(256, 16)])[0].budget == 256


@pytest.mark.parametrize("budget, max_images", [(0, 1), (-4, 1), (256, 0), (256, -1), (2.0, 1), ("256", 1)])
def test_bucket_key_rejects_non_positive_or_non_int(budget, max_images):
    with pytest.raises(BucketError, match="positive int"):
        BucketKey(budget, max_images)


def test_bucket_key_rejects_bool_and_error_is_value_error():
    with pytest.raises(ValueError):
        BucketKey(True, 1)


def test_bucket_key_is_frozen():
    key = BucketKey(256, 4)
    with pytest.raises(AttributeError):
        key.budget = 512


# -- BucketTable construction -----------------------------------------------------------------------------


def test_table_sorts_and_exposes_keys():
    table = BucketTable([BucketKey(4096, 64), BucketKey(256, 4), BucketKey(1024, 16)])
    assert [k.budget for k in table] == [256, 1024, 4096]
    assert table.keys == (BucketKey(256, 4), BucketKey(1024, 16), BucketKey(4096, 64))
    assert table.largest == BucketKey(4096, 64)
    assert len(table) == 3
    assert "BucketKey(budget=256, max_images=4)" in repr(table)
    assert table == BucketTable(reversed(table.keys))


@pytest.mark.parametrize(
    "keys, message",
    [
        ([], "at least one"),
        ([BucketKey(256, 4), BucketKey(256, 8)], "duplicate"),
        ([BucketKey(256, 8), BucketKey(512, 4)], "must not decrease"),
    ],
)
def test_table_rejects_bad_key_sets(keys, message):
    with pytest.raises(BucketError, match=message):
        BucketTable(keys)


def test_table_is_immutable():
    table = BucketTable.from_budgets([256])
    with pytest.raises(AttributeError):
        table._keys = ()


def test_from_budgets_default_and_custom_max_images():
    assert BucketTable.from_budgets([16, 256, 8]).keys == (
        BucketKey(8, 1),  # max(1, 8 // 16)
        BucketKey(16, 1),
        BucketKey(256, 16),
    )
    assert BucketTable.from_budgets([256], min_patches_per_image=64).keys == (BucketKey(256, 4),)
    assert BucketTable.from_budgets([256, 512], max_images=3).keys == (BucketKey(256, 3), BucketKey(512, 3))
    table = BucketTable.from_budgets([256, 512], max_images=lambda b: b // 128)
    assert table.keys == (BucketKey(256, 2), BucketKey(512, 4))


def test_from_budgets_granule():
    assert len(BucketTable.from_budgets([256, 1028], granule=4)) == 2
    with pytest.raises(BucketError, match="multiple of the granule 4"):
        BucketTable.from_budgets([256, 1030], granule=4)
    with pytest.raises(BucketError, match="granule"):
        BucketTable.from_budgets([256], granule=0)


def test_from_budgets_rejects_bad_max_images_from_callable():
    with pytest.raises(BucketError, match="max_images for budget 256"):
        BucketTable.from_budgets([256], max_images=lambda b: 0)


def test_powers_of_two():
    table = BucketTable.powers_of_two(256, 4096, max_images=8)
    assert [k.budget for k in table] == [256, 512, 1024, 2048, 4096]
    assert all(k.max_images == 8 for k in table)
    assert [k.budget for k in BucketTable.powers_of_two(64, 64)] == [64]
    with pytest.raises(BucketError, match="power of two"):
        BucketTable.powers_of_two(256, 3000)
    with pytest.raises(BucketError, match="larger than"):
        BucketTable.powers_of_two(512, 256)
    with pytest.raises(BucketError, match="granule"):
        BucketTable.powers_of_two(2, 16, granule=4)


# -- parse ----------------------------------------------------------------------------------------------


def test_parse_forms_agree():
    expected = BucketTable.from_budgets([256, 1024, 4096])
    assert BucketTable.parse([256, 1024, 4096]) == expected
    assert BucketTable.parse("256,1024,4096") == expected
    assert BucketTable.parse(" 4096 , 256,1024 ") == expected
    pow2 = BucketTable.parse("pow2:256-32768")
    assert [k.budget for k in pow2] == [256 << i for i in range(8)]
    assert BucketTable.parse("POW2: 256 - 1024") == BucketTable.from_budgets([256, 512, 1024])
    assert BucketTable.parse("256,1024", max_images=2).keys == (BucketKey(256, 2), BucketKey(1024, 2))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "not a positive integer"),
        ("256,,1024", "not a positive integer"),
        ("256,1024,", "not a positive integer"),
        ("256;1024", "not a positive integer"),
        ("256,abc", "'abc'"),
        ("-256,1024", "not a positive integer"),
        ("256.0", "not a positive integer"),
        ("0,256", "positive int"),
        ("256,256", "duplicate"),
        ("pow2:256", "pow2:MIN-MAX"),
        ("pow2:a-b", "pow2:MIN-MAX"),
        ("pow2:256-1024-4096", "pow2:MIN-MAX"),
        ("pow2:1024-256", "larger than"),
        ("pow2:256-1000", "power of two"),
        ([], "at least one"),
        ([256, "1024"], "positive int"),
        (1024, "bad bucket spec 1024"),  # a single budget, not a spec: was a bare TypeError
        (b"256", "bad bucket spec b'256'"),  # was read as the character codes: budgets 50, 53, 54
        (None, "bad bucket spec None"),
    ],
)
def test_parse_errors(spec, message):
    with pytest.raises(BucketError, match=message):
        BucketTable.parse(spec)


def test_parse_forwards_granule():
    with pytest.raises(BucketError, match="granule"):
        BucketTable.parse("256,1026", granule=4)


# -- bucket_for ---------------------------------------------------------------------------------------------

TABLE = BucketTable([BucketKey(256, 4), BucketKey(1024, 8), BucketKey(4096, 8)])


@pytest.mark.parametrize(
    "total, images, expected",
    [
        (1, 1, BucketKey(256, 4)),
        (256, 4, BucketKey(256, 4)),
        (257, 1, BucketKey(1024, 8)),
        (100, 5, BucketKey(1024, 8)),  # fits 256 by patches, not by image count
        (4096, 8, BucketKey(4096, 8)),
        (4097, 1, None),
        (10, 9, None),
    ],
)
def test_bucket_for(total, images, expected):
    assert TABLE.bucket_for(total, images) == expected


# -- pack: unit cases ------------------------------------------------------------------------------------


def test_pack_empty_and_single_run():
    assert TABLE.pack([]) == []
    assert TABLE.pack([100, 100]) == [Pack(BucketKey(256, 4), (0, 1), 200)]
    assert TABLE.pack([100, 100])[0].padded == 56


def test_pack_run_exactly_at_largest_budget_is_one_pack():
    assert TABLE.pack([2048, 2048]) == [Pack(BucketKey(4096, 8), (0, 1), 4096)]


def test_pack_budget_plus_one_splits_greedily():
    assert TABLE.pack([2048, 2048, 1]) == [
        Pack(BucketKey(4096, 8), (0, 1), 4096),
        Pack(BucketKey(256, 4), (2,), 1),
    ]
    assert TABLE.pack([2048, 2049]) == [
        Pack(BucketKey(4096, 8), (0,), 2048),
        Pack(BucketKey(4096, 8), (1,), 2049),
    ]


def test_pack_far_above_largest_budget():
    packs = TABLE.pack([1000] * 10)  # 4 images per 4096 run
    assert [p.indices for p in packs] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    assert [p.key for p in packs] == [BucketKey(4096, 8), BucketKey(4096, 8), BucketKey(4096, 8)]


def test_pack_at_and_above_max_images():
    assert TABLE.pack([1] * 8) == [Pack(BucketKey(1024, 8), tuple(range(8)), 8)]
    assert TABLE.pack([1] * 9) == [
        Pack(BucketKey(1024, 8), tuple(range(8)), 8),
        Pack(BucketKey(256, 4), (8,), 1),
    ]
    assert [len(p.indices) for p in TABLE.pack([1] * 17)] == [8, 8, 1]


def test_pack_oversize_image_is_eager_and_keeps_order():
    packs = TABLE.pack([10, 5000, 20, 30, 4097])
    assert packs == [
        Pack(BucketKey(256, 4), (0,), 10),
        Pack(None, (1,), 5000),
        Pack(BucketKey(256, 4), (2, 3), 50),
        Pack(None, (4,), 4097),
    ]
    assert packs[1].padded == 0


@pytest.mark.parametrize("counts", [[0], [10, -1], [10, 2.5], [10, None]])
def test_pack_rejects_bad_counts(counts):
    with pytest.raises(BucketError, match=f"image {len(counts) - 1}"):
        TABLE.pack(counts)


def test_pack_validates_its_own_fit():
    with pytest.raises(BucketError, match="do not fit"):
        Pack(BucketKey(256, 4), (0,), 257)
    with pytest.raises(BucketError, match="do not fit"):
        Pack(BucketKey(256, 1), (0, 1), 2)
    with pytest.raises(BucketError, match="at least one"):
        Pack(None, (), 0)


# -- pack: properties -------------------------------------------------------------------------------------


@st.composite
def tables(draw):
    budgets = sorted(draw(st.sets(st.integers(1, 64), min_size=1, max_size=6)))
    images = sorted(draw(st.lists(st.integers(1, 6), min_size=len(budgets), max_size=len(budgets))))
    return BucketTable(BucketKey(b, m) for b, m in zip(budgets, images, strict=True))


def reference_pack(table, counts):
    """Independent O(n*b) greedy: extend the run while SOME bucket takes it (linear scan), then pick the
    smallest fitting bucket by scanning all keys."""

    def smallest(total, n):
        fitting = [k for k in table.keys if k.budget >= total and k.max_images >= n]
        return min(fitting, key=lambda k: k.budget) if fitting else None

    out, run = [], []
    for i, c in enumerate(counts):
        if smallest(c, 1) is None:
            if run:
                out.append(Pack(smallest(sum(counts[j] for j in run), len(run)), tuple(run), 0))
            out.append(Pack(None, (i,), c))
            run = []
        elif smallest(sum(counts[j] for j in run) + c, len(run) + 1) is None:
            out.append(Pack(smallest(sum(counts[j] for j in run), len(run)), tuple(run), 0))
            run = [i]
        else:
            run.append(i)
    if run:
        out.append(Pack(smallest(sum(counts[j] for j in run), len(run)), tuple(run), 0))
    return [(p.key, p.indices) for p in out]


@settings(max_examples=600, deadline=None)
@given(table=tables(), counts=st.lists(st.integers(1, 80), max_size=40))
def test_pack_properties(table, counts):
    packs = table.pack(counts)
    flat = [i for p in packs for i in p.indices]
    # Exactly once, in input order within and across packs.
    assert flat == list(range(len(counts)))
    cap = table.largest
    for n, p in enumerate(packs):
        assert p.total == sum(counts[i] for i in p.indices)
        if p.key is None:
            assert p.indices and len(p.indices) == 1 and p.total > cap.budget
            assert p.padded == 0
            continue
        assert p.key in table.keys
        assert p.total <= p.key.budget and len(p.indices) <= p.key.max_images
        assert p.padded == p.key.budget - p.total >= 0
        # No smaller bucket would take this pack.
        assert all(not k.fits(p.total, len(p.indices)) for k in table.keys if k < p.key)
        # Greedy maximality: the next image would not have fit the largest bucket with this run.
        if n + 1 < len(packs) and packs[n + 1].key is not None:
            nxt = counts[packs[n + 1].indices[0]]
            assert p.total + nxt > cap.budget or len(p.indices) + 1 > cap.max_images
    assert [(p.key, p.indices) for p in packs] == reference_pack(table, counts)


@settings(max_examples=300, deadline=None)
@given(table=tables(), total=st.integers(1, 80), n=st.integers(1, 8))
def test_bucket_for_matches_linear_scan(table, total, n):
    fitting = [k for k in table.keys if k.budget >= total and k.max_images >= n]
    assert table.bucket_for(total, n) == (fitting[0] if fitting else None)
