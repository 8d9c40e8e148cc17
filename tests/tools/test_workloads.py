"""Synthetic workload generators: determinism, trace shape, prefix chaining, structure."""

from __future__ import annotations

import json
import math

import pytest

from tiered_cache.tools import workloads
from tiered_cache.tools.workloads import WORKLOADS, BlockIds, generate

N = 600


@pytest.fixture(scope="module")
def traces():
    return {name: generate(name, N, seed=3) for name in WORKLOADS}


def test_block_ids_chain_on_content_and_position():
    ids = BlockIds(4)
    a = ids([("sys", 6), ("q", 3)])           # tokens: sys0..5 q0..2 -> blocks 4 | 4 | 1
    assert len(a) == 3
    b = ids([("sys", 6), ("q2", 5)])          # same first block, second block differs
    assert b[0] == a[0] and b[1] != a[1]
    c = ids([("sys", 6), ("q", 3), ("more", 4)])
    assert c[:2] == a[:2]                      # the full blocks of a are a prefix of c
    assert c[2] != a[2]                        # a's partial last block never matches
    d = ids([("other", 4), ("sys", 6)])
    assert d[0] != a[0] and d[1] != a[0]       # same content after another prefix: new ids
    assert ids([]) == []
    with pytest.raises(ValueError):
        BlockIds(0)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_output_other_seed_differs(name, traces):
    again = generate(name, N, seed=3)
    assert again == traces[name]
    assert generate(name, N, seed=4) != traces[name]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_shape(name, traces):
    recs = traces[name]
    assert len(recs) == N
    last = -1
    for r in recs:
        assert set(r) == {"timestamp", "input_length", "output_length", "hash_ids"}
        assert isinstance(r["timestamp"], int) and r["timestamp"] >= last
        last = r["timestamp"]
        assert r["input_length"] > 0 and r["output_length"] > 0
        assert len(r["hash_ids"]) == math.ceil(r["input_length"] / 512)
        assert all(isinstance(x, int) and 0 <= x < 2**31 for x in r["hash_ids"])
    json.dumps(recs)                                   # plain JSON types only


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_ids_are_prefix_chained(name, traces):
    parent: dict[int, int] = {}
    depth: dict[int, int] = {}
    for r in traces[name]:
        for j, x in enumerate(r["hash_ids"]):
            p = r["hash_ids"][j - 1] if j else -1
            assert parent.setdefault(x, p) == p, "an id must always follow the same parent"
            assert depth.setdefault(x, j) == j


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_block_size_is_a_parameter(name):
    small = generate(name, 50, seed=1, block_size=16)
    big = generate(name, 50, seed=1, block_size=512)
    assert [r["input_length"] for r in small] == [r["input_length"] for r in big]
    for r in small:
        assert len(r["hash_ids"]) == math.ceil(r["input_length"] / 16)


def reuse(recs):
    """Fraction of requested blocks an infinite cache would hit."""
    seen, hit, total = set(), 0, 0
    for r in recs:
        ids = r["hash_ids"]
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        hit += k
        total += len(ids)
        seen.update(ids)
    return hit / total


def test_chat_structure(traces):
    recs = traces["chat"]
    firsts = [r["hash_ids"][0] for r in recs]
    # Zipf-popular system prompts: the most common first block opens many conversations.
    top = max(set(firsts), key=firsts.count)
    assert firsts.count(top) > N / 20
    # Turns extend their conversation: some request's full blocks are a prefix of a later one.
    full = {tuple(r["hash_ids"][:r["input_length"] // 512]) for r in recs}
    assert any(tuple(r["hash_ids"][:k]) in full for r in recs
               for k in range(2, len(r["hash_ids"])))
    assert 0.3 < reuse(recs) < 0.95


def test_rag_structure(traces):
    recs = traces["rag"]
    assert 0.05 < reuse(recs) < 0.6
    assert all(r["input_length"] < 40 * 32768 for r in recs)


def test_agent_structure(traces):
    recs = traces["agent"]
    assert reuse(recs) > 0.6                  # every step resends the context so far
    assert max(r["input_length"] for r in recs) <= 131_072 + 600 + 32768


def test_code_structure(traces):
    recs = traces["code"]
    assert 0.4 < reuse(recs) < 0.95           # repository context is resent every request
    firsts = [r["hash_ids"][0] for r in recs]
    assert len(set(firsts)) <= 3              # three system prompts open every prompt
    # Requests of one session share a prefix and then diverge where an edit changed a file:
    # some consecutive pair of requests with the same second block (repository map) shares a
    # long prefix and then differs before the end.
    by_map: dict[int, list[list[int]]] = {}
    for r in recs:
        if len(r["hash_ids"]) > 1:
            by_map.setdefault(r["hash_ids"][1], []).append(r["hash_ids"])

    def common(a, b):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return k

    cut = [common(a, b) for chains in by_map.values() for a, b in zip(chains, chains[1:])]
    assert any(2 < k < len(chains[0]) - 1 for chains in by_map.values()
               for k in cut)
    assert len(by_map) > 5                    # many repositories, Zipf-popular
    assert max(r["input_length"] for r in recs) <= 131_072


def test_code_edits_invalidate_the_rest_of_the_prompt():
    """An edited file is new content: its blocks, and every block after it, change; the
    blocks before it stay those of the earlier request."""
    recs = workloads.code(400, seed=2, block_size=16, edit_prob=1.0, open_prob=0.0,
                          sessions_per_s=0.01, mean_requests=50.0)
    a, b = recs[0]["hash_ids"], recs[1]["hash_ids"]
    k = 0
    while a[k] == b[k]:
        k += 1
    assert 0 < k < len(a) - 1                 # same system prompt and map, then diverges
    assert not set(a[k:]) & set(b[k:])        # nothing after the edit is shared


@pytest.mark.parametrize("name,digest", [
    ("chat", "bd40bfe6ceb4ffcfe242001b"),
    ("rag", "c0c1f0777a69520229cff0f7"),
    ("agent", "8f59a33a60a60778aec76f61"),
])
def test_existing_families_are_unchanged_byte_for_byte(name, digest):
    """The three families generate the same bytes as before the `code` family was added
    (digests of their output at commit a44011e): traces, results and docs built on them stay
    comparable."""
    import hashlib

    got = hashlib.sha256(json.dumps(generate(name, 300, seed=5, block_size=64)).encode())
    assert got.hexdigest()[:24] == digest


def test_generate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown workload"):
        generate("video", 10)
    with pytest.raises(ValueError):
        workloads.chat(-1)
    assert workloads.rag(0) == []


def test_cli_writes_jsonl(capsys, tmp_path):
    assert workloads.main(["agent", "--requests", "20", "--seed", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 20
    assert [json.loads(x) for x in lines] == generate("agent", 20, seed=2)
    out = tmp_path / "rag.jsonl"
    assert workloads.main(["rag", "--requests", "7", "--block-size", "16", "-o", str(out)]) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert recs == generate("rag", 7, seed=0, block_size=16)


def test_bad_arguments_are_config_errors_naming_the_parameter():
    from tiered_cache.errors import ConfigError

    with pytest.raises(ConfigError, match="^requests: "):
        workloads.chat(-1)
    with pytest.raises(ConfigError, match="^block_size: "):
        workloads.agent(5, block_size=0)
    with pytest.raises(ConfigError, match="^block_size: "):
        BlockIds(True)


def test_cli_flag_errors_are_one_line_exit_2(capsys, tmp_path):
    assert workloads.main(["chat", "--requests", "-1"]) == 2
    err = capsys.readouterr().err
    assert err == ("python -m tiered_cache.tools.workloads: error: --requests: expected a "
                   "non-negative integer, got -1 (see python -m tiered_cache.tools.workloads "
                   "--help)\n")
    assert workloads.main(["chat", "-o", str(tmp_path / "no" / "such" / "dir.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m tiered_cache.tools.workloads: error: --output: cannot "
                          "write ") and len(err.splitlines()) == 1


@pytest.mark.slow
def test_cli_piped_into_head_ends_quietly():
    """`python -m tiered_cache.tools.workloads chat | head -n 1`: head exits after one line;
    the generator's next write fails, and it stops without a BrokenPipeError traceback."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "tiered_cache.tools.workloads", "chat", "--requests", "2000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # NOTE: 2,000 records are megabytes, far more than a pipe buffers, so the writer is
    # still writing when the reader goes away: its next write always fails.
    first = json.loads(proc.stdout.readline())
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert err == ""
    assert first == generate("chat", 1, seed=0)[0]
