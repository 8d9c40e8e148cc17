"""Seeded synthetic request streams in the Mooncake/Alibaba trace shape.

Four workloads, each a list of requests `{"timestamp", "input_length", "output_length",
"hash_ids"}` sorted by arrival (timestamps in milliseconds, as in the Mooncake traces):

- `chat`: multi-turn conversations. Each conversation opens with a system prompt drawn from a
  Zipf-popular pool; turn k resends the whole history (system prompt, every earlier user message
  and answer) plus a new user message, after a think time.
- `rag`: retrieval-augmented questions. A prompt is an instruction template, the retrieved
  documents in rank order (drawn from a Zipf-popular document pool) and a unique question.
- `agent`: tool-using agent loops. An agent type (Zipf-popular) fixes a long system prompt with
  tool definitions; a session adds a task, then every step resends the context grown by the last
  action and the tool's observation, seconds apart.
- `code`: a coding assistant in an editor. A prompt is a system prompt, the repository's map
  (Zipf-popular repositories) and the files the developer has open, the most recently edited
  last, then a new instruction; between requests the developer edits a file (its content, and
  every block after it in the prompt, change) or opens another one.

Prompts are built from *segments* (a system prompt, a document, a message) whose content is
identified by a key; a block's id is a function of its parent's id and the pieces of segments it
covers, so ids are prefix-chained exactly as in the real traces: equal ids at the same position
mean the same tokens after the same prefix. `hash_ids` covers `ceil(input_length / block_size)`
blocks, the last one possibly partial (a partial block never matches a later, longer one).

Same arguments and seed, same output, byte for byte (numpy's PCG64 generator). Command line:

    python -m tiered_cache.tools.workloads chat --requests 2000 --seed 0 > chat.jsonl
    python -m tiered_cache.tools.workloads rag --requests 500 --block-size 16 -o rag.jsonl

`tiered-cache replay --workload chat` replays a generated stream without writing a file. Bad
parameters raise ConfigError (a ValueError) naming the parameter.
"""

from __future__ import annotations

import heapq
import json
import sys
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import numpy as np

from tiered_cache.errors import ConfigError

Request = dict[str, Any]
Segment = tuple[Hashable, int]          # (content key, length in tokens)


class BlockIds:
    """Prefix-chained block ids for prompts made of segments.

    Block j's id is looked up by `(id of block j-1, pieces of block j)`, where a piece is
    `(segment key, first token, end token)` of a segment inside the block. Two prompts therefore
    share block j's id exactly when their first `(j + 1) * block_size` tokens are the same.
    """

    def __init__(self, block_size: int) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ConfigError("block_size", f"expected a positive int, got {block_size!r}")
        self.block_size = block_size
        self._ids: dict[tuple, int] = {}

    def __call__(self, segments: Iterable[Segment]) -> list[int]:
        bs = self.block_size
        out: list[int] = []
        pieces: list[tuple] = []
        room = bs                           # tokens left in the current block
        parent = -1
        for key, n in segments:
            start = 0
            while n - start > 0:
                take = min(room, n - start)
                pieces.append((key, start, start + take))
                start += take
                room -= take
                if room == 0:
                    parent = self._id(parent, pieces)
                    out.append(parent)
                    pieces, room = [], bs
        if pieces:
            out.append(self._id(parent, pieces))
        return out

    def _id(self, parent: int, pieces: list[tuple]) -> int:
        ident = (parent, tuple(pieces))
        found = self._ids.get(ident)
        if found is None:
            found = self._ids[ident] = len(self._ids)
        return found


def zipf_weights(n: int, a: float) -> np.ndarray:
    """Probabilities of ranks 1..n proportional to 1 / rank**a."""
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** a
    return w / w.sum()


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, lo: int, hi: int) -> int:
    """A lognormal integer with the given mean (not median), clipped to [lo, hi]."""
    mu = np.log(mean) - sigma * sigma / 2
    return int(np.clip(round(rng.lognormal(mu, sigma)), lo, hi))


def _finish(events: list[tuple[float, int, list[Segment], int]], ids: BlockIds,
            requests: int) -> list[Request]:
    """Sort (time, tiebreak, segments, output_length) events by arrival, keep the first
    `requests`, and turn them into trace records (ids assigned in arrival order)."""
    events.sort(key=lambda e: (e[0], e[1]))
    out: list[Request] = []
    for t, _, segments, output_length in events[:requests]:
        hash_ids = ids(segments)
        out.append({"timestamp": int(round(t * 1000)),
                    "input_length": int(sum(n for _, n in segments)),
                    "output_length": int(output_length), "hash_ids": hash_ids})
    return out


def _check(requests: int, block_size: int) -> None:
    if not isinstance(requests, int) or isinstance(requests, bool) or requests < 0:
        raise ConfigError("requests", f"expected a non-negative int, got {requests!r}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ConfigError("block_size", f"expected a positive int, got {block_size!r}")


def chat(requests: int = 4000, *, seed: int = 0, block_size: int = 512,
         num_system_prompts: int = 40, zipf_a: float = 1.1, mean_turns: float = 6.0,
         mean_user_tokens: float = 1500.0, think_time_s: float = 90.0,
         conversations_per_s: float = 2.0,
         max_context_tokens: int = 131_072) -> list[Request]:
    """Long-context multi-turn chat: Zipf-popular system prompts, growing histories, think time.

    - System prompt i (popularity rank i, Zipf `zipf_a`) is 300 to 12,000 tokens (lognormal,
      mean 2,500).
    - Conversations start as a Poisson process (`conversations_per_s`); the number of turns is
      geometric with mean `mean_turns` (at most 50), and a conversation ends early when its
      context would pass `max_context_tokens`.
    - A user message is 20 to 64K tokens (lognormal with mean `mean_user_tokens` and a heavy
      tail: mostly short questions, some pasted documents and code); an answer 10 to 2,000
      tokens (mean 400).
    - The next turn arrives after the answer's decode time (30 tokens/s) plus a think time of
      1 s to 1 hour, lognormal with mean `think_time_s` and sigma 1.5 (median a third of the
      mean: most replies come quickly, some users return much later).
    """
    _check(requests, block_size)
    rng = np.random.default_rng(seed)
    sys_len = [_lognormal(rng, 2500, 0.8, 300, 12000) for _ in range(num_system_prompts)]
    sys_p = zipf_weights(num_system_prompts, zipf_a)
    events: list[tuple[float, int, list[Segment], int]] = []
    t = 0.0
    conv = 0
    while _more(events, requests, t):
        t += rng.exponential(1.0 / conversations_per_s)
        s = int(rng.choice(num_system_prompts, p=sys_p))
        turns = min(50, int(rng.geometric(1.0 / mean_turns)))
        history: list[Segment] = [(("sys", s), sys_len[s])]
        length = sys_len[s]
        when = t
        for k in range(turns):
            user = _lognormal(rng, mean_user_tokens, 1.4, 20, 65536)
            answer = _lognormal(rng, 400, 0.9, 10, 2000)
            if length + user > max_context_tokens:
                break
            history = history + [(("user", conv, k), user)]
            events.append((when, len(events), history, answer))
            history = history + [(("answer", conv, k), answer)]
            length += user + answer
            when += answer / 30.0 + _lognormal_s(rng, think_time_s, 1.5, 1.0, 3600.0)
        conv += 1
    return _finish(events, BlockIds(block_size), requests)


def rag(requests: int = 4000, *, seed: int = 0, block_size: int = 512,
        num_documents: int = 5000, zipf_a: float = 1.0, docs_per_request: int = 4,
        mean_document_tokens: float = 3000.0, num_templates: int = 4,
        requests_per_s: float = 4.0) -> list[Request]:
    """Retrieval-augmented generation over a Zipf-popular document pool.

    - `num_templates` instruction templates (200 to 2,000 tokens, Zipf 1.0 over them).
    - `num_documents` documents of 200 to 32K tokens (lognormal with mean
      `mean_document_tokens`); document popularity is Zipf `zipf_a` over a random order.
    - A request retrieves 1 to 2 * `docs_per_request` - 1 distinct documents (mean
      `docs_per_request`), most relevant first, then asks a unique 20 to 400-token question;
      answers are 20 to 1,000 tokens. Poisson arrivals at `requests_per_s`.
    """
    _check(requests, block_size)
    rng = np.random.default_rng(seed)
    tmpl_len = [_lognormal(rng, 600, 0.6, 200, 2000) for _ in range(num_templates)]
    tmpl_p = zipf_weights(num_templates, 1.0)
    doc_len = [_lognormal(rng, mean_document_tokens, 1.0, 200, 32768)
               for _ in range(num_documents)]
    doc_p = zipf_weights(num_documents, zipf_a)[rng.permutation(num_documents)]
    events: list[tuple[float, int, list[Segment], int]] = []
    t = 0.0
    for i in range(requests):
        t += rng.exponential(1.0 / requests_per_s)
        tm = int(rng.choice(num_templates, p=tmpl_p))
        k = int(rng.integers(1, 2 * docs_per_request))
        docs = _distinct(rng, doc_p, k)
        segments: list[Segment] = [(("tmpl", tm), tmpl_len[tm])]
        segments += [(("doc", d), doc_len[d]) for d in docs]
        segments.append((("question", i), _lognormal(rng, 120, 0.8, 20, 400)))
        events.append((t, i, segments, _lognormal(rng, 200, 0.8, 20, 1000)))
    return _finish(events, BlockIds(block_size), requests)


def agent(requests: int = 4000, *, seed: int = 0, block_size: int = 512,
          num_agent_types: int = 12, zipf_a: float = 1.2, mean_steps: float = 15.0,
          mean_observation_tokens: float = 2000.0, sessions_per_s: float = 1.0,
          max_context_tokens: int = 131_072) -> list[Request]:
    """Tool-using agent loops whose context grows every step.

    - Agent type i (Zipf `zipf_a`) has a system prompt with tool definitions of 1,000 to 16,000
      tokens (lognormal, mean 5,000).
    - Sessions start as a Poisson process (`sessions_per_s`) with a 100 to 4,000-token task; the
      number of steps is geometric with mean `mean_steps` (at most 80), and a session ends early
      when its context would pass `max_context_tokens`.
    - Each step's request is the whole context so far; the model answers with an action of 20 to
      600 tokens, the tool returns an observation of 20 to 32K tokens (lognormal with mean
      `mean_observation_tokens`: file reads, search results, logs), and both are appended before
      the next step, which arrives after the action's decode time (50 tokens/s) plus a tool
      latency of 0.2 to 120 s (lognormal, mean 4 s).
    """
    _check(requests, block_size)
    rng = np.random.default_rng(seed)
    sys_len = [_lognormal(rng, 5000, 0.7, 1000, 16000) for _ in range(num_agent_types)]
    type_p = zipf_weights(num_agent_types, zipf_a)
    events: list[tuple[float, int, list[Segment], int]] = []
    t = 0.0
    session = 0
    while _more(events, requests, t):
        t += rng.exponential(1.0 / sessions_per_s)
        a = int(rng.choice(num_agent_types, p=type_p))
        steps = min(80, int(rng.geometric(1.0 / mean_steps)))
        task = _lognormal(rng, 800, 1.0, 100, 4000)
        context: list[Segment] = [(("agent", a), sys_len[a]), (("task", session), task)]
        length = sys_len[a] + task
        when = t
        for k in range(steps):
            action = _lognormal(rng, 150, 0.8, 20, 600)
            events.append((when, len(events), context, action))
            obs = _lognormal(rng, mean_observation_tokens, 1.3, 20, 32768)
            if length + action + obs > max_context_tokens:
                break
            context = context + [(("action", session, k), action), (("obs", session, k), obs)]
            length += action + obs
            when += action / 50.0 + _lognormal_s(rng, 4.0, 1.2, 0.2, 120.0)
        session += 1
    return _finish(events, BlockIds(block_size), requests)


def code(requests: int = 4000, *, seed: int = 0, block_size: int = 512,
         num_repos: int = 50, zipf_a: float = 1.1, files_per_repo: int = 300,
         mean_file_tokens: float = 1500.0, mean_open_files: float = 5.0,
         mean_requests: float = 20.0, think_time_s: float = 30.0, edit_prob: float = 0.6,
         open_prob: float = 0.15, sessions_per_s: float = 0.5,
         max_context_tokens: int = 131_072) -> list[Request]:
    """A coding assistant: repository context shared across developers, invalidated mid-prompt
    by edits.

    - 3 system prompts (1,000 to 4,000 tokens, Zipf 1.0 over them: completion, chat, edit).
    - `num_repos` repositories (Zipf `zipf_a`), each with a map of 500 to 16,000 tokens
      (lognormal, mean 3,000: the file tree and symbols an assistant sends first) and
      `files_per_repo` files of 100 to 16,000 tokens (lognormal, mean `mean_file_tokens`;
      Zipf 1.0 popularity within the repository).
    - Sessions start as a Poisson process (`sessions_per_s`): one developer, one system prompt,
      one repository, geometric(mean `mean_open_files` - 1, at least 1; at most 20) distinct
      open files in the order they were opened; geometric(mean `mean_requests`) requests (at most
      200), each the system prompt, the map, the open files and a 30 to 1,500-token
      instruction (answers 20 to 2,000 tokens).
    - Between requests (the answer's decode time at 50 tokens/s plus a think time of 2 s to
      30 minutes, lognormal with mean `think_time_s`): with probability `edit_prob` the
      developer edits an open file (the last one, the file being worked on, two times in
      three; another one otherwise), which gives it new content and moves it to the end, and
      with probability `open_prob` opens another file (appended). Unedited files are the
      repository's shared versions, so sessions that open the same files in the same order
      share their blocks; an edited file is the session's own. A session ends early when its
      prompt would pass `max_context_tokens`.
    """
    _check(requests, block_size)
    rng = np.random.default_rng(seed)
    sys_len = [_lognormal(rng, 2000, 0.5, 1000, 4000) for _ in range(3)]
    sys_p = zipf_weights(3, 1.0)
    repo_p = zipf_weights(num_repos, zipf_a)
    map_len = [_lognormal(rng, 3000, 0.9, 500, 16000) for _ in range(num_repos)]
    file_len = [[_lognormal(rng, mean_file_tokens, 1.0, 100, 16000)
                 for _ in range(files_per_repo)] for _ in range(num_repos)]
    file_p = zipf_weights(files_per_repo, 1.0)
    events: list[tuple[float, int, list[Segment], int]] = []
    t = 0.0
    session = 0
    while _more(events, requests, t):
        t += rng.exponential(1.0 / sessions_per_s)
        s = int(rng.choice(3, p=sys_p))
        repo = int(rng.choice(num_repos, p=repo_p))
        k = min(20, int(rng.geometric(1.0 / max(1.0, mean_open_files - 1.0))))
        # open files: [file index, version, length]; version 0 is the repository's own copy
        files = [[f, 0, file_len[repo][f]] for f in _distinct(rng, file_p, min(k, files_per_repo))]
        n = min(200, int(rng.geometric(1.0 / mean_requests)))
        when = t
        for i in range(n):
            segments: list[Segment] = [(("sys", s), sys_len[s]),
                                       (("map", repo), map_len[repo])]
            for f, v, length in files:
                key = ("file", repo, f) if v == 0 else ("file", repo, f, session, v)
                segments.append((key, length))
            segments.append((("ask", session, i), _lognormal(rng, 300, 0.9, 30, 1500)))
            if sum(length for _, length in segments) > max_context_tokens:
                break
            answer = _lognormal(rng, 400, 1.0, 20, 2000)
            events.append((when, len(events), segments, answer))
            if rng.random() < edit_prob:
                j = len(files) - 1 if rng.random() < 2 / 3 else int(rng.integers(len(files)))
                f, v, length = files.pop(j)
                grown = max(100, length + int(rng.normal(0, 0.05 * length + 20)))
                files.append([f, v + 1, grown])
            if rng.random() < open_prob and len(files) < files_per_repo:
                have = {f for f, _, _ in files}
                for f in _distinct(rng, file_p, min(files_per_repo, len(have) + 1)):
                    if f not in have:
                        files.append([f, 0, file_len[repo][f]])
                        break
            when += answer / 50.0 + _lognormal_s(rng, think_time_s, 1.3, 2.0, 1800.0)
        session += 1
    return _finish(events, BlockIds(block_size), requests)


def _lognormal_s(rng: np.random.Generator, mean: float, sigma: float, lo: float,
                 hi: float) -> float:
    mu = np.log(mean) - sigma * sigma / 2
    return float(np.clip(rng.lognormal(mu, sigma), lo, hi))


def _distinct(rng: np.random.Generator, p: np.ndarray, k: int) -> list[int]:
    """k distinct indices drawn by weight, in draw order (most relevant first)."""
    out: list[int] = []
    seen: set[int] = set()
    while len(out) < k:
        for d in rng.choice(len(p), size=2 * k, p=p):
            d = int(d)
            if d not in seen:
                seen.add(d)
                out.append(d)
                if len(out) == k:
                    break
    return out


def _more(events: list, requests: int, t: float) -> bool:
    """Whether to start another session after one that started at `t`: until there are
    `requests` events and the `requests`-th earliest of them is earlier than `t` (a later session
    cannot add a request among the first `requests` then)."""
    if len(events) < requests:
        return True
    return t < heapq.nsmallest(requests, (e[0] for e in events))[-1]


WORKLOADS: dict[str, Callable[..., list[Request]]] = {"chat": chat, "rag": rag, "agent": agent,
                                                     "code": code}


def generate(name: str, requests: int = 4000, *, seed: int = 0, block_size: int = 512,
             **params: Any) -> list[Request]:
    """The `name` workload (`chat`, `rag`, `agent` or `code`)."""
    try:
        fn = WORKLOADS[name]
    except KeyError:
        raise ConfigError("name", f"unknown workload {name!r}; expected one of "
                                  f"{sorted(WORKLOADS)}") from None
    return fn(requests, seed=seed, block_size=block_size, **params)


def write_jsonl(records: Iterable[Request], out) -> None:
    for r in records:
        out.write(json.dumps(r, separators=(", ", ": ")))
        out.write("\n")


def main(argv: list[str] | None = None) -> int:
    """`python -m tiered_cache.tools.workloads NAME ...`; returns the exit code. A reader that
    stops early (`| head`) ends it quietly."""
    from tiered_cache.tools import command

    prog = "python -m tiered_cache.tools.workloads"
    parser = command.ArgumentParser(
        prog=prog,
        description="Write a seeded synthetic request trace (Mooncake JSONL shape) to stdout.\n"
                    "Same arguments and seed, same output, byte for byte.")
    parser.add_argument("workload", choices=sorted(WORKLOADS), help="which workload")
    parser.add_argument("--requests", type=command.non_negative_int, default=4000,
                        help="requests")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--block-size", type=command.positive_int, default=512,
                        help="tokens per hash id (512: as the Mooncake traces)")
    parser.add_argument("-o", "--output", help="write to this file instead of stdout")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:               # --help or a usage error, already printed
        return exc.code if isinstance(exc.code, int) else command.EXIT_USAGE

    def body() -> int:
        records = generate(args.workload, args.requests, seed=args.seed,
                           block_size=args.block_size)
        if args.output:
            try:
                f = open(args.output, "w", encoding="utf-8")
            except OSError as exc:
                raise command.UsageError(f"--output: cannot write {args.output}: "
                                         f"{exc.strerror or exc}") from None
            with f:
                write_jsonl(records, f)
        else:
            write_jsonl(records, sys.stdout)
        return 0

    return command.run(body, prog)


if __name__ == "__main__":
    sys.exit(main())
