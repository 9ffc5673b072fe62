import pickle

import pytest
import torch

from nemo_like.distributed import BatchedDataDict


def make(n: int = 8) -> BatchedDataDict:
    return BatchedDataDict(
        ids=torch.arange(n),
        tok=torch.arange(n * 3).reshape(n, 3),
        text=[f"s{i}" for i in range(n)],
    )


def ids(b: BatchedDataDict) -> list[int]:
    return b["ids"].tolist()


def test_size_and_value_types():
    b = make(5)
    assert b.size == 5
    assert BatchedDataDict().size == 0
    with pytest.raises(TypeError, match="'x'.*0-d tensor"):
        BatchedDataDict(x=torch.tensor(1.0))
    with pytest.raises(TypeError, match="'y'.*int"):
        b["y"] = 3
    with pytest.raises(TypeError, match="'z'.*str"):
        b.update(z="abc")
    with pytest.raises(TypeError, match="keys must be str"):
        BatchedDataDict({1: [1]})
    b["bad"] = [1, 2]
    with pytest.raises(ValueError, match=r"'ids': 5.*'bad': 2"):
        _ = b.size


def test_from_batches_pads_dim1_per_key():
    a = BatchedDataDict(
        input_ids=torch.tensor([[1, 2, 3]]), mask=torch.tensor([[1, 1, 1]]), r=torch.tensor([0.5]), m=["a"]
    )
    b = BatchedDataDict(
        input_ids=torch.tensor([[4], [5]]), mask=torch.tensor([[1], [1]]), r=torch.tensor([1.0, 2.0]), m=["b", "c"]
    )
    out = BatchedDataDict.from_batches([a, b], pad_value_dict={"input_ids": 9})
    assert isinstance(out, BatchedDataDict)
    assert out.size == 3
    assert out["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9], [5, 9, 9]]
    assert out["mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 0, 0]]  # default pad 0
    assert out["r"].tolist() == [0.5, 1.0, 2.0]
    assert out["m"] == ["a", "b", "c"]
    # plain dicts are accepted too; 3-D tensors pad dim 1 only
    x = BatchedDataDict.from_batches([{"h": torch.ones(1, 1, 2)}, {"h": torch.ones(1, 2, 2)}])
    assert x["h"].shape == (2, 2, 2) and x["h"][0, 1].tolist() == [0.0, 0.0]


def test_from_batches_errors():
    with pytest.raises(ValueError, match="non-empty"):
        BatchedDataDict.from_batches([])
    with pytest.raises(ValueError, match="batch 1 has keys"):
        BatchedDataDict.from_batches([{"a": [1]}, {"b": [1]}])
    with pytest.raises(TypeError, match="'a' mixes tensors and lists"):
        BatchedDataDict.from_batches([{"a": [1]}, {"a": torch.tensor([1])}])
    with pytest.raises(ValueError, match="'a' tensors differ beyond dim 1"):
        BatchedDataDict.from_batches([{"a": torch.zeros(1, 2, 3)}, {"a": torch.zeros(1, 2, 4)}])


def test_shard_contiguous():
    shards = make(8).shard_by_batch_size(2)
    assert [ids(s) for s in shards] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shards[1]["text"] == ["s4", "s5", "s6", "s7"]
    assert shards[1]["tok"].tolist() == [[12, 13, 14], [15, 16, 17], [18, 19, 20], [21, 22, 23]]
    with pytest.raises(ValueError, match="7 is not divisible by the number of shards 2"):
        make(7).shard_by_batch_size(2)
    with pytest.raises(ValueError, match="shards must be a positive int"):
        make(8).shard_by_batch_size(0)


def test_shard_with_batch_size_spreads_each_global_batch():
    b = make(12)
    shards = b.shard_by_batch_size(2, batch_size=4)
    # global batches [0..3], [4..7], [8..11]; each split in half, half i -> shard i
    assert [ids(s) for s in shards] == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]
    assert shards[1]["text"] == ["s2", "s3", "s6", "s7", "s10", "s11"]
    assert shards[0]["tok"][2].tolist() == [12, 13, 14]
    # batch_size == size degenerates to contiguous sharding
    assert [ids(s) for s in b.shard_by_batch_size(3, batch_size=12)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    with pytest.raises(ValueError, match="12 is not divisible by batch_size 5"):
        b.shard_by_batch_size(2, batch_size=5)
    with pytest.raises(ValueError, match="batch_size 6 is not divisible by the number of shards 4"):
        b.shard_by_batch_size(4, batch_size=6)
    # shards re-join to the original order when there is one global batch
    joined = BatchedDataDict.from_batches(b.shard_by_batch_size(4))
    assert ids(joined) == list(range(12)) and joined["text"] == b["text"]


def test_slice_select_repeat():
    b = make(6)
    assert ids(b.slice(2, 4)) == [2, 3] and b.slice(2, 4)["text"] == ["s2", "s3"]
    with pytest.raises(ValueError, match=r"slice\(4, 8\) is out of range for batch size 6"):
        b.slice(4, 8)
    sel = b.select_indices([5, 0, 5])
    assert ids(sel) == [5, 0, 5] and sel["text"] == ["s5", "s0", "s5"]
    assert ids(b.select_indices(torch.tensor([1, 3]))) == [1, 3]
    assert ids(b.select_indices(torch.tensor([True, False] * 3))) == [0, 2, 4]
    with pytest.raises(ValueError, match=r"indices \[6\] out of range for batch size 6"):
        b.select_indices([0, 6])
    r = BatchedDataDict(x=torch.tensor([1, 2]), log=[[{"c": "a"}], [{"c": "b"}]]).repeat_interleave(3)
    assert r["x"].tolist() == [1, 1, 1, 2, 2, 2]
    assert [m[0]["c"] for m in r["log"]] == ["a", "a", "a", "b", "b", "b"]
    r["log"][0].append({"c": "new"})  # copies must be independent (each gets its own generation)
    assert len(r["log"][1]) == 1
    with pytest.raises(ValueError, match="n must be a positive int"):
        b.repeat_interleave(0)


def test_microbatch_iterator():
    mbs = list(make(7).make_microbatch_iterator(3))
    assert [ids(m) for m in mbs] == [[0, 1, 2], [3, 4, 5], [6]]
    assert mbs[2]["text"] == ["s6"]
    assert list(BatchedDataDict(x=[]).make_microbatch_iterator(2)) == []
    with pytest.raises(ValueError, match="mb_size must be a positive int"):
        make(2).make_microbatch_iterator(0)


def test_length_sorted_microbatches_trim_per_token_tensors():
    lengths = torch.tensor([2, 6, 1, 6, 3])
    width = 7
    ids_ = torch.arange(5)[:, None] * 10 + torch.arange(width)[None]
    b = BatchedDataDict(input_ids=ids_, input_lengths=lengths, mask=torch.ones(5, width), lp=torch.zeros(5, width, 2),
                        weight=torch.arange(5.0), text=[f"s{i}" for i in range(5)], pair=torch.zeros(5, 2))
    out = list(b.make_length_sorted_microbatch_iterator(2))
    assert [idx for idx, _ in out] == [[1, 3], [4, 0], [2]]  # longest first; ties keep batch order
    widths = [mb["input_ids"].shape[1] for _, mb in out]
    assert widths == [6, 3, 1]
    for idx, mb in out:
        w = mb["input_ids"].shape[1]
        assert torch.equal(mb["input_ids"], ids_[idx, :w]) and mb["mask"].shape == (len(idx), w)
        assert mb["lp"].shape == (len(idx), w, 2) and mb["text"] == [f"s{i}" for i in idx]
        assert mb["weight"].tolist() == [float(i) for i in idx] and mb["pair"].shape == (len(idx), 2)
    whole = list(b.make_length_sorted_microbatch_iterator(5))  # fits in one: as given
    assert len(whole) == 1 and whole[0][0] == [0, 1, 2, 3, 4] and whole[0][1]["input_ids"].shape == (5, width)
    with pytest.raises(KeyError, match="need 'input_lengths' and 'input_ids'"):
        next(make(2).make_length_sorted_microbatch_iterator(2))


def test_to_get_dict_copy_pickle():
    b = make(2)
    assert b.to("cpu") is b and b["ids"].device.type == "cpu"
    d = b.get_dict()
    assert type(d) is dict and d["text"] == ["s0", "s1"]
    c = b.copy()
    assert type(c) is BatchedDataDict and c is not b
    c["new"] = [1, 2]
    assert "new" not in b
    p = pickle.loads(pickle.dumps(b))
    assert type(p) is BatchedDataDict and ids(p) == [0, 1] and p["text"] == ["s0", "s1"]
